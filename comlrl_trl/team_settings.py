"""The sampling settings of a saved team, so that a later evaluation generates the way the run did.

`trainer.save_model(dir)` writes `dir/team_settings.json` next to the `agent_i/` directories: the comlrl_trl
version, the configuration class and, under `"generation"`, every setting that changes what the agents generate
and how a path is scored (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
`generation_kwargs`, `max_prompt_length`, `num_turns`, `discount`, ..., and the sampling keys of each agent's
`agent_overrides`). The recipes add a `"recipe"` section (task, chat formatting, data and reward options, and
`reward`: the reward function the run used, the user's `--reward_func` when it replaced the task's).
`recipes/evaluate.py --model_dir dir` defaults to these values. A reward scored with other sampling settings (the
evaluate script's own defaults are 256 new tokens at T=0.8) is not comparable with the run's evaluations.

The file is human-readable JSON; transformers' `generation_config.json` inside an agent directory is a different
file (one model's defaults, not the team's).
"""

import json
import os
from typing import Any

from . import __version__
from .agent_overrides import validate_agent_overrides


TEAM_SETTINGS_NAME = "team_settings.json"

# Configuration fields that decide what the agents generate and how an evaluation path is scored.
GENERATION_FIELDS = (
    "num_agents",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "generation_kwargs",
    "max_prompt_length",
    "num_turns",
    "discount",
    "early_termination_threshold",
    "external_prompt_passthrough",
    "num_generations",
)
# Keys of `agent_overrides` that change an agent's sampling (the optimiser keys do not matter to an evaluation).
AGENT_GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "generation_kwargs",
)


def team_settings(config, recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dict that `team_settings.json` holds for a team trained with `config` (a `MAGRPOConfig` or subclass).

    `recipe` holds the options of the script that built the trainer (task, `chat`, data), or None.
    """
    generation = {name: getattr(config, name) for name in GENERATION_FIELDS if hasattr(config, name)}
    overrides = validate_agent_overrides(config)
    sampling = [{k: v for k, v in entry.items() if k in AGENT_GENERATION_KEYS} for entry in overrides or []]
    generation["agent_overrides"] = sampling if any(sampling) else None
    settings = {
        "comlrl_trl_version": __version__,
        "config_class": type(config).__name__,
        "generation": generation,
    }
    if recipe is not None:
        settings["recipe"] = recipe_section(recipe)
    return settings


def recipe_section(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe's options, plus `reward`: the reward function the run really used. With a `reward_func` (the
    user's `module:function`) the task's reward, formatters and transition were replaced, which `task_replaced`
    says; `task` is then only the task module the options were read with. Without one, the task's own reward."""
    section = dict(recipe)
    if "task" in section and "reward_func" in section:
        replaced = section["reward_func"] is not None
        section["reward"] = section["reward_func"] if replaced else f"comlrl_trl.tasks.{section['task']}:reward"
        section["task_replaced"] = replaced
    return section


def write_team_settings(output_dir: str, config, recipe: dict[str, Any] | None = None) -> str:
    """Write [`team_settings`] to `output_dir/team_settings.json` (whole or not at all) and return its path."""
    path = os.path.join(output_dir, TEAM_SETTINGS_NAME)
    os.makedirs(output_dir, exist_ok=True)
    text = json.dumps(team_settings(config, recipe), indent=2, default=repr)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        f.write(text + "\n")
    os.replace(partial, path)
    return path


def read_team_settings(directory: str) -> dict[str, Any] | None:
    """The settings saved in `directory/team_settings.json`, or None when there is no such file (an older save, or
    a directory not written by `save_model`). A file that is not a JSON object is a ValueError naming it."""
    path = os.path.join(directory, TEAM_SETTINGS_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            settings = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); delete it or write it again.") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("generation"), dict):
        raise ValueError(f"{path} must be a JSON object with a 'generation' object, as save_model writes it.")
    return settings
