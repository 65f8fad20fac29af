"""The team base every family builds on: the loop ([`TeamTrainer`]), its configuration ([`TeamConfig`]),
checkpoints, evaluation and custom-metrics hooks. Users import a family (`comlrl_trl.trainers.reinforce`, ...)."""

from .config import TeamConfig
from .trainer import TeamTrainer


__all__ = ["TeamConfig", "TeamTrainer"]
