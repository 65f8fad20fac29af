"""CoMLRL 1.4.3 configuration names: errors that say what replaced them.

CoMLRL configs carry fields that comlrl_trl has no use for (TRL, Accelerate and DeepSpeed took over their job)
and a few value spellings that comlrl_trl does not take. Passing one to a config class or writing one in a recipe
YAML file raises an error naming the replacement, instead of a bare "unexpected keyword argument". See
docs/migrating-from-comlrl.md for the whole mapping.
"""

import dataclasses
import difflib
import sys
import typing
from collections.abc import Collection, Iterable, Mapping
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
    # An algorithm's name where its group baseline is meant (`algorithm` in the recipes sets advantage_mode).
    **{
        ("advantage_mode", algorithm): (
            mode,
            f" ({algorithm.upper()}'s group baseline: advantage_mode names the baseline)",
        )
        for algorithm, mode in (("magrpo", "mean"), ("mareinforce", "raw"), ("marloo", "rloo"), ("maremax", "max"))
    },
}
_LOWER_CASE_FIELDS = ("joint_mode", "advantage_mode", "rl_algorithm", "algorithm")


def removed_field_message(name: str, where: str) -> str:
    return f"{where}: `{name}` is a CoMLRL field that comlrl_trl does not have; {REMOVED_FIELDS[name]}."


def renamed_value_message(name: str, value: Any, where: str, choices: Collection[str] | None = None) -> str | None:
    """The error for a CoMLRL spelling of a value (an alias or another case), or None if `value` is not one.

    With `choices` (the field's accepted values), a lower-case spelling is suggested only when it is one of them.
    """
    if not isinstance(value, str):
        return None
    renamed = RENAMED_VALUES.get((name, value.lower()))
    if renamed is not None:
        accepted, note = renamed
        return f"{where}: {name}={value!r} is CoMLRL's spelling; use {name}={accepted!r}{note}."
    if name in _LOWER_CASE_FIELDS and value != value.lower():
        if choices is None or value.lower() in choices:
            return f"{where}: {name}={value!r}: the names are lower-case here; use {name}={value.lower()!r}."
        return f"{where}: {name}={value!r} is not one of {', '.join(map(repr, choices))}."
    return None


def check_comlrl_names(
    settings: Mapping[str, Any],
    where: str,
    error: type[Exception] = TypeError,
    choices: Mapping[str, Collection[str]] | None = None,
) -> None:
    """Raise `error` for the first removed CoMLRL field or CoMLRL value spelling in `settings` (`choices`: the
    accepted values of the choice fields)."""
    for name, value in settings.items():
        if name in REMOVED_FIELDS:
            raise error(removed_field_message(name, where))
        message = renamed_value_message(name, value, where, (choices or {}).get(name))
        if message is not None:
            raise error(message)


def unknown_field_message(name: str, known: Iterable[str], where: str) -> str:
    """The error for a field no configuration has: the CoMLRL explanation, or the closest known name."""
    if name in REMOVED_FIELDS:
        return removed_field_message(name, where)
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"did you mean {close[0]!r}?" if close else "see the configuration class or --help for its fields."
    return f"unknown field {name!r} ({where}); {hint}"


def _choices(cls) -> dict[str, tuple]:
    """The accepted values of the `Literal` fields of dataclass `cls`."""
    return {
        f.name: typing.get_args(f.type) for f in dataclasses.fields(cls) if typing.get_origin(f.type) is typing.Literal
    }


def check_comlrl_options(argv: Iterable[str]) -> None:
    """Raise a ValueError for a removed CoMLRL field given as a command-line option (`--name` or `--name=value`)."""
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            if name in REMOVED_FIELDS:
                raise ValueError(removed_field_message(name, "command line"))


class CoMLRLFieldErrors:
    """Mixin of the configuration classes: a CoMLRL field or value spelling passed to the constructor is an error
    that names its replacement, and any other unknown keyword one that names the closest fields (checked before the
    dataclass `__init__`, which would only say "unexpected keyword argument")."""

    def __new__(cls, *args, **kwargs):
        check_comlrl_names(kwargs, cls.__name__, choices=_choices(cls))
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        for name in kwargs:
            if name not in known:
                raise TypeError(f"{cls.__name__}: " + unknown_field_message(name, known, "keyword argument"))
        return super().__new__(cls)


class CompatTrlParser(TrlParser):
    """TRL's `TrlParser` that explains unknown field names and checks the choices of values read from a YAML file.

    TrlParser turns unknown YAML keys and options into a generic "Unknown arguments" error and takes YAML values of
    choice options (`Literal` fields) without checking them; this parser names the replacement of a CoMLRL field,
    suggests the closest field for a typo (in the YAML file and on the command line) and refuses a YAML value
    outside an option's choices, naming the accepted ones.
    """

    _config_path: str | None = None

    def parse_args_and_config(self, args: Iterable[str] | None = None, *rest, **kwargs):
        args = list(args) if args is not None else sys.argv[1:]
        check_comlrl_options(args)
        self._config_path = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        if not rest and not kwargs.get("return_remaining_strings") and kwargs.get("fail_with_unknown_args", True):
            self._check_options(args)
        return super().parse_args_and_config(args, *rest, **kwargs)

    def _check_options(self, argv: list[str]) -> None:
        """A ValueError for the first `--name` on the command line that is no option, with the closest ones."""
        options = {option for action in self._actions for option in action.option_strings}
        for arg in argv:
            option = arg.split("=", 1)[0]
            if option in options or not option.startswith("--") or option == "--config":
                continue
            if self.allow_abbrev and any(known.startswith(option) for known in options):
                continue  # argparse takes a unique prefix, and names an ambiguous one itself
            known = [name[2:] for name in options if name.startswith("--") and "-" not in name[2:]]
            raise ValueError(unknown_field_message(option[2:], known, "on the command line"))

    def set_defaults_with_config(self, **config) -> list[str]:
        where = f"config file {self._config_path}" if self._config_path else "config file"
        choices = {action.dest: action.choices for action in self._actions if action.choices is not None}
        check_comlrl_names(config, "config file", error=ValueError, choices=choices)
        dests = {action.dest for action in self._actions}
        for name in config:
            if name not in dests:
                raise ValueError(unknown_field_message(name, sorted(dests - {"help"}), f"in {where}"))
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
