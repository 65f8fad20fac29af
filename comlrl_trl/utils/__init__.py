"""Utilities users touch: reward processors and checkpoint metadata."""

from ..checkpoint import read_checkpoint_metadata
from .reward_processor import RewardProcessors


__all__ = ["RewardProcessors", "read_checkpoint_metadata"]
