"""The documented import paths of CoMLRL's `comlrl.utils` names; nothing is defined here.

`RewardProcessors` lives in `comlrl_trl.joint_reward` (also importable as `comlrl_trl.utils.reward_processor`),
`read_checkpoint_metadata` in `comlrl_trl.checkpoint`.
"""

from ..checkpoint import read_checkpoint_metadata
from ..joint_reward import RewardProcessors


__all__ = ["RewardProcessors", "read_checkpoint_metadata"]
