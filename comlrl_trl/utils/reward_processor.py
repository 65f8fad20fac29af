"""Reward processors: small callables applied to every reward the reward function returns."""

from collections.abc import Callable


class RewardProcessors:
    """Factories of `float -> float` reward transforms, passed to trainers as `reward_processor`.

    >>> RewardProcessors.scale(factor=10.0)(0.5)
    5.0
    >>> RewardProcessors.shift(value=-1.0)(0.5)
    -0.5
    """

    @staticmethod
    def scale(factor: float = 1.0) -> Callable[[float], float]:
        """Multiply every reward by `factor`."""
        return lambda reward: reward * factor

    @staticmethod
    def shift(value: float = 0.0) -> Callable[[float], float]:
        """Add `value` to every reward."""
        return lambda reward: reward + value
