"""The actor-critic family: IAC (a critic per agent) and MAAC (one centralised critic)."""

from .ac_config import ActorCriticConfig, IACConfig, MAACConfig
from .iac_trainer import IACTrainer
from .maac_trainer import MAACTrainer
from .rollout import RolloutSample


__all__ = ["ActorCriticConfig", "IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer", "RolloutSample"]
