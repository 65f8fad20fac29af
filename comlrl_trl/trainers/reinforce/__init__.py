"""The REINFORCE family: MAGRPO and its baselines (MAREINFORCE, MARLOO, MAReMax), and centralised MAGRPO."""

from .centralized_magrpo import CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer
from .magrpo_config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from .magrpo_trainer import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer


__all__ = [
    "CentralizedMAGRPOConfig",
    "CentralizedMAGRPOTrainer",
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "MAREINFORCEConfig",
    "MAREINFORCETrainer",
    "MARLOOConfig",
    "MARLOOTrainer",
    "MAReMaxConfig",
    "MAReMaxTrainer",
]
