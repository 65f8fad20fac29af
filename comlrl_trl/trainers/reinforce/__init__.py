"""The REINFORCE family: MAGRPO and its baselines (MAREINFORCE, MARLOO, MAReMax)."""

from .magrpo_config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from .magrpo_trainer import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer


__all__ = [
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "MAREINFORCEConfig",
    "MAREINFORCETrainer",
    "MARLOOConfig",
    "MARLOOTrainer",
    "MAReMaxConfig",
    "MAReMaxTrainer",
]
