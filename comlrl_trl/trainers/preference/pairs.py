"""Preference pairs of joint responses: what they hold, how they are stored and how they become reward-model rows."""

import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ...core.preferences import select_preference_pairs


@dataclass
class PreferencePair:
    """Two joint responses to one task item, the chosen one with the higher task reward.

    `prompts`, `chosen` and `rejected` hold one entry per agent, in actor order.
    """

    item_index: int
    prompts: list[Any]
    chosen: list[str]
    rejected: list[str]
    chosen_reward: float
    rejected_reward: float
    candidate_reward_mean: float  # mean task reward of all candidates of the item

    def reward_model_row(self, joint_formatter: Callable, use_margin: bool) -> dict[str, Any]:
        row = {
            "chosen": joint_formatter(self.prompts, self.chosen),
            "rejected": joint_formatter(self.prompts, self.rejected),
        }
        if use_margin:
            row["margin"] = self.chosen_reward - self.rejected_reward
        return row


def pairs_from_candidates(
    item_index: int,
    prompts: list[Any],
    candidates: list[list[str]],
    rewards: list[float],
    selection: str,
    max_pairs: int | None,
    rng: random.Random | None,
) -> list[PreferencePair]:
    """The preference pairs of one task item from its C joint candidates (`candidates[agent][j]`) and their rewards."""
    mean = sum(rewards) / len(rewards)
    return [
        PreferencePair(
            item_index,
            list(prompts),
            [c[i] for c in candidates],
            [c[j] for c in candidates],
            rewards[i],
            rewards[j],
            mean,
        )
        for i, j in select_preference_pairs(rewards, selection, max_pairs, rng)
    ]


def pair_rng(seed: int, iteration: int, item_index: int) -> random.Random:
    """The generator of `pair_selection="random"` for one item: fixed by (seed, iteration, item), so a resumed run
    draws the same pairs."""
    return random.Random(f"{seed}-{iteration}-{item_index}")


def save_pairs(path: str, pairs: list[PreferencePair]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump([asdict(pair) for pair in pairs], f, indent=1)


def load_pairs(path: str) -> list[PreferencePair]:
    with open(path) as f:
        return [PreferencePair(**row) for row in json.load(f)]


def pair_statistics(pairs: list[PreferencePair], num_items: int) -> dict[str, float]:
    """Readable metrics of one preference collection."""
    stats = {"preference/pairs": float(len(pairs)), "preference/items": float(num_items)}
    if pairs:
        stats["preference/chosen_reward_mean"] = sum(p.chosen_reward for p in pairs) / len(pairs)
        stats["preference/rejected_reward_mean"] = sum(p.rejected_reward for p in pairs) / len(pairs)
        stats["preference/reward_gap_mean"] = (
            stats["preference/chosen_reward_mean"] - stats["preference/rejected_reward_mean"]
        )
    return stats
