"""Preference maths without models: choosing preference pairs and the joint DPO loss.

Preference-based trainers (MARLHF, MADPO) sample C aligned joint candidates per task item (candidate j is the j-th
completion of every agent), rank them with the task reward and turn reward differences into chosen/rejected pairs.
"""

import random
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F


PairSelection = Literal["reward_gap", "all", "random"]
PAIR_SELECTIONS: tuple[str, ...] = ("reward_gap", "all", "random")


def select_preference_pairs(
    rewards: Sequence[float],
    selection: PairSelection = "reward_gap",
    max_pairs: int | None = None,
    rng: random.Random | None = None,
) -> list[tuple[int, int]]:
    """Chosen/rejected candidate indices `(i, j)` with `rewards[i] > rewards[j]`; ties never form a pair.

    Args:
        rewards: The task reward of every joint candidate of one task item.
        selection: `"reward_gap"`: largest reward gap first (ties broken by `(i, j)`); `"all"`: every pair, in
            `(i, j)` order; `"random"`: a random order drawn from `rng`.
        max_pairs: Keep at most this many pairs (`None`: all). Must be `None` with `"all"`.
        rng: The generator of `"random"` (required there, unused otherwise).

    Example:
    ```python
    >>> select_preference_pairs([0.0, 1.0, 1.0, 0.5], "reward_gap", max_pairs=3)
    [(1, 0), (2, 0), (1, 3)]
    ```
    """
    if selection not in PAIR_SELECTIONS:
        raise ValueError(f"pair_selection must be one of {', '.join(map(repr, PAIR_SELECTIONS))}; got {selection!r}.")
    if max_pairs is not None and (isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 1):
        raise ValueError(f"preference_pairs_per_sample must be a positive integer or None, got {max_pairs!r}.")
    if selection == "all" and max_pairs is not None:
        raise ValueError("preference_pairs_per_sample must be None with pair_selection='all' (every pair is kept).")
    n = len(rewards)
    pairs = [(i, j) for i in range(n) for j in range(n) if rewards[i] > rewards[j]]  # (i, j) order; ties dropped
    if selection == "reward_gap":
        pairs.sort(key=lambda pair: (-(rewards[pair[0]] - rewards[pair[1]]), pair))
    elif selection == "random":
        if rng is None:
            raise ValueError("pair_selection='random' needs a seeded random.Random generator (rng=...).")
        rng.shuffle(pairs)
    return pairs if max_pairs is None else pairs[:max_pairs]


def dpo_logratio(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Δ = [log π(y_w) − log π(y_l)] − [log π_ref(y_w) − log π_ref(y_l)]; without a reference, only the first term."""
    logratio = chosen_logps - rejected_logps
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("Pass both reference log-probabilities (chosen and rejected) or neither.")
    if ref_chosen_logps is not None:
        logratio = logratio - (ref_chosen_logps - ref_rejected_logps)
    return logratio


def others_logratio(logratios: torch.Tensor) -> torch.Tensor:
    """For `logratios` of shape `(num_agents, num_pairs)`, row i is Σ_{j≠i} Δ_j (detached: fixed in agent i's loss)."""
    logratios = logratios.detach()
    return logratios.sum(dim=0, keepdim=True) - logratios


def madpo_loss(own_logratio: torch.Tensor, others: torch.Tensor, beta: float) -> torch.Tensor:
    """Agent i's joint DPO loss per pair: −log σ(β (Δ_i + Σ_{j≠i} sg(Δ_j))).

    The joint response is preferred through the sum of every agent's log-ratio; each agent's loss differentiates
    only its own term, the other agents' terms (`others`) are constants (stop-gradient), as in a coordinate step.
    """
    if beta <= 0:
        raise ValueError(f"dpo_beta must be > 0, got {beta}.")
    return -F.logsigmoid(beta * (own_logratio + others.detach()))
