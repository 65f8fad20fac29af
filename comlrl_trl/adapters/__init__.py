"""Adapters over the TRL trainers comlrl_trl extends: every private TRL name and deep TRL import the package uses
lives here (`grpo`, `reward`, `sampler`, `helpers`)."""
