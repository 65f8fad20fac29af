"""The three ways an actor-critic team holds its critics.

- `ActorValueHeads` (IAC, `use_separate_critic=False`): a value head on every actor; the value loss is part of
  the actor's loss (see `ActorAgent`), so the actors' optimisers train the heads too.
- `SeparateCritics` (IAC): one critic model per agent, fed its actor's token ids, each with its own optimiser.
- `JointCritic` (MAAC): one centralised critic fed the joint text of all agents (first actor's tokenizer).

Each is a `CriticSet`: it computes the rollout-time values of every sample (`rollout_values`), trains on the
micro-batches the actors train on (`train_micro_batches`, which reports through a metric sink), steps with the
actors' optimiser steps (`step`), and saves and restores itself.
"""

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ...core.values import value_loss
from ...hardware import training_autocast
from ...joint_text import joint_text
from ...loading import attach_value_head, load_exported_weights
from ...value_models import (
    VALUE_HEAD_NAME,
    CausalLMWithValueHead,
    ValueCapture,
    ValueHead,
    head_state_dict,
    hidden_size,
    last_token_values,
    load_head_state_dict,
    value_positions,
)


CRITIC_OPTIMIZERS_NAME = "critic_optimizers.pt"
# A metric sink: `record(key, value)` for a team metric, `record(key, value, agent_index)` for one agent's.
MetricSink = Callable[..., None]
_VALUE_CHUNK = 16  # rows per no-grad value forward at rollout time
_GRAD_BUCKET_NUMEL = 2**24  # gradient elements per all-reduce of a critic (64 MB in fp32)


def batch_inputs(batch: dict[str, Any], critic_type: str, rows: slice = slice(None)):
    """Token ids, attention mask and value positions of a scored TRL batch, as the critic reads them."""
    prompt_ids, prompt_mask = batch["prompt_ids"][rows], batch["prompt_mask"][rows]
    if critic_type == "v":
        return prompt_ids, prompt_mask, value_positions(prompt_ids, None)
    completion_mask = batch["completion_mask"][rows]
    input_ids = torch.cat([prompt_ids, batch["completion_ids"][rows]], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return input_ids, attention_mask, value_positions(prompt_ids, completion_mask)


@torch.no_grad()
def batch_values(model, head, batch: dict[str, Any], critic_type: str) -> torch.Tensor:
    values = []
    for start in range(0, batch["prompt_ids"].size(0), _VALUE_CHUNK):
        ids, mask, index = batch_inputs(batch, critic_type, slice(start, start + _VALUE_CHUNK))
        values.append(last_token_values(model, head, ids, mask, index).float())
    return torch.cat(values)


def average_gradients(params: list[torch.Tensor], accelerator, bucket_numel: int = _GRAD_BUCKET_NUMEL) -> None:
    """Average the gradients of `params` over processes with one all-reduce per bucket of at most `bucket_numel`
    elements of one dtype (as DDP's buckets), not one per parameter."""
    bucket: list[torch.Tensor] = []
    for p in [*params, None]:
        full = bucket and (
            p is None
            or p.grad.dtype != bucket[0].grad.dtype
            or sum(q.grad.numel() for q in bucket) + p.grad.numel() > bucket_numel
        )
        if full:
            flat = accelerator.reduce(torch.cat([q.grad.reshape(-1) for q in bucket]), reduction="mean")
            for q, grad in zip(bucket, flat.split([q.grad.numel() for q in bucket])):
                q.grad.copy_(grad.view_as(q.grad))
            bucket = []
        if p is not None:
            bucket.append(p)


class CriticSet(Protocol):
    """How an actor-critic team holds its critics; the trainer and orchestrator use only these methods."""

    critics: list[CausalLMWithValueHead]  # the critic models (empty when the heads sit on the actors)

    def rollout_values(self, turns, scored) -> list[list[torch.Tensor]]:
        """`[agent][turn]` values at rollout time of every row of the scored batches `scored[agent][turn]`."""

    def store(self, targets, old_values) -> None:
        """Keep what training needs beyond the actors' batches (the joint critic's own samples)."""

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        """Accumulate the value loss of micro-step `slot`; `micro_batches[i]` is what actor i trains on."""

    def step(self) -> None:
        """Step the critics' own optimisers (with the actors' optimiser step)."""

    def optimizer_state(self) -> list[dict]: ...

    def save(self, output_dir: str) -> None: ...

    def load(self, checkpoint: str) -> None: ...


class _OwnOptimisers:
    """Critics with optimisers of their own: gradients averaged over processes, clipped, stepped."""

    def __init__(self, trainer, critics: list[CausalLMWithValueHead]):
        if trainer.args.fp16:
            raise ValueError(
                "fp16=True is not supported with critics that have their own optimisers (IAC with "
                "use_separate_critic=True, MAAC): their value losses have no gradient scaler, so fp16 gradients "
                "underflow. Use bf16=True, or IAC with use_separate_critic=False (heads on the actors, which use "
                "the actors' scaler)."
            )
        self.trainer = trainer
        self.critics = critics
        args = trainer.args
        self.optimizers = [
            torch.optim.AdamW(
                [p for p in critic.parameters() if p.requires_grad],
                lr=args.critic_learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
            )
            for critic in critics
        ]

    def _backward(self, critic, ids, mask, index, batch, label: str) -> torch.Tensor:
        """Backpropagate the critic's weighted value loss on one micro-batch; returns the unweighted loss."""
        trainer = self.trainer
        args = trainer.args
        with training_autocast(trainer.accelerator, args.bf16):
            values = critic(ids, mask, index).float()
        loss = value_loss(values, batch["value_targets"], batch["old_values"], args.value_clip_range)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{label} produced a non-finite value loss ({loss.item()}).")
        (args.value_loss_coef * loss / trainer.current_gradient_accumulation_steps).backward()
        return loss.detach()

    def step(self) -> None:
        accelerator = self.trainer.accelerator
        for critic, optimizer in zip(self.critics, self.optimizers):
            params = [p for p in critic.parameters() if p.requires_grad and p.grad is not None]
            if accelerator.num_processes > 1:
                average_gradients(params, accelerator)
            if self.trainer.args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.trainer.args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def optimizer_state(self) -> list[dict]:
        return [optimizer.state_dict() for optimizer in self.optimizers]

    def load_optimizer_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, CRITIC_OPTIMIZERS_NAME)
        states = torch.load(path, map_location="cpu", weights_only=True)
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)


