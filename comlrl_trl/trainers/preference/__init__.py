"""The preference family: MARLHF (a learned joint reward model, then online RL), its iterative version, and MADPO
(joint direct preference optimisation)."""

from ...centralized import (
    CentralizedComparatorAdapter,
    CentralizedComparatorParseError,
    TaggedCentralizedComparatorAdapter,
)
from .madpo_config import MADPOConfig
from .madpo_trainer import MADPOTrainer
from .marlhf_config import MARLHFConfig, MARLHFIterConfig
from .marlhf_trainer import MARLHFIterTrainer, MARLHFTrainer
from .pairs import PreferencePair
from .preference_config import PreferenceConfig
from .reward_model import JointRewardTrainer


__all__ = [
    "CentralizedComparatorAdapter",
    "CentralizedComparatorParseError",
    "JointRewardTrainer",
    "MADPOConfig",
    "MADPOTrainer",
    "MARLHFConfig",
    "MARLHFIterConfig",
    "MARLHFIterTrainer",
    "MARLHFTrainer",
    "PreferenceConfig",
    "PreferencePair",
    "TaggedCentralizedComparatorAdapter",
]
