"""Value targets, advantages and the value loss of the actor-critic trainers (model-free)."""

from collections.abc import Sequence

import torch


def broadcast_rewards(values: Sequence[float], num_agents: int, num_generations: int) -> list[list[float]]:
    """Spread the rewards returned for one task item over agents and generations: `[agent][generation]`.

    A reward function of the actor-critic trainers may return G = `num_generations` values (one per joint action,
    shared by every agent), N = `num_agents` values (one per agent, shared by every generation) or a single value
    (shared by all). When G == N the values are read as one per joint action, the contract of every trainer.
    """
    values = list(values)
    if len(values) == num_generations:
        return [list(values) for _ in range(num_agents)]
    if len(values) == num_agents:
        return [[value] * num_generations for value in values]
    if len(values) == 1:
        return [[values[0]] * num_generations for _ in range(num_agents)]
    raise ValueError(
        f"reward_func returned {len(values)} values; actor-critic trainers accept 1 (shared), "
        f"{num_generations} (one per joint action, num_generations) or {num_agents} (one per agent, num_agents)."
    )


def td_targets(rewards: Sequence[float], next_values: Sequence[float | None], discount: float) -> list[float]:
    """TD(0) targets `r + discount * V(s')`; a `None` next value marks the end of the episode (target `r`)."""
    if len(rewards) != len(next_values):
        raise ValueError(f"{len(rewards)} rewards but {len(next_values)} next values.")
    return [r if v is None else r + discount * v for r, v in zip(rewards, next_values)]


def whiten(advantages: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Centre and scale advantages with the given (population) statistics of their update group."""
    return (advantages - mean) / (var.clamp(min=0.0).sqrt() + eps)


def value_loss(
    values: torch.Tensor,
    targets: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip_range: float | None = None,
) -> torch.Tensor:
    """Mean squared error of the values, with PPO-style clipping around the rollout-time values when asked.

    Clipped: `max((V - t)^2, (V_old + clip(V - V_old, -c, c) - t)^2)`, so one update cannot move a value far
    from where it was when the targets were computed.
    """
    loss = (values - targets) ** 2
    if clip_range is not None and old_values is not None:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        loss = torch.maximum(loss, (clipped - targets) ** 2)
    return loss.mean()
