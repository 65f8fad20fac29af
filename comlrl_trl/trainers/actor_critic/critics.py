"""The three ways an actor-critic team holds its critics.

- `ActorValueHeads` (IAC, `use_separate_critic=False`): a value head on every actor; the value loss is part of
  the actor's loss (see `ActorAgent`), so the actors' optimisers train the heads too.
- `SeparateCritics` (IAC): one critic model per agent, fed its actor's token ids, each with its own optimiser.
- `JointCritic` (MAAC): one centralised critic fed the joint text of all agents (in the critic's own tokenizer).

Critics with optimisers of their own train with a plain AdamW each, or, under DeepSpeed, in a DeepSpeed engine each
(`critic_engine`), which ZeRO partitions as it partitions the agents'.

Each is a `CriticSet`: it computes the rollout-time values of every sample (`rollout_values`), trains on the
micro-batches the actors train on (`train_micro_batches`, which reports through a metric sink), steps with the
actors' optimiser steps (`step`), and saves and restores itself.
"""

import copy
import hashlib
import os
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from ...adapters.grpo import zero3_enabled
from ...adapters.helpers import zero_sharded
from ...checkpoint import model_fingerprint
from ...core.values import value_loss
from ...joint_text import joint_text
from ...loading import attach_value_head, load_exported_weights
from ...precision import training_autocast
from ...value_models import (
    VALUE_HEAD_NAME,
    CausalLMWithValueHead,
    ValueCapture,
    ValueHead,
    gathered_parameters,
    head_state_dict,
    hidden_size,
    last_token_values,
    load_head_state_dict,
    value_positions,
)


CRITIC_OPTIMIZERS_NAME = "critic_optimizers.pt"
CRITIC_ENGINE_DIR = "critic_engine"  # a critic's DeepSpeed checkpoint, beside its model directory
_ENGINE_TAG = "state"
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
def batch_values(forward, batch: dict[str, Any], critic_type: str, num_forwards: int | None = None) -> torch.Tensor:
    """Values of every row of a scored batch, `_VALUE_CHUNK` rows per no-grad `forward(ids, mask, index)`.

    `num_forwards`: run exactly this many forwards (at least the chunks); the extra ones rerun the first row and are
    discarded, so that under ZeRO-3 every process runs as many as the others (see `value_forwards`).
    """
    rows = batch["prompt_ids"].size(0)
    values = []
    for start in range(0, rows, _VALUE_CHUNK):
        values.append(forward(*batch_inputs(batch, critic_type, slice(start, start + _VALUE_CHUNK))).float())
    for _ in range(_padding_forwards(rows, num_forwards)):
        forward(*batch_inputs(batch, critic_type, slice(0, 1)))  # only its parameter gathers matter
    return torch.cat(values)


