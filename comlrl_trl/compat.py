"""CoMLRL 1.4.3 configuration names: errors that say what replaced them.

CoMLRL configs carry fields that comlrl_trl has no use for (TRL, Accelerate and DeepSpeed took over their job)
and a few value spellings that comlrl_trl does not take. Passing one to a config class or writing one in a recipe
YAML file raises an error naming the replacement, instead of a bare "unexpected keyword argument". See
docs/migrating-from-comlrl.md for the whole mapping.
"""

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from trl import TrlParser


_DEVICES = (
    "devices are placed by Accelerate: launch with `accelerate launch` (DDP, DeepSpeed ZeRO-2/3; "
    "configs in recipes/accelerate/) and every process holds its share of every agent"
)
_NOT_IMPLEMENTED = (
    "comlrl_trl does not implement CoMLRL's iterative comparator policies and preference replay; "
    "remove the field (see docs/migrating-from-comlrl.md)"
)

# CoMLRL field -> what to use instead.
REMOVED_FIELDS: dict[str, str] = {
    "reference_kl_coef": "use TRL's `beta` (>= 0): beta > 0 loads a frozen reference model per agent and adds "
    "beta * KL to the loss",
    "reference_kl_enabled": "set TRL's `beta` > 0 to turn the reference KL on (beta=0, the default, is off)",
    "reference_devices": "the reference model lives with its agent; " + _DEVICES,
    "rollout_buffer_size": "use `per_device_train_batch_size` (completions per agent and step: rollout_buffer_size "
    "task items are rollout_buffer_size * num_generations completions) and "
    "`steps_per_generation` (optimizer steps per rollout)",
    "train_batch_size": "use `per_device_train_batch_size` = train_batch_size * num_generations (completions per "
    "agent and step) and `steps_per_generation` = rollout_buffer_size / train_batch_size",
    "parallel_training": _DEVICES,
    "agent_devices": _DEVICES,
    "critic_devices": _DEVICES,
    "comparator_devices": _DEVICES,
    "collaboration_mode": "centralised MAGRPO is its own class: CentralizedMAGRPOTrainer with CentralizedMAGRPOConfig "
    "(no field needed); centralised MADPO/MARLHF are not implemented",
    "use_environment_step": "MADPO counts env_step as the joint candidates it scores, like MAGRPO; remove the field",
    "environment_steps_per_pair": "MADPO counts env_step as the joint candidates it scores, like MAGRPO; remove "
    "the field",
    **{
        name: _NOT_IMPLEMENTED
        for name in (
            "comparator_policy",
            "comparator_generation_mode",
            "comparator_centralized_agent_index",
            "comparator_model_name",
            "comparator_agents",
            "comparator_num_candidates",
            "comparator_history_k",
            "comparator_api_url",
            "comparator_api_format",
            "comparator_api_model",
            "comparator_api_max_n_per_request",
            "comparator_api_timeout",
            "comparator_api_headers",
            "comparator_api_key",
            "comparator_api_key_env",
            "comparator_api_key_header",
            "comparator_api_key_prefix",
            "comparator_api_response_field",
            "comparator_api_extra_body",
            "preference_replay_mode",
            "preference_replay_k",
            "preference_replay_lambda",
            "preference_replay_sample_size",
            "preference_replay_dir",
            "preference_scoring_reward",
            "log_reward_distribution",
            "policy_checkpoint_dir",
        )
    },
}

# (field, CoMLRL value) -> the value comlrl_trl takes, with a note when the behaviour differs.
RENAMED_VALUES: dict[tuple[str, str], tuple[str, str]] = {
    ("joint_mode", "aligned"): ("align", ""),
    ("joint_mode", "crossed"): (
        "cross",
        " (CoMLRL 1.4.3 scored all K^N joint actions for 'crossed' but then "
        "trained each agent's K completions on the first K joint returns, a bug: "
        "results will differ)",
    ),
    ("rl_algorithm", "mareforce"): ("mareinforce", ""),
}
_LOWER_CASE_FIELDS = ("joint_mode", "advantage_mode", "rl_algorithm", "algorithm")


def removed_field_message(name: str, where: str) -> str:
    return f"{where}: `{name}` is a CoMLRL field that comlrl_trl does not have; {REMOVED_FIELDS[name]}."


def renamed_value_message(name: str, value: Any, where: str) -> str | None:
    """The error for a CoMLRL spelling of a value (an alias or another case), or None if `value` is not one."""
    if not isinstance(value, str):
        return None
    renamed = RENAMED_VALUES.get((name, value.lower()))
    if renamed is not None:
        accepted, note = renamed
        return f"{where}: {name}={value!r} is CoMLRL's spelling; use {name}={accepted!r}{note}."
    if name in _LOWER_CASE_FIELDS and value != value.lower():
        return f"{where}: {name}={value!r}: the names are lower-case here; use {name}={value.lower()!r}."
    return None


def check_comlrl_names(settings: Mapping[str, Any], where: str, error: type[Exception] = TypeError) -> None:
    """Raise `error` for the first removed CoMLRL field or CoMLRL value spelling in `settings`."""
    for name, value in settings.items():
        if name in REMOVED_FIELDS:
            raise error(removed_field_message(name, where))
        message = renamed_value_message(name, value, where)
        if message is not None:
            raise error(message)


def check_comlrl_options(argv: Iterable[str]) -> None:
    """Raise a ValueError for a removed CoMLRL field given as a command-line option (`--name` or `--name=value`)."""
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            if name in REMOVED_FIELDS:
                raise ValueError(removed_field_message(name, "command line"))


class CoMLRLFieldErrors:
    """Mixin of the configuration classes: a CoMLRL field or value spelling passed to the constructor is an error
    that names its replacement (checked before the dataclass `__init__`, which would only say "unexpected")."""

    def __new__(cls, *args, **kwargs):
        check_comlrl_names(kwargs, cls.__name__)
        return super().__new__(cls)


class CompatTrlParser(TrlParser):
    """TRL's `TrlParser` that explains CoMLRL field names and checks the choices of values read from a YAML file.

    TrlParser turns unknown YAML keys into a generic "Unknown arguments" error and takes YAML values of choice
    options (`Literal` fields) without checking them; this parser names the replacement of a CoMLRL field (on the
    command line too) and refuses a YAML value outside an option's choices, naming the accepted ones.
    """

    def parse_args_and_config(self, args: Iterable[str] | None = None, *rest, **kwargs):
        args = list(args) if args is not None else sys.argv[1:]
        check_comlrl_options(args)
        return super().parse_args_and_config(args, *rest, **kwargs)

    def set_defaults_with_config(self, **config) -> list[str]:
        check_comlrl_names(config, "config file", error=ValueError)
        for action in self._actions:
            if action.choices is None or config.get(action.dest) is None:
                continue
            value = config[action.dest]
            for item in value if isinstance(value, list) else [value]:
                if item not in action.choices:
                    raise ValueError(
                        f"config file: {action.dest}={item!r} is not one of {', '.join(map(repr, action.choices))}."
                    )
        return super().set_defaults_with_config(**config)
