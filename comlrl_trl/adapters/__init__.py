"""Adapters over the TRL trainers comlrl_trl extends: every private TRL name the package uses lives here."""
