"""Per-agent settings: `agent_overrides=[{...}, {...}]` gives every agent its own optimiser and sampling values.

Every agent of a team is a TRL trainer built from its own copy of the configuration. `agent_overrides` holds one
dict per agent (`{}` keeps the configuration's values); its keys replace the fields below in that agent's copy
only, so the agent's optimizer, LR scheduler and generation config follow them (and, with the default
`logprob_temperature=None`, its log-probabilities, which are then at the agent's sampling temperature). Everything
else is a team setting: the rollout tree, the batch arithmetic and the loop must be the same for every agent, so
other fields are refused here.
"""

import copy
import json
import math
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import SchedulerType

from .compat import REMOVED_FIELDS, removed_field_message


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _non_negative(value) -> str | None:
    return None if _number(value) and value >= 0 else "a number >= 0"


def check_positive(value) -> str | None:
    """What `value` must be ("a number > 0") when it is not a finite positive number, else None; also used for
    team fields of the same kind."""
    return None if _number(value) and value > 0 else "a number > 0"


def _probability(value) -> str | None:
    return None if _number(value) and 0 < value <= 1 else "a number in (0, 1]"


def _adam_beta(value) -> str | None:
    return None if _number(value) and 0 <= value < 1 else "a number in [0, 1)"


def _optional_fraction(value) -> str | None:
    return None if value is None or (_number(value) and 0 <= value <= 1) else "None or a number in [0, 1]"


def _positive_int(value) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "an integer >= 1"


def _top_k(value) -> str | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    return None if ok else "None or an integer >= 0 (None and 0 disable top-k)"


def _mapping(value) -> str | None:
    return None if isinstance(value, dict) else "a dict"


def _scheduler(value) -> str | None:
    try:
        SchedulerType(value)
    except ValueError:
        return f"one of {', '.join(repr(s.value) for s in SchedulerType)}"
    return None


# Per-agent key -> check returning what the value must be (None when it is fine).
PER_AGENT_FIELDS: dict[str, Callable[[Any], str | None]] = {
    "learning_rate": _non_negative,
    "lr_scheduler_type": _scheduler,
    "lr_scheduler_kwargs": _mapping,
    "warmup_steps": _non_negative,
    "weight_decay": _non_negative,
    "adam_beta1": _adam_beta,
    "adam_beta2": _adam_beta,
    "adam_epsilon": check_positive,
    "temperature": check_positive,
    "top_p": _probability,
    "top_k": _top_k,
    "min_p": _optional_fraction,
    "repetition_penalty": check_positive,
    "max_completion_length": _positive_int,
    "generation_kwargs": _mapping,
}
# CoMLRL's documented names of two of them.
ALIASES = {"agent_learning_rate": "learning_rate", "max_new_tokens": "max_completion_length"}


def validate_agent_overrides(config) -> list[dict[str, Any]] | None:
    """Check `config.agent_overrides` and return it with canonical keys (aliases resolved), or None.

    A JSON string (from the command line) is parsed first. There must be one dict per agent; a team field, an
    unknown key or a bad value is a ValueError naming the agent and the key.
    """
    overrides = config.agent_overrides
    if overrides is None:
        return None
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as error:
            raise ValueError(f"agent_overrides must be a JSON list of dicts on the command line: {error}.") from None
    n = config.num_agents
    if not isinstance(overrides, (list, tuple)) or len(overrides) != n:
        raise ValueError(
            f"agent_overrides must be a list of num_agents={n} dicts (one per agent, {{}} to keep the "
            f"configuration's values), got {overrides!r}."
        )
    return [_canonical(i, entry, type(config)) for i, entry in enumerate(overrides)]


def _canonical(i: int, entry, config_cls) -> dict[str, Any]:
    where = f"agent_overrides[{i}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a dict of per-agent settings ({{}} for none), got {entry!r}.")
    canonical: dict[str, Any] = {}
    for key, value in entry.items():
        name = ALIASES.get(key, key)
        if name not in PER_AGENT_FIELDS:
            raise ValueError(_refusal(where, key, config_cls))
        problem = PER_AGENT_FIELDS[name](value)
        if problem is not None:
            raise ValueError(f"{where}: {key} must be {problem}, got {value!r}.")
        if name in canonical and canonical[name] != value:
            raise ValueError(
                f"{where} sets {name} twice with different values ({canonical[name]!r} and {value!r} "
                f"through {key}); set only one of them."
            )
        canonical[name] = value
    return canonical


def _refusal(where: str, key: str, config_cls) -> str:
    allowed = ", ".join(sorted([*PER_AGENT_FIELDS, *ALIASES]))
    if key in REMOVED_FIELDS:
        return removed_field_message(key, where)
    if key in config_cls.__dataclass_fields__:
        return (
            f"{where}: {key} is a team setting (the rollout, batches and loop are shared by every agent); set it "
            f"on the configuration itself. Per-agent keys: {allowed}."
        )
    return f"{where}: unknown key {key!r}. Per-agent keys: {allowed}."


def agent_config(config, index: int):
    """Agent `index`'s configuration: `config` itself without overrides for it, else a copy with them applied.

    A deep copy, never a new instance: creating TrainingArguments while trainers exist resets Accelerate's state.
    """
    overrides = (config.agent_overrides or [{}] * config.num_agents)[index]
    if not overrides:
        return config
    agent = copy.deepcopy(config)
    for name, value in overrides.items():
        if name == "lr_scheduler_type":
            value = SchedulerType(value)
        elif name == "top_k" and value is None:
            value = 0
        setattr(agent, name, value)
    agent.agent_learning_rate = agent.learning_rate
    agent.max_new_tokens = agent.max_completion_length
    return agent