class ActorValueHeads:
    """IAC with `use_separate_critic=False`: `agent.model.value_head` on every actor's backbone."""

    def __init__(self, trainer, hidden_dim: int | None):
        self.trainer = trainer
        self.critics = []
        for agent in trainer.agent_trainers:
            model = agent.model
            attach_value_head(model, ValueHead(hidden_size(model), hidden_dim).to(model.device))
            agent.value_capture = ValueCapture(model)

    def rollout_values(self, turns, scored) -> list[list[torch.Tensor]]:
        critic_type = self.trainer.args.critic_type
        return [
            [batch_values(agent.model, agent.model.value_head, batch, critic_type) for batch in agent_batches]
            for agent, agent_batches in zip(self.trainer.agent_trainers, scored)
        ]

    def store(self, targets, old_values) -> None:
        pass  # the targets travel in the agents' batches

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        pass  # trained inside each actor's loss

    def step(self) -> None:
        pass

    def optimizer_state(self) -> list[dict]:
        return []

    def save(self, output_dir: str) -> None:
        for i, agent in enumerate(self.trainer.agent_trainers):
            state = head_state_dict(agent.model.value_head)  # on every process: ZeRO-3 gathers the head
            if self.trainer.args.should_save:
                torch.save(state, os.path.join(output_dir, f"agent_{i}", VALUE_HEAD_NAME))

    def load(self, checkpoint: str) -> None:
        for i, agent in enumerate(self.trainer.agent_trainers):
            state = torch.load(
                os.path.join(checkpoint, f"agent_{i}", VALUE_HEAD_NAME), map_location="cpu", weights_only=True
            )
            load_head_state_dict(agent.model.value_head, state)


class SeparateCritics(_OwnOptimisers):
    """IAC with `use_separate_critic=True`: critic i reads agent i's token ids."""

    def rollout_values(self, turns, scored) -> list[list[torch.Tensor]]:
        critic_type = self.trainer.args.critic_type
        return [
            [batch_values(critic.model, critic.value_head, batch, critic_type) for batch in agent_batches]
            for critic, agent_batches in zip(self.critics, scored)
        ]

    def store(self, targets, old_values) -> None:
        pass  # the targets travel in the agents' batches

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        for i, (critic, batch) in enumerate(zip(self.critics, micro_batches)):
            ids, mask, index = batch_inputs(batch, self.trainer.args.critic_type)
            loss = self._backward(critic, ids, mask, index, batch, f"The critic of agent {i}")
            record("value_loss", self.trainer.accelerator.gather(loss).mean().item(), i)

    def save(self, output_dir: str) -> None:
        if self.trainer.args.should_save:
            for i, (critic, agent) in enumerate(zip(self.critics, self.trainer.agent_trainers)):
                critic.save_pretrained(os.path.join(output_dir, f"agent_{i}", "critic"), agent.processing_class)

    def load(self, checkpoint: str) -> None:
        for i, critic in enumerate(self.critics):
            _load_critic(critic, os.path.join(checkpoint, f"agent_{i}", "critic"))
        self.load_optimizer_state(checkpoint)


