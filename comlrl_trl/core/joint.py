"""Joint-action bookkeeping for multi-agent generation.

Each of ``N`` agents samples ``K`` completions for the same task item. A
*joint action* is a tuple ``(k_0, ..., k_{N-1})`` choosing one completion per
agent; the environment/reward function scores each joint action with a single
joint return.

Two ways of forming joint actions are supported:

* ``"align"``: the k-th completion of every agent is paired, giving ``K`` joint
  actions ``(k, k, ..., k)``.
* ``"cross"``: every combination, ``itertools.product(range(K), repeat=N)``,
  giving ``K**N`` joint actions (first agent varies slowest).

To train agent ``a`` we need a return per *completion*; it is the mean joint
return over the joint actions that completion takes part in::

    R_a(k) = mean_{j : indices[j][a] == k} joint_returns[j]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, get_args


JointMode = Literal["align", "cross"]

_JOINT_MODES: tuple[str, ...] = get_args(JointMode)


def _check_sizes(num_agents: int, num_generations: int) -> None:
    """Validate ``N >= 1`` and ``K >= 1``."""
    if num_agents < 1:
        raise ValueError(f"num_agents must be >= 1, got {num_agents}")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")


def _check_mode(mode: str) -> None:
    """Validate the joint mode name."""
    if mode not in _JOINT_MODES:
        raise ValueError(f"unknown joint mode {mode!r}; expected one of {_JOINT_MODES}")


def joint_action_indices(num_agents: int, num_generations: int, mode: JointMode) -> list[tuple[int, ...]]:
    """List the joint actions as tuples of per-agent completion indices.

    align: ``[(k,) * N for k in range(K)]``                    -> K joint actions
    cross: ``list(itertools.product(range(K), repeat=N))``     -> K**N joint actions
    """
    _check_mode(mode)
    _check_sizes(num_agents, num_generations)
    if mode == "align":
        # Pair the k-th completion of every agent.
        return [(k,) * num_agents for k in range(num_generations)]
    # Every combination; agent 0 varies slowest (lexicographic order).
    return list(itertools.product(range(num_generations), repeat=num_agents))


def num_joint_actions(num_agents: int, num_generations: int, mode: JointMode) -> int:
    """Number of joint actions: ``K`` for align, ``K**N`` for cross."""
    _check_mode(mode)
    _check_sizes(num_agents, num_generations)
    return num_generations if mode == "align" else num_generations**num_agents


def completion_returns(
    joint_returns: Sequence[float],
    indices: Sequence[tuple[int, ...]],
    num_agents: int,
    num_generations: int,
) -> list[list[float]]:
    """Per-agent, per-completion returns averaged over the joint actions they join.

    ``out[a][k] = mean_{j : indices[j][a] == k} joint_returns[j]``

    In align mode ``indices[k] == (k,) * N``, so ``out[a][k] == joint_returns[k]``.
    Raises ``ValueError`` on length mismatches, out-of-range indices, or if some
    completion takes part in no joint action (its mean would be undefined).
    """
    _check_sizes(num_agents, num_generations)
    if len(joint_returns) != len(indices):
        raise ValueError(f"joint_returns has {len(joint_returns)} entries but indices has {len(indices)}")

    # Running sums and counts per (agent, completion).
    sums = [[0.0] * num_generations for _ in range(num_agents)]
    counts = [[0] * num_generations for _ in range(num_agents)]
    for j, (ret, joint) in enumerate(zip(joint_returns, indices)):
        if len(joint) != num_agents:
            raise ValueError(f"joint action {j} has {len(joint)} indices, expected num_agents={num_agents}")
        for a, k in enumerate(joint):
            if not 0 <= k < num_generations:
                raise ValueError(f"joint action {j}: agent {a} index {k} out of range [0, {num_generations})")
            sums[a][k] += float(ret)
            counts[a][k] += 1

    out: list[list[float]] = []
    for a in range(num_agents):
        row: list[float] = []
        for k in range(num_generations):
            if counts[a][k] == 0:
                raise ValueError(f"completion {k} of agent {a} takes part in no joint action")
            row.append(sums[a][k] / counts[a][k])
        out.append(row)
    return out