def _padding_forwards(rows: int, num_forwards: int | None) -> int:
    chunks = -(-rows // _VALUE_CHUNK)
    if num_forwards is not None and num_forwards < chunks:
        raise ValueError(f"num_forwards={num_forwards} is fewer than the {chunks} chunks of {rows} rows.")
    return 0 if num_forwards is None else num_forwards - chunks


def value_forwards(trainer, rows: list[int]) -> list[int] | None:
    """The no-grad value forwards every process runs for each of its batches (`rows[s]` rows, `_VALUE_CHUNK` at a
    time) under ZeRO-3: the largest count over processes (one gather), since every forward gathers the partitioned
    weights with a collective. None (each process its own chunks) elsewhere."""
    if not zero3_enabled(trainer) or trainer.accelerator.num_processes == 1:
        return None
    local = torch.tensor([-(-r // _VALUE_CHUNK) for r in rows], device=trainer.accelerator.device)
    return trainer.accelerator.gather(local[None]).amax(dim=0).tolist()


def critic_adamw(params, args) -> torch.optim.AdamW:
    """A critic's own AdamW: `critic_learning_rate`, and the betas, eps and weight decay of `args`."""
    return torch.optim.AdamW(
        params,
        lr=args.critic_learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )


def critic_engine_config(plugin_config: dict[str, Any], args, hidden: int) -> dict[str, Any]:
    """The DeepSpeed config of a critic's own engine, from the active plugin's (the agents'): the same ZeRO settings
    (stage, offload, buckets), with the run's micro-batch size, gradient accumulation, clipping and bf16 setting,
    and no optimiser or scheduler section (the critic's AdamW is its own, at a constant `critic_learning_rate`).

    "auto" bucket sizes are filled from the critic's hidden size `hidden` as transformers fills the agents'; other
    "auto" values are left to DeepSpeed's defaults. The accumulation boundary is the caller's
    (`managed_gradient_accumulation: false`): `step()` ends it, whatever number of micro-steps came before (a short
    last update, a joint critic with fewer samples than micro-steps).
    """
    config = copy.deepcopy(plugin_config)
    zero = config.setdefault("zero_optimization", {})
    for key, value in (
        ("reduce_bucket_size", hidden * hidden),
        ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
        ("stage3_param_persistence_threshold", 10 * hidden),
    ):
        if zero.get(key) == "auto":
            zero[key] = value
    config = _without_auto(config)
    for key in ("optimizer", "scheduler", "train_batch_size", "fp16", "bf16", "amp"):
        config.pop(key, None)
    config.update(
        train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_clipping=args.max_grad_norm or 0.0,
        bf16={"enabled": bool(args.bf16)},
        zero_allow_untested_optimizer=True,
        zero_force_ds_cpu_optimizer=False,  # with ZeRO-Offload, the critic's torch AdamW steps on the CPU
        managed_gradient_accumulation=False,
    )
    return config


def _without_auto(config):
    if isinstance(config, dict):
        return {key: _without_auto(value) for key, value in config.items() if value != "auto"}
    return config


def critic_engine(critic: CausalLMWithValueHead, args, plugin_config: dict[str, Any]):
    """`critic` in a DeepSpeed engine of its own (ZeRO-3 partitions its weights, ZeRO-1/2/3 its AdamW state)."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "managed_gradient_accumulation"):
        raise RuntimeError(
            f"Critics with optimisers of their own need a DeepSpeed with managed_gradient_accumulation (this is "
            f"{deepspeed.__version__}); upgrade DeepSpeed, or use IAC with use_separate_critic=False."
        )
    engine, *_ = deepspeed.initialize(
        model=critic,
        model_parameters=[p for p in critic.parameters() if p.requires_grad],
        optimizer=partial(critic_adamw, args=args),
        config=critic_engine_config(plugin_config, args, hidden_size(critic.model)),
    )
    return engine


def critic_fingerprint(critic: CausalLMWithValueHead) -> str:
    """`model_fingerprint` of a critic, with the full shapes of the weights ZeRO-3 partitioned as it loaded (their
    local tensors are empty; DeepSpeed keeps the shape in `ds_shape`)."""
    if not zero_sharded(critic):
        return model_fingerprint(critic)
    digest = hashlib.sha256(type(critic).__name__.encode())
    for name, tensor in critic.state_dict(keep_vars=True).items():
        digest.update(f"{name}:{tuple(getattr(tensor, 'ds_shape', tensor.shape))}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


def critic_tokenizer(source, model, label: str):
    """The tokenizer of a critic that reads text (MAAC's): the critic model's own, from `source` when it is a model
    id or directory, else from the model object's `name_or_path`. Without a pad token it pads with its end token."""
    from transformers import AutoTokenizer

    name = source if isinstance(source, (str, os.PathLike)) else getattr(model, "name_or_path", "")
    if not name:
        raise ValueError(
            f"{label} is a model object without a name_or_path, so its tokenizer cannot be found: pass the critic "
            "as a model id or a directory that holds its tokenizer."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{label}: no tokenizer could be loaded from {os.fspath(name)!r} ({error}). The critic reads the joint "
            "text in its own tokenizer: pass a model id or a directory that holds the critic's tokenizer."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def export_critic(critic: CausalLMWithValueHead, path: str, tokenizer, should_save: bool) -> None:
    """Write `critic` as a loadable directory (model, tokenizer, `value_head.pt`) on the saving process. Every
    process calls it: ZeRO-3 gathers the partitioned weights (the backbone's all at once) for the save."""
    head = head_state_dict(critic.value_head)
    with gathered_parameters(critic.model):
        if should_save:
            critic.model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            torch.save(head, os.path.join(path, VALUE_HEAD_NAME))


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
    fingerprints: list[str]  # of the critics, taken before DeepSpeed casts or partitions them (resume checks)

    def rollout_values(self, turns, scored) -> list[list[torch.Tensor]]:
        """`[agent][turn]` values at rollout time of every row of the scored batches `scored[agent][turn]`."""

    def store(self, targets, old_values) -> None:
        """Keep what training needs beyond the actors' batches (the joint critic's own samples)."""

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        """Accumulate the value loss of micro-step `slot`; `micro_batches[i]` is what actor i trains on."""

    def step(self) -> None:
        """Step the critics' own optimisers (with the actors' optimiser step)."""

    def save_state(self, checkpoint: str) -> None:
        """Write the critics' optimiser state into `checkpoint` (every process calls it)."""

    def save(self, output_dir: str) -> None: ...

    def load(self, checkpoint: str) -> None: ...


class _OwnOptimisers:
    """Critics with optimisers of their own.

    Without DeepSpeed: a plain AdamW per critic (`optimizers`), gradients averaged over processes, clipped, stepped.
    Under DeepSpeed: an engine per critic (`engines`, configured by `critic_engine_config`): forwards and backward
    passes go through it, `step()` ends the accumulation (ZeRO's reduction, clipping, AdamW), and checkpoints hold
    each engine's own (`critic_engine/`).
    """

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
        self.fingerprints = [critic_fingerprint(critic) for critic in critics]
        self.optimizers, self.engines = [], []
        if trainer.is_deepspeed_enabled:
            plugin_config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
            self.engines = [critic_engine(critic, trainer.args, plugin_config) for critic in critics]
        else:
            self.optimizers = [
                critic_adamw([p for p in critic.parameters() if p.requires_grad], trainer.args) for critic in critics
            ]
        self._stepped = [True] * len(critics)  # no backward pass since the engine's last step

    def _forward(self, i: int):
        """What runs critic `i`'s forward `(ids, mask, index) -> values`: its engine under DeepSpeed, else itself."""
        return self.engines[i] if self.engines else self.critics[i]

    def _backward(self, i: int, ids, mask, index, batch, label: str) -> torch.Tensor:
        """Backpropagate critic `i`'s weighted value loss on one micro-batch; returns the unweighted loss."""
        trainer = self.trainer
        args = trainer.args
        if self.engines:
            values = self.engines[i](ids, mask, index).float()  # the engine casts its module to bf16 itself
        else:
            with training_autocast(trainer.accelerator, args.bf16):
                values = self.critics[i](ids, mask, index).float()
        loss = value_loss(values, batch["value_targets"], batch["old_values"], args.value_clip_range)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{label} produced a non-finite value loss ({loss.item()}).")
        weighted = args.value_loss_coef * loss / trainer.current_gradient_accumulation_steps
        if self.engines:
            self.engines[i].backward(weighted, scale_wrt_gas=False)  # divided here, as transformers' Trainer does
            self._stepped[i] = False
        else:
            weighted.backward()
        return loss.detach()

    def step(self) -> None:
        if self.engines:
            for i, engine in enumerate(self.engines):
                if not self._stepped[i]:  # as AdamW skips parameters without gradients
                    engine.step()
                    self._stepped[i] = True
            return
        accelerator = self.trainer.accelerator
        for critic, optimizer in zip(self.critics, self.optimizers):
            params = [p for p in critic.parameters() if p.requires_grad and p.grad is not None]
            if accelerator.num_processes > 1:
                average_gradients(params, accelerator)
            if self.trainer.args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.trainer.args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def _engine_dir(self, checkpoint: str, i: int) -> str:
        """Where critic `i`'s engine checkpoint lives inside `checkpoint`."""
        raise NotImplementedError

    def optimizer_state(self) -> list[dict]:
        return [optimizer.state_dict() for optimizer in self.optimizers]

    def save_state(self, checkpoint: str) -> None:
        """Plain AdamW: every optimiser's state in `CRITIC_OPTIMIZERS_NAME` (saving process). DeepSpeed: every
        engine's checkpoint (weights, fp32 master weights and AdamW state, partitioned as ZeRO holds them) in
        `_engine_dir`, written by every process."""
        if self.engines:
            for i, engine in enumerate(self.engines):
                engine.save_checkpoint(self._engine_dir(checkpoint, i), tag=_ENGINE_TAG, save_latest=False)
        elif self.trainer.args.should_save:
            torch.save(self.optimizer_state(), os.path.join(checkpoint, CRITIC_OPTIMIZERS_NAME))

    def load_optimizer_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, CRITIC_OPTIMIZERS_NAME)
        states = torch.load(path, map_location="cpu", weights_only=True)
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)

    def _load_engines(self, checkpoint: str) -> None:
        """Restore every engine (weights and optimiser state) from its checkpoint in `checkpoint`."""
        for i, engine in enumerate(self.engines):
            path = self._engine_dir(checkpoint, i)
            loaded, _ = engine.load_checkpoint(path, tag=_ENGINE_TAG, load_lr_scheduler_states=False)
            if loaded is None:
                raise FileNotFoundError(f"{path} holds no DeepSpeed checkpoint of critic {i}.")

    def _load(self, checkpoint: str, model_dirs: list[str]) -> None:
        """Restore the critics and their optimisers: the engines' checkpoints under DeepSpeed, else the exported
        models in `model_dirs` and `CRITIC_OPTIMIZERS_NAME`."""
        if self.engines:
            self._load_engines(checkpoint)
            return
        for critic, path in zip(self.critics, model_dirs):
            _load_critic(critic, path)
        self.load_optimizer_state(checkpoint)


class ActorValueHeads:
    """IAC with `use_separate_critic=False`: `agent.model.value_head` on every actor's backbone."""

    def __init__(self, trainer, hidden_dim: int | None):
        self.trainer = trainer
        self.critics = []
        self.fingerprints = []
        for agent in trainer.agent_trainers:
            model = agent.model
            attach_value_head(model, ValueHead(hidden_size(model), hidden_dim).to(model.device))
            agent.value_capture = ValueCapture(model)

    def rollout_values(self, turns, scored) -> list[list[torch.Tensor]]:
        forwards = [
            partial(last_token_values, agent.model, agent.model.value_head) for agent in self.trainer.agent_trainers
        ]
        return _scored_values(self.trainer, forwards, scored)

    def store(self, targets, old_values) -> None:
        pass  # the targets travel in the agents' batches

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        pass  # trained inside each actor's loss

    def step(self) -> None:
        pass

    def save_state(self, checkpoint: str) -> None:
        pass  # the heads are in the actors' optimisers

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
        return _scored_values(self.trainer, [self._forward(i) for i in range(len(self.critics))], scored)

    def store(self, targets, old_values) -> None:
        pass  # the targets travel in the agents' batches

    def train_micro_batches(self, slot: int, micro_batches: list[dict[str, Any]], record: MetricSink) -> None:
        for i, batch in enumerate(micro_batches):
            ids, mask, index = batch_inputs(batch, self.trainer.args.critic_type)
            loss = self._backward(i, ids, mask, index, batch, f"The critic of agent {i}")
            record("value_loss", self.trainer.accelerator.gather(loss).mean().item(), i)

    def save(self, output_dir: str) -> None:
        for i, (critic, agent) in enumerate(zip(self.critics, self.trainer.agent_trainers)):
            path = os.path.join(output_dir, f"agent_{i}", "critic")
            export_critic(critic, path, agent.processing_class, self.trainer.args.should_save)

    def _engine_dir(self, checkpoint: str, i: int) -> str:
        return os.path.join(checkpoint, f"agent_{i}", CRITIC_ENGINE_DIR)

    def load(self, checkpoint: str) -> None:
        self._load(checkpoint, [os.path.join(checkpoint, f"agent_{i}", "critic") for i in range(len(self.critics))])


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
        forward = self._forward(0)
        self._turn_texts = [self._texts(turns, t) for t in range(len(turns))]
        rows = [len(texts) for texts in self._turn_texts]
        forwards = value_forwards(self.trainer, rows) or [None] * len(rows)
        per_turn = []
        for texts, num_forwards in zip(self._turn_texts, forwards):
            values = [
                forward(*self._encode(texts[start : start + _VALUE_CHUNK])).float()
                for start in range(0, len(texts), _VALUE_CHUNK)
            ]
            for _ in range(_padding_forwards(len(texts), num_forwards)):
                forward(*self._encode(texts[:1]))  # as many forwards as every other process (ZeRO-3)
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
        loss = self._backward(0, *self._encode(batch["texts"]), batch, "The centralised critic")
        record("critic/value_loss", self.trainer.accelerator.gather(loss).mean().item())

    def save(self, output_dir: str) -> None:
        export_critic(
            self.critics[0], os.path.join(output_dir, "critic"), self.tokenizer, self.trainer.args.should_save
        )

    def _engine_dir(self, checkpoint: str, i: int) -> str:
        return os.path.join(checkpoint, CRITIC_ENGINE_DIR)

    def load(self, checkpoint: str) -> None:
        self._load(checkpoint, [os.path.join(checkpoint, "critic")])


def _scored_values(trainer, forwards: list, scored) -> list[list[torch.Tensor]]:
    """`[agent][turn]` values of the scored batches, agent i's through `forwards[i]`, with as many forwards on every
    process under ZeRO-3 (`value_forwards`, one gather for all batches)."""
    critic_type = trainer.args.critic_type
    rows = [batch["prompt_ids"].size(0) for batches in scored for batch in batches]
    counts = iter(value_forwards(trainer, rows) or [None] * len(rows))
    return [
        [batch_values(forward, batch, critic_type, next(counts)) for batch in agent_batches]
        for forward, agent_batches in zip(forwards, scored)
    ]


def _load_critic(critic: CausalLMWithValueHead, path: str) -> None:
    load_exported_weights(critic.model, path)
    state = torch.load(os.path.join(path, VALUE_HEAD_NAME), map_location="cpu", weights_only=True)
    load_head_state_dict(critic.value_head, state)
