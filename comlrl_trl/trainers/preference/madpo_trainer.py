"""MADPO: joint direct preference optimisation of a team, on the MAGRPO team loop.

Every generation step samples C joint candidates per task item with the current agents, ranks them with the task
reward and forms chosen/rejected pairs (as MARLHF does). Agent i's loss on a pair is −log σ(β (Δ_i + Σ_{j≠i} Δ_j)),
Δ_j being agent j's log-ratio of its chosen over its rejected completion; the other agents' terms are computed with
the weights of the generation step and held fixed. The team loop, LoRA, Accelerate, logging and checkpoints are
[`MAGRPOTrainer`]'s; every agent is a `MADPOAgent`.
"""

from typing import Any, Unpack

import torch
from transformers import PreTrainedModel

from ...adapters.cpu_logprob import cpu_fused_head
from ...adapters.grpo import AgentGRPOTrainer, completion_text
from ...adapters.helpers import pad_sequences, token_log_probs
from ...core.preferences import dpo_logratio, madpo_loss, others_logratio, select_preference_pairs
from ...loading import is_peft_model
from ..team.inputs import TeamKwargs, team_init
from ..team.trainer import TeamTrainer
from .madpo_config import MADPOConfig
from .pairs import pair_rng


def sequence_logps(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    chunk: int | None = None,
    num_forwards: int | None = None,
    fused_head: bool = False,
) -> torch.Tensor:
    """log π(completion | prompt) per row: the sum of the completion tokens' log-probabilities (temperature 1).

    `fused_head`: `model` carries TRL's fused log-probability head (`trl.trainer.utils.add_fused_lm_head`, which
    TRL's `GRPOTrainer` adds to every agent and reference model, as MAGRPO's loss uses it). The completion tokens are
    then scored in tiles of at most 4096 tokens x 32768 vocabulary entries (`trl.kernels.chunked_logprob`), whose
    backward recomputes each tile, so neither the forward nor the backward holds the rows x tokens x vocabulary
    logits (32 rows x 1024 tokens x 152k entries is 20 GB in fp32). Without it the model's logits are materialised.

    `chunk`: forward at most this many rows at a time (for no-grad passes: the logits of all rows at once are
    rows x tokens x vocabulary floats). `num_forwards`: run exactly this many forwards (at least
    `ceil(rows / chunk)`); the extra ones run on the first row and are discarded. Under ZeRO-3 every forward gathers
    the parameters with a collective, so every process must run as many as the others (see `forwards_needed`).
    """
    rows = prompt_ids.size(0)
    size = rows if chunk is None else chunk
    starts = list(range(0, rows, size))
    total = len(starts) if num_forwards is None else num_forwards
    if total < len(starts):
        raise ValueError(f"num_forwards={total} is fewer than the {len(starts)} chunks of {rows} rows.")
    tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    logps = [_rows_logps(model, *(t[i : i + size] for t in tensors), fused_head) for i in starts]
    for _ in range(total - len(starts)):
        _rows_logps(model, *(t[:1] for t in tensors), fused_head)  # a padding forward: only its collectives matter
    return torch.cat(logps)