class JointCritic(_OwnOptimisers):
    """MAAC: one critic over the joint text of all agents, trained once per joint sample."""

    def __init__(self, trainer, critic: CausalLMWithValueHead, tokenizer):
        super().__init__(trainer, [critic])
        self.tokenizer = tokenizer
        self._slots: list[dict[str, torch.Tensor]] = []

    def _texts(self, turns, t: int) -> list[str]:
        prompts, texts = turns[t].prompts, turns[t].texts
        completions = self.trainer.args.critic_type == "q"
        return [
            joint_text(
                [agent_prompts[row] for agent_prompts in prompts],
                [agent_texts[row] for agent_texts in texts] if completions else None,
            )
            for row in range(len(prompts[0]))
        ]

    def _max_length(self) -> int | None:
        """Tokens of a joint text: every agent's prompt (`max_prompt_length`) and, for a Q critic, response.
        None without `max_prompt_length` (no limit)."""
        args, agents = self.trainer.args, len(self.trainer.agent_trainers)
        if args.max_prompt_length is None:
            return None
        responses = args.max_completion_length if args.critic_type == "q" else 0
        return agents * (args.max_prompt_length + responses)

    def _encode(self, texts: list[str]):
        device = self.critics[0].device
        limit = self._max_length()
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if limit is not None:
            ids = [row[-limit:] for row in ids]  # from the left: the value is read at the last token
        encoded = self.tokenizer.pad({"input_ids": ids}, padding=True, padding_side="left", return_tensors="pt")
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
        return ids, mask, torch.full((ids.size(0),), ids.size(1) - 1, dtype=torch.long, device=device)

    @torch.no_grad()
    def rollout_values(self, turns, scored) -> list[list[torch.Tensor]]:
        critic = self.critics[0]
        self._turn_texts = [self._texts(turns, t) for t in range(len(turns))]
        per_turn = []
        for texts in self._turn_texts:
            values = [
                critic(*self._encode(texts[start : start + _VALUE_CHUNK])).float()
                for start in range(0, len(texts), _VALUE_CHUNK)
            ]
            per_turn.append(torch.cat(values))
        return [per_turn for _ in self.trainer.agent_trainers]

    def store(self, targets, old_values) -> None:
        """Keep the joint samples with their targets (the agents' mean), split like the actors' micro-batches."""
        texts = [text for turn_texts in self._turn_texts for text in turn_texts]
        joint_targets = torch.cat([torch.stack(turn_targets).mean(dim=0) for turn_targets in zip(*targets)])
        olds = torch.cat(old_values[0])
        order = torch.randperm(len(texts)).tolist()
        slots = self.trainer.args.steps_per_generation
        size = -(-len(texts) // slots)
        self._slots = []
        for start in range(0, len(texts), size):
            rows = order[start : start + size]
            self._slots.append(
                {"texts": [texts[r] for r in rows], "value_targets": joint_targets[rows], "old_values": olds[rows]}
            )

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        if slot >= len(self._slots):
            return
        batch = self._slots[slot]  # the joint samples of this micro-step (the actors' micro-batches are per agent)
        loss = self._backward(self.critics[0], *self._encode(batch["texts"]), batch, "The centralised critic")
        record("critic/value_loss", self.trainer.accelerator.gather(loss).mean().item())

    def save(self, output_dir: str) -> None:
        if self.trainer.args.should_save:
            self.critics[0].save_pretrained(os.path.join(output_dir, "critic"), self.tokenizer)

    def load(self, checkpoint: str) -> None:
        _load_critic(self.critics[0], os.path.join(checkpoint, "critic"))
        self.load_optimizer_state(checkpoint)


def _load_critic(critic: CausalLMWithValueHead, path: str) -> None:
    load_exported_weights(critic.model, path)
    state = torch.load(os.path.join(path, VALUE_HEAD_NAME), map_location="cpu", weights_only=True)
    load_head_state_dict(critic.value_head, state)
