"""The length-ratio task of the documentation's tutorial: two agents, one brief and one detailed answer.

Both agents get the same creative prompt. Agent 0 writes a short response, agent 1 a detailed one, and the
joint reward is highest when the detailed response has 2-3 times as many characters as the brief one. The reward
judges only lengths, not story quality or whether the two answers agree.

    from comlrl_trl.tasks import length_ratio

    trainer = MAGRPOTrainer(
        agent_model=path, num_agents=2,
        formatters=length_ratio.formatters(), reward_func=length_ratio.reward,
        train_dataset=length_ratio.build_dataset("train"), eval_dataset=length_ratio.build_dataset("eval"),
        args=MAGRPOConfig(num_agents=2, ...),
    )
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from datasets import Dataset


__all__ = ["PROMPTS", "EVAL_ONLY_PROMPTS", "TARGET_MIN", "TARGET_MAX", "build_dataset", "formatters", "reward"]

#: Default bounds of the rewarded ratio len(detailed) / len(brief); an item may override them.
TARGET_MIN = 2.0
TARGET_MAX = 3.0

# The ten prompts of the tutorial, then ten more in the same spirit.
PROMPTS = (
    "Describe a city in the clouds.",
    "Invent a new holiday.",
    "Write a bedtime story for a dragon.",
    "Explain how teleportation might work.",
    "Tell a story about dinosaurs.",
    "Describe a world without electricity.",
    "Create a superhero with a unique power.",
    "Write a scene where the moon talks.",
    "Invent a new type of fruit.",
    "Design a playground on Mars.",
    "Describe a library under the sea.",
    "Invent a sport for robots.",
    "Write a letter from a cat to its owner.",
    "Explain how a time machine might break down.",
    "Tell a story about a lost umbrella.",
    "Describe a forest where the trees can walk.",
    "Create a recipe for a dish from another planet.",
    "Write a scene where two clocks argue.",
    "Invent a musical instrument made of ice.",
    "Design a school for young wizards.",
)

# Evaluation only, so that an evaluation averages over enough items to show progress (4 held-out ones did not).
EVAL_ONLY_PROMPTS = (
    "Describe a market that opens only at midnight.",
    "Invent a new way to say thank you.",
    "Write a short story about a shy volcano.",
    "Explain how a city could float on water.",
    "Tell a story about a snail who wins a race.",
    "Describe a day without gravity.",
    "Create a pet for an astronaut.",
    "Write a scene where the wind tells a secret.",
    "Invent a new color and describe it.",
    "Design a garden on a train.",
    "Describe a museum of forgotten toys.",
    "Invent a holiday for lighthouses.",
)

# Every fifth of PROMPTS is held out for evaluation, with EVAL_ONLY_PROMPTS: 16 training items, 16 evaluation items.
_EVAL_EVERY = 5


def build_dataset(split: Literal["train", "eval"] = "train") -> Dataset:
    """The task items of `split` ("train": 16, "eval": 16), in a fixed order.

    Columns: `prompt`, `target_min`, `target_max` (the rewarded ratio range, 2 and 3 for every shipped item).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    held_out = split == "eval"
    prompts = [p for i, p in enumerate(PROMPTS) if (i % _EVAL_EVERY == _EVAL_EVERY - 1) == held_out]
    if held_out:
        prompts += EVAL_ONLY_PROMPTS
    return Dataset.from_dict(
        {"prompt": prompts, "target_min": [TARGET_MIN] * len(prompts), "target_max": [TARGET_MAX] * len(prompts)}
    )


def brief_formatter(item: dict[str, Any]) -> str:
    """Agent 0's prompt: a short response."""
    return f"Write a short response to this task:\n{item['prompt']}"


def detailed_formatter(item: dict[str, Any]) -> str:
    """Agent 1's prompt: a detailed response."""
    return f"Write a detailed response to this task:\n{item['prompt']}"


def formatters() -> list[Callable[[dict[str, Any]], str]]:
    """The formatters in actor order: [brief, detailed]."""
    return [brief_formatter, detailed_formatter]


def reward(
    brief_completions: Sequence[str], detailed_completions: Sequence[str], *, batch_items: Sequence[dict[str, Any]]
) -> list[float]:
    """One reward in [0, 1] per joint action (brief_k, detailed_k).

    With ratio = len(detailed) / len(brief) in characters: 1.0 when target_min <= ratio <= target_max, else
    exp(-distance to the nearest bound); 0.0 when the brief completion is empty. The bounds are the item's
    `target_min` / `target_max` fields when present, else 2 and 3.
    """
    item = batch_items[0]
    target_min = float(item.get("target_min", TARGET_MIN))
    target_max = float(item.get("target_max", TARGET_MAX))
    rewards = []
    for brief, detailed in zip(brief_completions, detailed_completions, strict=True):
        if not brief:
            rewards.append(0.0)
            continue
        ratio = len(detailed) / len(brief)
        distance = max(target_min - ratio, ratio - target_max, 0.0)
        rewards.append(math.exp(-distance))
    return rewards
