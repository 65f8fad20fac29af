"""The joint-rollout orchestrator: one training rollout for a whole team of agent trainers.

One rollout of the local generation batch (every task item repeated K = num_generations times) is a tree with
one level per turn:

1. every node (one task item along one branch) asks each agent for K completions; all nodes of a turn go
   through the team generator it is given (`comlrl_trl.generation.team_generator`: one batched generation per
   agent, or one decoding loop for the whole team on a CPU);
2. the completions of a node form its joint actions (`align`: K, `cross`: K^N) and the joint reward function
   is called once per node;
3. before the last turn, every joint action of a node is expanded (unless the node's mean reward exceeds
   `early_termination_threshold`): the external transition turns it into the next prompt of every agent, which
   makes a child node;
4. returns are computed bottom-up with the discount (`core.returns`); a completion's return is the mean return
   of the joint actions it takes part in, and its advantage is group-relative among the K sibling completions
   of the same agent at the same node (`core.advantages`), scaled by the turn's gradient weight;
5. TRL scores every agent's rows of every turn with the rollout and returns handed in (`AgentGRPOTrainer.score`),
   and the turns are joined into one batch per agent; the advantages travel beside it, to be set once when the
   agent's micro-batches are filled.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .adapters.grpo import Rollout, completion_text
from .adapters.helpers import gradient_checkpointing_disabled
from .batching import concat_scored_batches
from .core.advantages import group_advantages
from .core.joint import completion_returns, joint_action_indices
from .core.returns import suffix_returns, tree_returns
from .formatters import Formatter, check_prompt, format_prompt
from .generation.team_generator import TeamGenerator, team_generator
from .joint_reward import JointReward, accepts_keyword
from .precision import training_autocast


if TYPE_CHECKING:
    from .adapters.grpo import AgentGRPOTrainer


@dataclass
class Node:
    """One turn of one task item along one branch of the rollout tree."""

    item: dict[str, Any]
    item_label: str
    prompts: list[Any]  # the prompt each agent sees at this node
    prompt_history: list[list[Any]]  # per agent, the prompts of the earlier turns of this branch
    response_history: list[list[str]]  # per agent, the responses of the earlier turns of this branch
    rewards: list[float] = field(default_factory=list)  # per joint action
    children: list[int | None] = field(default_factory=list)  # per joint action: child index at the next turn


@dataclass
class Turn:
    """One turn of a training rollout: its nodes and, per agent, the prompts, TRL rollout and response texts.

    Row r of an agent's prompts, rollout and texts belongs to node `r // num_generations`.
    """

    nodes: list[Node]
    prompts: list[list[Any]]  # [agent][row]
    rollouts: list[Rollout]  # [agent]
    texts: list[list[str]]  # [agent][row]


@dataclass
class TeamRollout:
    """What one training rollout produced."""

    agent_batches: list[dict[str, Any]]  # one scored TRL batch per agent (all turns), local rows, no advantages
    agent_advantages: list[torch.Tensor]  # one advantage per row of every agent's batch
    turn_rewards: list[list[float]]  # per turn, the mean joint reward of every local node
    turn_returns: list[list[float]]  # per turn, the mean return of every local node
    env_steps: int  # joint actions scored, all processes together
    completions: list[list[str]] = field(default_factory=list)  # first turn, [agent][local row]
    turn_reference_kl: list[float] = field(default_factory=list)  # per turn, when beta > 0: mean token KL


class JointRolloutOrchestrator:
    """Generates for all agents, forms joint actions, calls the joint reward and hands every agent its batch."""

    def __init__(
        self,
        agents: list["AgentGRPOTrainer"],
        formatters: list[Formatter],
        joint_reward: JointReward,
        args,
        accelerator,
        external_transition=None,
        generator: TeamGenerator | None = None,
    ):
        self.agents = agents
        # The team's Accelerator: the process's collectives (gather, reduce) and the device of the team's tensors.
        # Every agent's Accelerator shares its process state; no agent hosts the team's.
        self.accelerator = accelerator
        # How every agent's completions are sampled (`comlrl_trl.generation.team_generator`); by default the one
        # `args.generation_backend` picks.
        self.team_generation = team_generator(agents, args) if generator is None else generator
        self.formatters = formatters
        self.joint_reward = joint_reward
        self.args = args
        self.external_transition = external_transition
        self.pass_batch_item = external_transition is not None and accepts_keyword(external_transition, "batch_item")
        self.joint_indices = joint_action_indices(len(agents), args.num_generations, args.joint_mode)

    # ----- training -----

    def rollout(self, rows: list[dict[str, Any]], first_item_index: int = 0) -> TeamRollout:
        """Run one training rollout over the local rows (K consecutive copies of every task item)."""
        k = self.args.num_generations
        if len(rows) % k != 0:
            raise ValueError(f"A generation batch of {len(rows)} rows does not hold whole groups of {k} generations.")
        nodes = [self.root_node(item, f"task item {first_item_index + g}") for g, item in enumerate(rows[::k])]
        turns: list[Turn] = []
        for turn in range(self.args.num_turns):
            prompts = [[node.prompts[a] for node in nodes for _ in range(k)] for a in range(len(self.agents))]
            rollouts = self.team_generation(prompts)
            texts = [[completion_text(c) for c in rollout.completions] for rollout in rollouts]
            next_nodes = self._score_and_expand(nodes, texts, turn)
            turns.append(Turn(nodes, prompts, rollouts, texts))
            if not next_nodes:
                break
            nodes = next_nodes

        returns = tree_returns(
            [[n.rewards for n in t.nodes] for t in turns],
            [[n.children for n in t.nodes] for t in turns],
            self.args.discount,
        )
        kl_stats = torch.zeros(len(turns), 2, device=self.accelerator.device)  # per turn: KL sum, token count
        batches, advantages = self._score_agents(turns, returns, kl_stats)
        kl_stats = self.accelerator.reduce(kl_stats, reduction="sum")
        scored = self.accelerator.gather(
            torch.tensor([sum(len(n.rewards) for t in turns for n in t.nodes)], device=self.accelerator.device)
        )
        return TeamRollout(
            agent_batches=batches,
            agent_advantages=advantages,
            turn_rewards=[[sum(n.rewards) / len(n.rewards) for n in t.nodes] for t in turns],
            turn_returns=[[sum(r) / len(r) for r in turn_returns] for turn_returns in returns],
            env_steps=int(scored.sum().item()),
            completions=turns[0].texts,
            turn_reference_kl=(kl_stats[:, 0] / kl_stats[:, 1].clamp(min=1)).tolist() if self.args.beta else [],
        )

    def root_node(self, item: dict[str, Any], label: str) -> Node:
        """The first-turn node of a task item: every agent's formatted prompt."""
        prompts = [format_prompt(formatter, item, a, label=label) for a, formatter in enumerate(self.formatters)]
        return Node(item, label, prompts, [[] for _ in self.agents], [[] for _ in self.agents])

    def _score_and_expand(self, nodes: list[Node], texts: list[list[str]], turn: int) -> list[Node]:
        """Score every node's joint actions; return the child nodes of the next turn (none after the last)."""
        k = self.args.num_generations
        threshold = self.args.early_termination_threshold
        next_nodes: list[Node] = []
        for n, node in enumerate(nodes):
            start = n * k
            joint = [
                [agent_texts[start + idx[a]] for idx in self.joint_indices] for a, agent_texts in enumerate(texts)
            ]
            node.rewards = self._node_rewards(joint, node, turn)
            expand = turn + 1 < self.args.num_turns and not (
                threshold is not None and sum(node.rewards) / len(node.rewards) > threshold
            )
            for j in range(len(self.joint_indices)):
                if not expand:
                    node.children.append(None)
                    continue
                node.children.append(len(next_nodes))
                next_nodes.append(self._child(node, [agent_joint[j] for agent_joint in joint], turn))
        return next_nodes

    def _node_rewards(self, joint: list[list[str]], node: Node, turn: int) -> list[float]:
        """The joint reward of every joint action of a node (`joint[agent][joint action]` holds the texts)."""
        return self.joint_reward(joint, node.item, f"{node.item_label}, turn {turn + 1}")

    def _child(self, node: Node, responses: list[str], turn: int) -> Node:
        prompt_history = [history + [prompt] for history, prompt in zip(node.prompt_history, node.prompts)]
        response_history = [history + [text] for history, text in zip(node.response_history, responses)]
        external = self.transition(
            node.item, responses, prompt_history, response_history, f"{node.item_label}, after turn {turn + 1}"
        )
        label = f"{node.item_label}, turn {turn + 2}"
        prompts = [
            format_prompt(formatter, node.item, a, external[a], self.args.external_prompt_passthrough, label)
            for a, formatter in enumerate(self.formatters)
        ]
        return Node(node.item, node.item_label, prompts, prompt_history, response_history)

    def transition(self, item, responses, prompt_history, response_history, label) -> list[str]:
        """Call the external transition for one joint action and check it returns one prompt per agent."""
        kwargs = {"batch_item": item} if self.pass_batch_item else {}
        try:
            prompts = self.external_transition(
                prompt=item.get("prompt", ""),
                agent_completions=list(responses),
                num_agents=len(self.agents),
                prompt_history_per_agent=prompt_history,
                response_history_per_agent=response_history,
                **kwargs,
            )
        except Exception as error:
            error.add_note(f"comlrl_trl: raised by external_transition on {label}")
            raise
        if not isinstance(prompts, (list, tuple)) or len(prompts) != len(self.agents):
            raise ValueError(
                f"external_transition must return a list of {len(self.agents)} prompts (one per agent) on {label}; "
                f"got {type(prompts).__name__}"
                + (f" of length {len(prompts)}" if isinstance(prompts, (list, tuple)) else "")
            )
        for a, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(
                    f"external_transition returned {type(prompt).__name__} for agent {a} on {label}; "
                    "next-turn prompts must be strings."
                )
            check_prompt(prompt, a, label, "the external_transition")
        return list(prompts)

    def _score_agents(self, turns: list[Turn], returns, kl_stats: torch.Tensor):
        """Per agent, one scored TRL batch (all turns joined) and the advantages of its rows for this algorithm."""
        scored = [self._score_agent(a, turns, returns, kl_stats) for a in range(len(self.agents))]
        return [batch for batch, _ in scored], [advantages for _, advantages in scored]

    def _score_agent(self, a: int, turns: list[Turn], returns, kl_stats: torch.Tensor):
        """TRL's scoring of agent `a` turn by turn with the returns handed in, and its group-relative advantages."""
        agent = self.agents[a]
        weights = self.args.turn_gradient_weights
        process = self.accelerator.process_index
        batches, advantages = [], []
        for t, turn in enumerate(turns):
            local_returns = []
            for node_returns in returns[t]:
                local_returns.extend(
                    completion_returns(node_returns, self.joint_indices, len(self.agents), self.args.num_generations)[
                        a
                    ]
                )
            batch, global_returns = self._trl_score(agent, turn, a, local_returns, kl_stats, t)
            group = group_advantages(
                global_returns, self.args.num_generations, self.args.advantage_mode, self.args.scale_rewards
            )
            local = group[process * len(local_returns) : (process + 1) * len(local_returns)]
            advantages.append(local * weights[t] if weights is not None else local)
            batches.append(batch)
        return concat_scored_batches(batches, agent.processing_class.pad_token_id), torch.cat(advantages)

    def _trl_score(
        self, agent, turn: Turn, a: int, local_rewards: list[float], kl_stats: torch.Tensor, t: int
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """TRL's scoring of agent `a`'s rows of one turn with the rewards handed in (gathered over processes).

        Returns TRL's batch and the gathered rewards; adds the turn's reference KL.
        """
        k = self.args.num_generations
        rows = [
            {**node.item, "prompt": prompt}
            for node, prompt in zip((n for n in turn.nodes for _ in range(k)), turn.prompts[a])
        ]
        device = self.accelerator.device
        global_rewards = self.accelerator.gather(torch.tensor(local_rewards, dtype=torch.float32, device=device))
        batch = agent.score(rows, turn.rollouts[a], global_rewards)
        if "ref_per_token_logps" in batch:
            kl_stats[t] += reference_kl_stats(agent, batch)
        return batch, global_rewards

    # ----- evaluation -----

    @torch.no_grad()
    def evaluate_path(self, items: list[dict[str, Any]], labels: list[str]):
        """One path per item: one response per agent per turn.

        Returns `(completions[agent][item][turn], rewards[item][turn], returns[item][turn], prompts[agent][item][turn])`,
        the returns being the discounted suffix returns of each path.
        """
        nodes = [self.root_node(item, label) for item, label in zip(items, labels)]
        completions = [[[] for _ in items] for _ in self.agents]
        prompts = [[[] for _ in items] for _ in self.agents]
        rewards = [[] for _ in items]
        for turn in range(self.args.num_turns):
            texts = self.sample([node.prompts for node in nodes])
            for i, node in enumerate(nodes):
                responses = [agent_texts[i] for agent_texts in texts]
                for a, text in enumerate(responses):
                    completions[a][i].append(text)
                    prompts[a][i].append(node.prompts[a])
                label = f"{node.item_label}, turn {turn + 1}"
                rewards[i].append(self.joint_reward([[text] for text in responses], node.item, label)[0])
                if turn + 1 < self.args.num_turns:
                    nodes[i] = self._child(node, responses, turn)
        returns = [suffix_returns(item_rewards, self.args.discount) for item_rewards in rewards]
        return completions, rewards, returns, prompts

    def sample(self, node_prompts: list[list[Any]]) -> list[list[str]]:
        """One completion per agent for every node: `node_prompts[node][agent]` -> texts `[agent][node]`."""
        rollouts = self.team_generation([[prompts[a] for prompts in node_prompts] for a in range(len(self.agents))])
        return [[completion_text(c) for c in rollout.completions] for rollout in rollouts]


@torch.no_grad()
def reference_kl_stats(agent, batch: dict[str, Any]) -> torch.Tensor:
    """(sum, count) over completion tokens of TRL's k3 estimate of KL(policy || reference) at rollout time.

    The forward runs in chunks of `per_device_train_batch_size` rows (as TRL's own old/reference log-probs): one
    forward over a turn's rows would hold rows x tokens x vocabulary logits at once.
    """
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with (
        gradient_checkpointing_disabled(agent.model, agent.args.gradient_checkpointing_kwargs),
        training_autocast(agent.accelerator, agent.args.bf16),  # as the loss: bf16 also where Accelerate's is off
    ):
        logps = agent.per_token_logps(
            agent.model,
            input_ids,
            attention_mask,
            batch["completion_ids"].size(1),
            batch_size=agent.args.per_device_train_batch_size,
        )
    delta = batch["ref_per_token_logps"] - logps
    per_token = torch.exp(delta) - delta - 1  # k3 estimator, as in TRL's loss
    mask = batch["completion_mask"].to(per_token.dtype)
    return torch.stack([(per_token * mask).sum(), mask.sum()])