def forwards_needed(rows: list[int], chunk: int, accelerator) -> list[int]:
    """The forwards every process runs for each of its batches (`rows[s]` rows, `chunk` at a time): the largest
    count over processes, so that ZeRO-3's parameter gathering meets the same number of forwards everywhere."""
    local = torch.tensor([-(-r // chunk) for r in rows], device=accelerator.device)
    if accelerator.num_processes == 1:
        return local.tolist()
    return accelerator.gather(local[None]).amax(dim=0).tolist()


def _rows_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, fused_head=False) -> torch.Tensor:
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.size(1)
    if fused_head:  # the completion tokens' labels only; the head scores them in tiles (see `sequence_logps`)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, : prompt_ids.size(1)] = -100
        with cpu_fused_head(model):  # on a CPU: completion positions only and the in-place backward, as MAGRPO runs it
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        return (out.log_probs[:, -width:] * completion_mask).sum(dim=1)  # log_probs[t - 1] scores token t
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=width + 1, use_cache=False
    ).logits
    per_token = token_log_probs(logits[:, :-1, :], completion_ids)  # position t predicts completion token t
    return (per_token * completion_mask).sum(dim=1)


class MADPOAgent(AgentGRPOTrainer):
    """An agent of a MADPO team: its loss is its joint DPO term on the pair batch it was handed (chosen rows first)."""

    def compute_agent_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        # Always a forward, also on a process whose items all tied (a zero-weight placeholder pair, see
        # `_pair_tensors`): it joins the gradient all-reduce, ZeRO-3's parameter gathering and the metric gathers.
        weight = inputs["pair_weight"]
        num_pairs = weight.size(0)
        logps = sequence_logps(
            model,
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            inputs["completion_mask"],
            fused_head=True,
        )
        own = dpo_logratio(logps[:num_pairs], logps[num_pairs:]) - inputs["ref_logratio"]
        per_pair = madpo_loss(own, inputs["others_logratio"], self.args.dpo_beta)
        loss = (per_pair * weight).sum() / weight.sum().clamp(min=1.0)
        joint = own.detach() + inputs["others_logratio"]
        # Metrics over the real pairs of every process: gathered sums and counts.
        sums = torch.stack(
            [
                (per_pair.detach() * weight).sum(),
                ((joint > 0).float() * weight).sum(),
                (own.detach() * weight).sum(),
                (joint * weight).sum(),
                weight.sum(),
            ]
        )
        totals = self.accelerator.gather(sums[None]).sum(dim=0)
        if totals[-1] > 0:
            for name, total in zip(("dpo/loss", "dpo/accuracy", "dpo/logratio", "dpo/joint_logratio"), totals):
                self.metrics(mode)[name].append((total / totals[-1]).item())
        return loss / normalizer


class MADPOTrainer(TeamTrainer):
    """
    Trainer for cooperative LLM agents with joint direct preference optimisation (MADPO).

    Arguments are those of [`MAGRPOTrainer`], in the same order (keyword-only after `agent_model`), with a
    [`MADPOConfig`]: `reward_func` (and `reward_processor`) is the task reward that ranks the candidates and scores
    evaluation; `eval_logger`/`eval_aggregator` add custom evaluation metrics. One micro-step trains every agent on the pairs of
    `per_device_train_batch_size / preference_num_candidates` task items; items whose candidates all tie add no pair.

    Logged per agent: `agent_i/dpo/loss`, `agent_i/dpo/accuracy` (share of pairs whose joint log-ratio is positive),
    `agent_i/dpo/logratio` (its own Δ_i), `agent_i/dpo/joint_logratio`; for the team `preference/pairs`,
    `preference/chosen_reward_mean`, `preference/rejected_reward_mean` and `turn_1/reward_mean` (mean task reward
    of the candidates). `env_step` counts the joint candidates scored.

    Example:

    ```python
    >>> trainer = MADPOTrainer(agent_model="path/to/model", num_agents=2, reward_func=reward_func,
    ...                        train_dataset=dataset, args=MADPOConfig(num_agents=2, preference_num_candidates=8))
    >>> trainer.train()
    ```
    """

    default_config_cls = MADPOConfig
    agent_cls = MADPOAgent
    algorithm_name = "MADPO"
    model_tags = ("trl", "dpo", "comlrl_trl", "madpo")

    @team_init
    def __init__(self, agent_model: str | PreTrainedModel | None = None, **team_kwargs: Unpack[TeamKwargs]):
        args = team_kwargs.get("args")
        if args is not None and not isinstance(args, MADPOConfig):
            raise TypeError(f"args must be a MADPOConfig, got {type(args).__name__}.")
        if args is not None and args.per_device_train_batch_size % args.num_generations != 0:
            raise ValueError(
                f"per_device_train_batch_size={args.per_device_train_batch_size} must be a multiple of "
                f"preference_num_candidates={args.num_generations}: a micro-step trains on whole items' pairs."
            )
        super().__init__(agent_model, **team_kwargs)

    def _run_config(self) -> dict[str, Any]:
        return {
            **super()._run_config(),
            "dpo_beta": self.args.dpo_beta,
            "use_reference_model": self.args.use_reference_model,
            "pair_selection": self.args.pair_selection,
            "preference_pairs_per_sample": self.args.preference_pairs_per_sample,
        }

    def generation_step(self, rows: list[dict[str, Any]]) -> None:
        """Sample and pair the candidates of the local generation batch; every agent gets its pair micro-batches."""
        for agent, agent_slots in zip(self.agent_trainers, self._generate_pair_batches(rows)):
            agent.set_micro_batches(agent_slots)

    def _generate_pair_batches(self, rows: list[dict[str, Any]]) -> list[list[dict[str, torch.Tensor]]]:
        """Sample, rank and pair the candidates of the local generation batch; one pair batch per agent and slot."""
        args, count = self.args, self.args.num_generations
        items = len(rows) // count * self.accelerator.num_processes
        self._maybe_evaluate(first_item=self._epoch_items, num_items=items)
        nodes = [
            self.orchestrator.root_node(item, f"task item {self._epoch_items + g}")
            for g, item in enumerate(rows[::count])
        ]
        rollouts = [
            agent.generate([node.prompts[a] for node in nodes for _ in range(count)])
            for a, agent in enumerate(self.agent_trainers)
        ]
        texts = [[completion_text(c) for c in rollout.completions] for rollout in rollouts]
        item_pairs, means, chosen, rejected = [], [], [], []
        for g, node in enumerate(nodes):
            candidates = [agent_texts[g * count : (g + 1) * count] for agent_texts in texts]
            rewards = self.orchestrator.joint_reward(candidates, node.item, node.item_label)
            index = self._epoch_items + g
            rng = pair_rng(args.seed, self.state.global_step, index) if args.pair_selection == "random" else None
            indices = select_preference_pairs(rewards, args.pair_selection, args.preference_pairs_per_sample, rng)
            item_pairs.append([(g * count + i, g * count + j) for i, j in indices])  # rows of the generation batch
            means.append(sum(rewards) / len(rewards))
            chosen.extend(rewards[i] for i, _ in indices)
            rejected.extend(rewards[j] for _, j in indices)
        self._epoch_items += items
        self.env_step += count * items
        self._log_pair_metrics(means, chosen, rejected)
        per_slot = len(nodes) // args.steps_per_generation
        slots = [
            [row for pairs in item_pairs[s * per_slot : (s + 1) * per_slot] for row in pairs]
            for s in range(args.steps_per_generation)
        ]
        return self._score_slots(slots, rollouts)

    def _score_slots(self, slots: list[list[tuple[int, int]]], rollouts) -> list[list[dict[str, torch.Tensor]]]:
        """Token tensors of every slot's pairs per agent, the others' log-ratios and the reference log-ratios."""
        batches = [
            [_pair_tensors(agent, rollout, pairs) for pairs in slots]
            for agent, rollout in zip(self.agent_trainers, rollouts)
        ]
        # Processes hold different numbers of pairs (ties, pair_selection="all"): every one runs the largest count
        # of no-grad forwards, or ZeRO-3's gathers meet a process that has stopped (DeepSpeed then aborts).
        chunk = self.args.per_device_train_batch_size
        forwards = forwards_needed([batch["prompt_ids"].size(0) for batch in batches[0]], chunk, self.accelerator)
        for s in range(len(slots)):
            with torch.no_grad():
                policy, reference = zip(
                    *[
                        self._logratios(agent, agent_batches[s], forwards[s])
                        for agent, agent_batches in zip(self.agent_trainers, batches)
                    ]
                )
            deltas = torch.stack(policy) - torch.stack(reference)  # (agents, pairs)
            others = others_logratio(deltas)
            for a, agent_batches in enumerate(batches):
                agent_batches[s]["others_logratio"] = others[a]
                agent_batches[s]["ref_logratio"] = reference[a]
        return batches

    def _logratios(
        self, agent, batch: dict[str, torch.Tensor], num_forwards: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Agent's policy log-ratio (chosen over rejected) with the current weights, and the reference's (or 0)."""
        num_pairs = batch["pair_weight"].size(0)
        inputs = (
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            self.args.per_device_train_batch_size,
            num_forwards,
            True,  # TRL's fused head, on every agent and reference model
        )  # no-grad forwards in chunks of a micro-batch's rows, as many on every process
        logps = sequence_logps(agent.model, *inputs)
        policy = dpo_logratio(logps[:num_pairs], logps[num_pairs:])
        if not self.args.use_reference_model:
            return policy, torch.zeros_like(policy)
        if agent.ref_model is not None:
            ref = sequence_logps(agent.ref_model, *inputs)
        elif is_peft_model(agent.model):  # the reference is the model with its adapter disabled, as in TRL
            with agent.accelerator.unwrap_model(agent.model).disable_adapter():
                ref = sequence_logps(agent.model, *inputs)
        else:
            raise RuntimeError(
                f"use_reference_model=True but agent {self.agent_trainers.index(agent)} has no reference model."
            )
        return policy, dpo_logratio(ref[:num_pairs], ref[num_pairs:])

    def _log_pair_metrics(self, means: list[float], chosen: list[float], rejected: list[float]) -> None:
        self._joint_metrics["turn_1/reward_mean"].extend(self._gather_lists(means))
        chosen, rejected = self._gather_lists(chosen), self._gather_lists(rejected)
        self._joint_metrics["preference/pairs"].append(float(len(chosen)))
        self._joint_metrics["preference/chosen_reward_mean"].extend(chosen)
        self._joint_metrics["preference/rejected_reward_mean"].extend(rejected)


def _pair_tensors(agent, rollout, pairs: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Prompt (left-padded) and completion (right-padded) tokens of the chosen rows, then of the rejected rows, and
    `pair_weight` (1 per pair).

    Without a pair (every item of the slot tied) it holds one placeholder pair, row 0 against itself, with weight 0:
    every process then runs the same forwards (ZeRO-3 gathers parameters inside them) and gradient all-reduce.
    """
    weight = [1.0] * len(pairs) if pairs else [0.0]
    pairs = pairs or [(0, 0)]
    prompt_ids, completion_ids = rollout.prompt_ids, rollout.completion_ids
    rows = [w for w, _ in pairs] + [r for _, r in pairs]
    device = agent.accelerator.device
    pad_id = agent.processing_class.pad_token_id
    prompts = [torch.tensor(prompt_ids[r]) for r in rows]
    completions = [torch.tensor(completion_ids[r]) for r in rows]
    return {
        "prompt_ids": pad_sequences(prompts, padding_value=pad_id, padding_side="left").to(device),
        "prompt_mask": pad_sequences([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(
            device
        ),
        "completion_ids": pad_sequences(completions, padding_value=pad_id, padding_side="right").to(device),
        "completion_mask": pad_sequences(
            [torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"
        ).to(device),
        "pair_weight": torch.tensor(weight, device=device),
    }
