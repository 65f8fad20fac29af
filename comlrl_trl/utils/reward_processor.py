"""The documented import path of the reward processors (CoMLRL's `comlrl.utils.reward_processor`).

They live in `comlrl_trl.joint_reward`, beside the code that applies them to every reward.
"""

from ..joint_reward import RewardProcessors


__all__ = ["RewardProcessors"]
