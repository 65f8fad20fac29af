"""MAGRPO's configuration and its REINFORCE variants: the team's fields ([`TeamConfig`]) with each baseline."""

from dataclasses import dataclass, field
from typing import Literal

from ..team.config import TeamConfig


@dataclass
class MAGRPOConfig(TeamConfig):
    """Configuration class for [`MAGRPOTrainer`]: multi-agent group relative policy optimisation.

    Every [`TeamConfig`] field (and so every [`~trl.GRPOConfig`] field) with its meaning and default
    (docs/configuration.md); `advantage_mode` picks the group baseline ("mean" here).
    """


@dataclass
class MAREINFORCEConfig(MAGRPOConfig):
    """[`MAGRPOConfig`] with `advantage_mode="raw"`: REINFORCE on the joint return, no baseline."""

    advantage_mode: Literal["mean", "raw", "max", "rloo"] = field(default="raw", metadata={"help": "Group baseline."})


@dataclass
class MARLOOConfig(MAGRPOConfig):
    """[`MAGRPOConfig`] with `advantage_mode="rloo"`: the baseline is the mean return of the other K-1 samples."""

    advantage_mode: Literal["mean", "raw", "max", "rloo"] = field(default="rloo", metadata={"help": "Group baseline."})


@dataclass
class MAReMaxConfig(MAGRPOConfig):
    """[`MAGRPOConfig`] with `advantage_mode="max"`: the baseline is the best return of the group."""

    advantage_mode: Literal["mean", "raw", "max", "rloo"] = field(default="max", metadata={"help": "Group baseline."})
