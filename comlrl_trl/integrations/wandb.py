"""Weights & Biases logging driven by the `wandb_config` dictionary of CoMLRL's API.

`wandb` is imported only when a run is opened. Metrics are logged against `env_step` (joint-action reward
evaluations) rather than the optimiser step, as the multi-agent metrics are defined over environment steps.
"""

import importlib.util
import os
from numbers import Real
from typing import Any

from transformers import TrainerCallback


_RUNS_OPENED_HERE: set[str] = set()  # ids of the runs that a WandbRunCallback opened in this process

WANDB_CONFIG_KEYS = (
    "project",
    "entity",
    "name",
    "run_name",
    "tags",
    "dir",
    "config_sections",
    "id",
    "resume",
    "group",
    "notes",
    "mode",
)


def validate_wandb_config(wandb_config: dict[str, Any] | None) -> None:
    """Check a `wandb_config` at trainer construction, so that a typo fails before any training."""
    if wandb_config is None:
        return
    if not isinstance(wandb_config, dict):
        raise TypeError(f"wandb_config must be a dict or None, got {type(wandb_config).__name__}.")
    unknown = sorted(set(wandb_config) - set(WANDB_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"Unknown wandb_config keys {unknown}; supported keys are {list(WANDB_CONFIG_KEYS)}.")
    if "name" in wandb_config and "run_name" in wandb_config and wandb_config["name"] != wandb_config["run_name"]:
        raise ValueError("wandb_config sets both 'name' and 'run_name' to different values; set only one.")
    tags = wandb_config.get("tags")
    if tags is not None and not (isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags)):
        raise TypeError("wandb_config['tags'] must be a list of strings.")
    sections = wandb_config.get("config_sections")
    if sections is not None and not isinstance(sections, dict):
        raise TypeError("wandb_config['config_sections'] must be a dict of config sections.")
    if importlib.util.find_spec("wandb") is None:
        raise ImportError("wandb_config was given but wandb is not installed: pip install 'comlrl-trl[wandb]'.")


def verbose_from_wandb_config(wandb_config: dict[str, Any] | None) -> bool:
    """`config_sections.output.verbose` controls progress output (default True)."""
    sections = (wandb_config or {}).get("config_sections") or {}
    return bool((sections.get("output") or {}).get("verbose", True))


def wandb_init_kwargs(wandb_config: dict[str, Any], run_config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `wandb.init` for a `wandb_config` and the trainer's run configuration."""
    kwargs = {
        key: wandb_config[key]
        for key in ("project", "entity", "tags", "dir", "id", "resume", "group", "notes", "mode")
        if wandb_config.get(key) is not None
    }
    name = wandb_config.get("name", wandb_config.get("run_name"))
    if name is not None:
        kwargs["name"] = name
    if "tags" in kwargs:
        kwargs["tags"] = list(kwargs["tags"])
    kwargs["config"] = {**run_config, **(wandb_config.get("config_sections") or {})}
    return kwargs


class WandbRunCallback(TrainerCallback):
    """Opens the W&B run on first use and logs every trainer log, numeric values only, against `env_step`."""

    def __init__(self, wandb_config: dict[str, Any], run_config: dict[str, Any]):
        self.init_kwargs = wandb_init_kwargs(wandb_config, run_config)
        self.run = None

    def _ensure_run(self):
        """This trainer's run: a run the user opened is reused; one another trainer opened here is finished."""
        import wandb

        if self.run is None:
            active = wandb.run
            if active is not None and active.id in _RUNS_OPENED_HERE:
                active.finish()
                active = None
            if active is None:
                if "dir" in self.init_kwargs:
                    os.makedirs(self.init_kwargs["dir"], exist_ok=True)
                self.run = wandb.init(**self.init_kwargs)
                _RUNS_OPENED_HERE.add(self.run.id)
            else:
                self.run = active
                self.run.config.update(self.init_kwargs["config"], allow_val_change=True)
            self.run.define_metric("env_step")
            self.run.define_metric("*", step_metric="env_step")
        return self.run

    def identity(self) -> dict[str, str] | None:
        """The run's identity for checkpoints (`id`, `project`, `entity`), or None before a run is opened."""
        if self.run is None:
            return None
        identity = {"id": self.run.id, "project": self.run.project, "entity": self.run.entity}
        return {key: value for key, value in identity.items() if value}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        values = {k: v for k, v in logs.items() if isinstance(v, Real) and not isinstance(v, bool)}
        if values:
            self._ensure_run().log(values)
