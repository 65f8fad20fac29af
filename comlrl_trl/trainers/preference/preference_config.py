"""The preference-pair fields shared by MADPO and MARLHF."""

from dataclasses import dataclass, field
from typing import Literal

from ...core.preferences import PAIR_SELECTIONS
from ..team.config import TeamConfig


@dataclass
class PreferenceConfig(TeamConfig):
    r"""
    Base configuration of the preference-based trainers ([`MADPOConfig`], [`MARLHFConfig`]).

    Every [`MAGRPOConfig`] field keeps its meaning. Preference trainers are single-turn (`num_turns=1`) and use
    aligned joint candidates (`joint_mode="align"`): candidate j is the j-th completion of every agent.

    Parameters:
        preference_num_candidates (`int`, *optional*, defaults to `80`):
            Joint candidates C sampled per task item (at least 2); the task reward ranks them.
        preference_pairs_per_sample (`int` or `None`, *optional*, defaults to `16`):
            At most this many chosen/rejected pairs per task item; `None` keeps every pair with distinct rewards
            (required with `pair_selection="all"`).
        pair_selection (`str`, *optional*, defaults to `"reward_gap"`):
            Which pairs are kept: `"reward_gap"` (largest reward gap first), `"all"`, or `"random"` (a random
            order seeded from `seed`). Pairs with equal rewards are never formed.
    """

    preference_num_candidates: int = field(
        default=80, metadata={"help": "Joint candidates sampled per task item (>= 2)."}
    )
    preference_pairs_per_sample: int | None = field(
        default=16, metadata={"help": "Maximum chosen/rejected pairs per task item; None: all (required with 'all')."}
    )
    pair_selection: Literal["reward_gap", "all", "random"] = field(
        default="reward_gap", metadata={"help": "Pair choice: 'reward_gap', 'all' or 'random'."}
    )

    _default_generation_spans_updates = False  # pairs are formed and trained per generation, on-policy

    def __post_init__(self):
        self._validate_preference_fields()
        super().__post_init__()

    def _validate_preference_fields(self):
        name = type(self).__name__
        count = self.preference_num_candidates
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(
                f"preference_num_candidates must be an integer >= 2 (a pair needs two candidates), got {count!r}."
            )
        if self.pair_selection not in PAIR_SELECTIONS:
            raise ValueError(
                f"pair_selection must be one of {', '.join(map(repr, PAIR_SELECTIONS))}; got {self.pair_selection!r}."
            )
        cap = self.preference_pairs_per_sample
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"preference_pairs_per_sample must be a positive integer or None, got {cap!r}.")
        if self.pair_selection == "all" and cap is not None:
            raise ValueError(
                f"preference_pairs_per_sample must be None with pair_selection='all' (every pair is kept); got {cap}."
            )
        if self.num_turns != 1:
            raise ValueError(
                f"{name} supports num_turns=1 only (preferences compare single-turn joint responses), "
                f"got num_turns={self.num_turns}."
            )
        if self.joint_mode != "align":
            raise ValueError(
                f"{name} supports joint_mode='align' only (candidate j is the j-th completion of every "
                f"agent), got {self.joint_mode!r}."
            )
