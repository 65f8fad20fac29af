"""The algorithms of comlrl_trl by the names users type (`--algorithm magrpo`, `rl_algorithm="iac"`), each with its
trainer and configuration classes.

    >>> from comlrl_trl.algorithms import get_algorithm
    >>> algorithm = get_algorithm("marloo")
    >>> algorithm.trainer_cls.__name__, algorithm.config_cls.__name__, algorithm.family, algorithm.advantage_mode
    ('MARLOOTrainer', 'MARLOOConfig', 'reinforce', 'rloo')

The classes are imported when an algorithm is looked up, not when this module is imported, so that trainer modules
may import this one (`comlrl_trl.trainers.preference` looks up its online RL stage here). Looking up an algorithm
imports its family's package, `comlrl_trl.trainers.<family>`: do it at call time, not while that package is being
imported.
"""

import importlib
from typing import NamedTuple


class Algorithm(NamedTuple):
    """One algorithm: the name users type, its trainer and configuration classes, and its family (the package
    `comlrl_trl.trainers.<family>` that holds them). `advantage_mode` is the group baseline of the decentralised
    REINFORCE family (the default of its configuration class) and None for every other algorithm."""

    name: str
    trainer_cls: type
    config_cls: type
    family: str
    advantage_mode: str | None = None


# name -> (family, trainer class name, configuration class name, advantage_mode)
_ALGORITHMS: dict[str, tuple[str, str, str, str | None]] = {
    "magrpo": ("reinforce", "MAGRPOTrainer", "MAGRPOConfig", "mean"),
    "mareinforce": ("reinforce", "MAREINFORCETrainer", "MAREINFORCEConfig", "raw"),
    "marloo": ("reinforce", "MARLOOTrainer", "MARLOOConfig", "rloo"),
    "maremax": ("reinforce", "MAReMaxTrainer", "MAReMaxConfig", "max"),
    "centralized_magrpo": ("reinforce", "CentralizedMAGRPOTrainer", "CentralizedMAGRPOConfig", None),
    "iac": ("actor_critic", "IACTrainer", "IACConfig", None),
    "maac": ("actor_critic", "MAACTrainer", "MAACConfig", None),
    "madpo": ("preference", "MADPOTrainer", "MADPOConfig", None),
    "marlhf": ("preference", "MARLHFTrainer", "MARLHFConfig", None),
    "marlhf_iter": ("preference", "MARLHFIterTrainer", "MARLHFIterConfig", None),
}

# Every name, in the order above.
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)
# The decentralised REINFORCE family: one trainer that differs only in the group baseline (`advantage_mode`).
REINFORCE_ALGORITHMS: tuple[str, ...] = tuple(
    name
    for name, (family, _, _, advantage_mode) in _ALGORITHMS.items()
    if family == "reinforce" and advantage_mode is not None
)
# Actor-critic: a critic per agent (IAC) or one centralised critic (MAAC).
ACTOR_CRITIC_ALGORITHMS: tuple[str, ...] = tuple(
    name for name, (family, *_) in _ALGORITHMS.items() if family == "actor_critic"
)
# The team trainers that MARLHF's online RL stage can run (`MARLHFConfig.rl_algorithm`).
RL_STAGE_ALGORITHMS: tuple[str, ...] = REINFORCE_ALGORITHMS + ACTOR_CRITIC_ALGORITHMS


def get_algorithm(name: str) -> Algorithm:
    """The [`Algorithm`] called `name` (one of `ALGORITHMS`), with its classes imported.

    Raises:
        ValueError: `name` is not a known algorithm; the message lists the known ones.
    """
    if name not in _ALGORITHMS:
        raise ValueError(f"Unknown algorithm {name!r}; the known algorithms are {', '.join(ALGORITHMS)}.")
    family, trainer_name, config_name, advantage_mode = _ALGORITHMS[name]
    package = importlib.import_module(f"comlrl_trl.trainers.{family}")
    return Algorithm(name, getattr(package, trainer_name), getattr(package, config_name), family, advantage_mode)
