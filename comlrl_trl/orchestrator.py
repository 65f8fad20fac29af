"""The joint-rollout orchestrator: one training rollout for a whole team of agent trainers.

One rollout, for the local generation batch (each task item repeated K = num_generations times):

1. every agent formats its prompts and generates, in one batched TRL `_generate` call per agent;
2. completions form joint actions (`align`: K per item, `cross`: K^N), and the joint reward function is called
   once per task item;
3. every completion gets a return (its joint reward; in `cross` mode the mean over the joint actions it takes part
   in), advantages are group-relative per agent (`core.advantages`);
4. TRL scores every agent with its own rollout and returns injected, and the advantages are set on its batch.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOTrainer

from .core.advantages import group_advantages
from .core.joint import completion_returns, joint_action_indices
from .formatters import Formatter, format_prompt
from .joint_reward import JointReward


if TYPE_CHECKING:
    from .trainers.agent import AgentGRPOTrainer


@dataclass
class TeamRollout:
    """What one training rollout produced."""

    agent_batches: list[dict[str, Any]]  # one scored TRL batch per agent, local rows
    item_rewards: list[float]  # mean joint reward of every local task item
    env_steps: int  # joint actions scored, all processes together
    completions: list[list[str]] = field(default_factory=list)  # [agent][local row]


class JointRolloutOrchestrator:
    """Generates for all agents, forms joint actions, calls the joint reward and hands every agent its batch."""

    def __init__(
        self,
        agents: list["AgentGRPOTrainer"],
        formatters: list[Formatter],
        joint_reward: JointReward,
        *,
        num_generations: int,
        joint_mode: str,
        advantage_mode: str,
        scale_rewards: str,
    ):
        self.agents = agents
        self.formatters = formatters
        self.joint_reward = joint_reward
        self.num_generations = num_generations
        self.joint_mode = joint_mode
        self.advantage_mode = advantage_mode
        self.scale_rewards = scale_rewards
        self.joint_indices = joint_action_indices(len(agents), num_generations, joint_mode)

    @property
    def accelerator(self):
        return self.agents[0].accelerator

    def rollout(self, rows: list[dict[str, Any]], first_item_index: int = 0) -> TeamRollout:
        """Run one training rollout over the local rows (K consecutive copies of every task item)."""
        k = self.num_generations
        if len(rows) % k != 0:
            raise ValueError(f"A generation batch of {len(rows)} rows does not hold whole groups of {k} generations.")
        prompts = self.format_prompts(rows)
        rollouts = [agent._generate(agent_prompts) for agent, agent_prompts in zip(self.agents, prompts)]
        completions = [[completion_text(c) for c in rollout[3]] for rollout in rollouts]

        returns = [[] for _ in self.agents]  # [agent][local row]
        item_rewards = []
        for group, start in enumerate(range(0, len(rows), k)):
            joint = [[agent_completions[start + idx[a]] for idx in self.joint_indices]
                     for a, agent_completions in enumerate(completions)]
            label = f"task item {first_item_index + group} of this rollout"
            rewards = self.joint_reward(joint, rows[start], label)
            item_rewards.append(sum(rewards) / len(rewards))
            for a, agent_returns in enumerate(completion_returns(rewards, self.joint_indices, len(self.agents), k)):
                returns[a].extend(agent_returns)

        batches = [self._score_agent(a, rows, prompts[a], rollouts[a], returns[a]) for a in range(len(self.agents))]
        num_items = self.accelerator.gather(torch.tensor([len(item_rewards)], device=self.accelerator.device))
        env_steps = int(num_items.sum().item()) * len(self.joint_indices)
        return TeamRollout(batches, item_rewards, env_steps, completions)

    def format_prompts(self, rows: list[dict[str, Any]]) -> list[list[Any]]:
        """`[agent][row]` prompts, each agent with its own formatter."""
        return [[format_prompt(formatter, row, a) for row in rows] for a, formatter in enumerate(self.formatters)]

    def _score_agent(self, a: int, rows, prompts, rollout, local_returns: list[float]) -> dict[str, Any]:
        """Let TRL score agent `a` on its rollout with the injected returns, then set our advantages."""
        agent = self.agents[a]
        device = self.accelerator.device
        global_returns = self.accelerator.gather(torch.tensor(local_returns, dtype=torch.float32, device=device))
        advantages = group_advantages(global_returns, self.num_generations, self.advantage_mode, self.scale_rewards)
        process = self.accelerator.process_index
        local = slice(process * len(rows), (process + 1) * len(rows))
        agent.inject(rollout, global_returns.unsqueeze(1))
        agent_rows = [{**row, "prompt": prompt} for row, prompt in zip(rows, prompts)]
        batch = GRPOTrainer._generate_and_score_completions(agent, agent_rows)
        batch["advantages"] = advantages[local].to(batch["advantages"].dtype)
        return batch

    @torch.no_grad()
    def sample(self, items: list[dict[str, Any]]) -> list[list[str]]:
        """One completion per agent per item (evaluation): `[agent][item]` texts."""
        prompts = self.format_prompts(items)
        return [[completion_text(c) for c in agent._generate(agent_prompts)[3]]
                for agent, agent_prompts in zip(self.agents, prompts)]


def completion_text(completion: Any) -> str:
    """TRL returns strings for plain prompts and `[{"role": "assistant", "content": ...}]` for chat prompts."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]
