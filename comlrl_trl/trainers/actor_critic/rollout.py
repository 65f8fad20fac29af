"""Actor-critic rollouts: per-agent rewards, critic values, TD targets and advantages on the MAGRPO rollout tree.

Generation, joint actions, transitions and TRL's scoring are the MAGRPO orchestrator's. What changes is what
each sample learns from: its advantage is `target - V(sample)`, where the target is the sample's reward at the
end of an episode and `r_t + gamma * V(s_{t+1})` before it, and `V` is the critic's value at rollout time.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...batching import concat_scored_batches
from ...core.values import broadcast_rewards, td_targets, whiten
from ...joint_reward import JointReward
from ...orchestrator import JointRolloutOrchestrator, Node, Turn
from ...precision import training_autocast


if TYPE_CHECKING:
    from .critics import CriticSet


@dataclass
class RolloutSample:
    """One agent's response at one turn of one task item, as `metrics_callback` receives it.

    `metadata` holds `turn_idx`, `generation_idx` and `batch_item` (the task item), plus, in training,
    `reward` (this agent's), `value` (the critic's, at rollout time), `value_target` and `advantage`.
    """

    agent_idx: int
    prompt: Any
    completion: str
    metadata: dict[str, Any] = field(default_factory=dict)


class AgentRewards(JointReward):
    """The actor-critic reward contract: 1, G or N values per task item, spread to `[agent][generation]`."""

    def __init__(self, reward_func, reward_processor, num_agents: int):
        super().__init__(reward_func, reward_processor)
        self.num_agents = num_agents

    def matrix(self, agent_completions, item: dict[str, Any], item_label: str) -> list[list[float]]:
        values = self.values(agent_completions, item, item_label)
        try:
            return broadcast_rewards(values, self.num_agents, len(agent_completions[0]))
        except ValueError as error:
            raise ValueError(f"{error} ({item_label})") from None

    def __call__(self, agent_completions, item: dict[str, Any], item_label: str) -> list[float]:
        """The team's reward per joint action: the mean over agents."""
        matrix = self.matrix(agent_completions, item, item_label)
        return [sum(column) / len(column) for column in zip(*matrix)]


class ActorCriticOrchestrator(JointRolloutOrchestrator):
    """The MAGRPO rollout with critic-based advantages from `critics` (a `CriticSet`).

    With `record_samples`, every training sample's `RolloutSample` is kept in `samples` (for a metrics_callback).
    """

    def __init__(
        self,
        agents,
        formatters,
        joint_reward: "AgentRewards",
        args,
        accelerator,
        critics: "CriticSet",
        external_transition=None,
        record_samples: bool = False,
    ):
        super().__init__(agents, formatters, joint_reward, args, accelerator, external_transition)
        self.critics = critics
        self.record_samples = record_samples
        self.samples: list[RolloutSample] = []

    def _node_rewards(self, joint, node: Node, turn: int) -> list[float]:
        node.agent_rewards = self.joint_reward.matrix(joint, node.item, f"{node.item_label}, turn {turn + 1}")
        return [sum(column) / len(column) for column in zip(*node.agent_rewards)]

    def _score_agents(self, turns: list[Turn], returns, kl_stats: torch.Tensor):
        n = len(self.agents)
        scored = [
            [
                self._trl_score(
                    self.agents[a], turn, a, [r for node in turn.nodes for r in node.agent_rewards[a]], kl_stats, t
                )[0]
                for t, turn in enumerate(turns)
            ]
            for a in range(n)
        ]  # the agents' own rewards: TRL's reward metrics stay true
        with training_autocast(self.accelerator, self.args.bf16):  # the precision the critics train in
            values = self.critics.rollout_values(turns, scored)  # [agent][turn] -> (rows,)
        targets = [[self._targets(a, t, turns, values) for t in range(len(turns))] for a in range(n)]
        self.critics.store(targets, values)
        self.samples = []
        all_advantages = []
        for a, agent in enumerate(self.agents):
            agent_advantages = []
            for t, batch in enumerate(scored[a]):
                advantages = targets[a][t] - values[a][t]
                if self.args.advantage_normalization:
                    advantages = whiten(advantages, *self._global_moments(advantages))
                if self.args.turn_gradient_weights is not None:
                    advantages = advantages * self.args.turn_gradient_weights[t]
                agent_advantages.append(advantages)
                batch["old_values"], batch["value_targets"] = values[a][t], targets[a][t]
                if self.record_samples:
                    self._record(a, t, turns, batch, advantages)
            all_advantages.append(torch.cat(agent_advantages))
            agent.metrics("train")["value_mean"].append(self._global_moments(torch.cat(values[a]))[0].item())
            agent.metrics("train")["value_target_mean"].append(self._global_moments(torch.cat(targets[a]))[0].item())
        batches = [
            concat_scored_batches(batches, agent.processing_class.pad_token_id)
            for batches, agent in zip(scored, self.agents)
        ]
        return batches, all_advantages

    def _targets(self, a: int, t: int, turns, values) -> torch.Tensor:
        """`r` at the end of an episode, `r + gamma * V(next node)` before it (V: mean over the node's samples)."""
        nodes, k = turns[t].nodes, self.args.num_generations
        rewards = [r for node in nodes for r in node.agent_rewards[a]]
        node_values = values[a][t + 1].view(-1, k).mean(dim=1).tolist() if t + 1 < len(turns) else []
        next_values = [None if child is None else node_values[child] for node in nodes for child in node.children]
        return torch.tensor(td_targets(rewards, next_values, self.args.discount), device=values[a][t].device)

    def _global_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and population variance of `x` over all processes."""
        x = x.float()
        sums = self.accelerator.reduce(
            torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), device=x.device)]), reduction="sum"
        )
        mean = sums[0] / sums[2]
        return mean, sums[1] / sums[2] - mean * mean

    def _record(self, a: int, t: int, turns: list[Turn], batch: dict[str, Any], advantages: torch.Tensor) -> None:
        turn, k = turns[t], self.args.num_generations
        values, targets = batch["old_values"].tolist(), batch["value_targets"].tolist()
        advantages = advantages.tolist()
        rows = zip((m for m in turn.nodes for _ in range(k)), turn.prompts[a], turn.texts[a])
        for row, (node, prompt, text) in enumerate(rows):
            self.samples.append(
                RolloutSample(
                    a,
                    prompt,
                    text,
                    {
                        "turn_idx": t,
                        "generation_idx": row % k,
                        "batch_item": node.item,
                        "item_label": node.item_label,
                        "reward": node.agent_rewards[a][row % k],
                        "value": values[row],
                        "value_target": targets[row],
                        "advantage": advantages[row],
                    },
                )
            )
