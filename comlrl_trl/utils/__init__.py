"""Utilities users touch: reward processors."""

from .reward_processor import RewardProcessors


__all__ = ["RewardProcessors"]
