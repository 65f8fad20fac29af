"""The one place that knows TRL's `GRPOTrainer` (and `transformers.Trainer`) internals.

Every private TRL, transformers or Accelerate name that the team trainers need is used here and offered under a
named, documented method; the orchestrators, critics, MADPO, MARLHF and the checkpoint code call only these. A TRL
upgrade therefore touches this file (and `tests/test_trl_contract.py`, which pins the behaviour relied on).

`AgentGRPOTrainer` is one agent of a team, and every agent is one, of the same class: generation (`generate`),
scoring with rewards handed in (`score`), the agent's micro-batches (`fill_micro_batches`, `micro_batch`), its
forward/backward (`train_micro_batch`) and loss (`compute_agent_loss`), its optimiser, scheduler, scaler and RNG
state, metrics, and the reset between training stages. An agent never runs its own `train()`: the team's loop
(`comlrl_trl.adapters.team`, `trainers/team/trainer.py`) drives every agent alike.

Values passed, not parked. Nothing the team computes is parked on an agent for TRL to read back: `score` builds
the scored batch from the rollout and rewards it is given (TRL's padding, masks and log-probability forward, TRL's
reward metrics; no TRL advantages, computed and dropped), `fill_micro_batches` takes the team's advantages, and the
loss's vLLM importance-sampling ratio is set by the log-probability forward the agent hands TRL's loss as its `model`
argument (`_RatioFromForward`). TRL's own scoring (`_generate_and_score_completions`, `_generate`,
`_calculate_rewards`) is never called on an agent.
"""

import time
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache
from transformers import Trainer
from transformers.training_args import OptimizerNames
from transformers.utils import logging
from trl import GRPOTrainer
from trl.trainer.utils import nanstd, pad, shuffle_sequence_dict, split_tensor_dict, use_adapter

from ..core.importance import importance_sampling_ratio, logp_differences, resolve_correction
from ..precision import enable_cpu_fp16
from .helpers import gradient_checkpointing_disabled, zero_sharded
from .logprob_forward import AgentLogProbForward
from .shared_prompt import shares_prompts


logger = logging.get_logger(__name__)


#: The micro-batch entries TRL's loss (`GRPOTrainer._compute_loss`) passes on to its log-probability forward by name
#: (`tests/test_trl_contract.py` pins them): with any of them set, the forward is left as TRL runs it.
LOSS_MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class Rollout(NamedTuple):
    """What one agent's generation returns, in TRL's order (TRL unpacks it as a plain tuple when scoring)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tool_mask: Any
    completions: list[Any]  # strings, or `[{"role": "assistant", "content": ...}]` for chat prompts
    logprobs: list[list[float]] | None  # sampling log-probabilities (vLLM), for TRL's importance-sampling correction
    extra_fields: dict[str, Any]
    images: Any
    tool_images: Any


def completion_text(completion: Any) -> str:
    """TRL returns strings for plain prompts and `[{"role": "assistant", "content": ...}]` for chat prompts."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def joint_reward(prompts=None, completions=None, **kwargs):
    """Placeholder reward function of every agent trainer: rewards are joint and handed in, never computed here.

    Its name labels TRL's per-agent reward metrics (`rewards/joint_reward/mean`).
    """
    raise RuntimeError("joint_reward is computed by the joint-rollout orchestrator and must never be called.")


def deepspeed_state_exists() -> bool:
    """Whether this process already runs an Accelerator under DeepSpeed (whose plugin later Accelerators must reuse)."""
    return bool(AcceleratorState._shared_state) and AcceleratorState().distributed_type == DistributedType.DEEPSPEED


def zero3_enabled(trainer) -> bool:
    """Whether `trainer` (a transformers `Trainer`) runs under DeepSpeed ZeRO-3, which partitions its weights."""
    return bool(trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3)


def accelerator_args_reusing_deepspeed(args: dict[str, Any]) -> dict[str, Any]:
    """Accelerator arguments of a trainer in a process that may already run one: Accelerate refuses a DeepSpeed
    plugin on any Accelerator but the first, so every later one (the team's agents) reuses the active plugin."""
    if deepspeed_state_exists():
        args["deepspeed_plugin"] = None
    return args


# Hooks DeepSpeedEngine registers on its module that `engine.destroy()` (DeepSpeed 0.19) leaves in place.
_ENGINE_MODULE_HOOKS = ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check")


def release_accelerator(accelerator) -> None:
    """Free everything `accelerator` prepared (wrapped model, optimiser state, DeepSpeed engine) between trainings.

    `Accelerator.free_memory()` destroys a DeepSpeed engine, but DeepSpeed's `destroy()` leaves the engine's forward
    hooks on the module, and ZeRO-3 leaves a reference to its optimiser on every parameter: both keep the engine and
    its optimiser state alive as long as the model lives. They are removed first.
    """
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        unhook_engine(wrapped.engine)
    accelerator.free_memory()


def unhook_engine(engine) -> None:
    """Remove what ties a DeepSpeed engine to its module beyond `destroy()`: its forward hooks, and ZeRO-3's
    back-reference from every parameter to its optimiser."""
    for name in _ENGINE_MODULE_HOOKS:
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
            setattr(engine, name, None)
    for param in engine.module.parameters():
        if hasattr(param, "_z3_optimizer"):  # ZeRO-3's back-reference from every parameter to its optimiser
            del param._z3_optimizer


def release_engine(engine) -> None:
    """Free a DeepSpeed engine that no Accelerator prepared (`unhook_engine`, then DeepSpeed's `destroy()`)."""
    unhook_engine(engine)
    engine.destroy()


class AgentGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` for one agent of a team: generation, scoring and loss are TRL's; rewards come from outside.

    Prompts longer than `args.max_prompt_length` tokens are truncated from the left before generation (the end of a
    prompt, where the question and the generation prompt sit, is kept), with a warning once per agent.
    """

    agent_index: int  # the agent's place in the team (actor order); every construction names it
    last_learning_rate: float | None = None  # the learning rate of this agent's latest optimiser update
    _tag_names = ["trl", "grpo", "comlrl_trl"]  # TRL's Hub tags of the model; the team sets its family's
    _warned_truncation = False

    def __init__(self, *, args, agent_index: int, **kwargs):
        self.agent_index = agent_index
        with _trl_temperatures(args):
            super().__init__(args=args, **kwargs)

    def tag_model(self, tags: tuple[str, ...]) -> None:
        """Tag this agent's model (and its model card) for the Hub with its team's family (TRL's `_tag_names`)."""
        self._tag_names = list(tags)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    # ----- generation and scoring -----

    def generate(self, prompts: list) -> Rollout:
        """One completion per prompt (repeat a prompt K times for K samples), with TRL's tokenisation and decoding
        (transformers' `generate`, or TRL's `rollout_func`: the team's vLLM engines), under `generation_contexts`."""
        with self.generation_contexts():
            return Rollout(*super()._generate(prompts))

    @contextmanager
    def generation_contexts(self):
        """The block in which this agent's model generates: the training precision, without gradients.

        TRL runs the loss under bf16 autocast but generates in the weights' dtype, which leaves bf16 matrix products
        (2-3x faster for generation on a bf16 CPU or GPU) unused; here generation runs under the accelerator's
        autocast too, with frozen weights cast once per call (`_frozen_weights_cast_once`) and TRL's fp32 head kept
        in fp32 (`_head_outside_autocast`). Nothing else: the CPU speed-ups are the lean CPU generator's
        (`comlrl_trl.generation.cpu`).
        """
        with (
            self.accelerator.autocast(),
            torch.no_grad(),
            _frozen_weights_cast_once(self.model, self.accelerator.device.type),
            _head_outside_autocast(self.model) if self.args.cast_lm_head_to_fp32 else nullcontext(),
        ):
            yield

    def use_generation_engines(self, engines) -> None:
        """Generate through the team's vLLM engines (a `comlrl_trl.generation.TeamVLLM`) from now on.

        TRL's own machinery then does the rest as with its `use_vllm`: prompts are tokenised (and truncated) by TRL,
        completions decoded by TRL, the engine's weights re-synced whenever this agent's optimiser stepped
        (`sync_weights` on a changed `global_step`), and the importance-sampling correction applied with the
        engine's sampling log-probabilities.
        """
        self.use_vllm = True
        self.vllm_importance_sampling_correction = resolve_correction(
            self.args.vllm_importance_sampling_correction,
            self.top_p,
            self.top_k,
            self.min_p,
            self.agent_index,
            sampling_temperature=self.args.temperature,  # the engines sample at the configuration's temperature
            logprob_temperature=self.temperature,  # TRL's: its log-probability heads divide the logits by it
        )
        self.vllm_generation = _TeamEngineSync(engines, self)
        self._last_loaded_step = -1  # sync before the first generation (weights may have been loaded since)
        self.rollout_func = _engine_rollout

    def score(self, rows: list[dict[str, Any]], rollout: Rollout, rewards: torch.Tensor) -> dict[str, Any]:
        """The scored batch of `rollout` for the local `rows`, with the gathered `(B_global,)` rewards handed in.

        TRL's scored batch, built from the values passed in (no TRL call reads them back from the agent): the padded
        prompt and completion ids and masks (TRL's padding, `mask_truncated_completions`), `num_items_in_batch`, the
        old log-probabilities where a generation is trained off-policy (unless `defers_old_logps` leaves them to
        `fill_micro_batches`), the vLLM sampling log-probabilities and importance-sampling ratio (unless the loss's
        own forward gives it: `ratio_from_loss_forward`), the reference log-probabilities (`beta > 0`), and TRL's
        reward metrics of `rewards`. No advantages: they are the team's, handed to `fill_micro_batches`.
        """
        if rollout.images is not None or any("image" in row or "images" in row for row in rows):
            raise ValueError(
                f"Agent {self.agent_index}'s rows hold images: agents score text prompts only (prompts and "
                "completions as token ids, no image inputs)."
            )
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        pad_id = self._tokenizer.pad_token_id
        prompt_ids, prompt_mask = self._padded(rollout.prompt_ids, pad_id, "left", device)
        completion_ids, completion_mask = self._padded(rollout.completion_ids, pad_id, "right", device)
        tool_mask = None
        if rollout.tool_mask is not None:
            tool_mask = pad(
                [torch.tensor(mask) for mask in rollout.tool_mask],
                padding_value=1,
                padding_side="right",
                pad_to_multiple_of=self.pad_to_multiple_of,
            ).to(device=device)
        sampling_logps = None
        if rollout.logprobs is not None:
            # vLLM gives None for a token it could not score: NaN here, left uncorrected by the ratio (as in TRL).
            sampling_logps = pad(
                [torch.tensor([float("nan") if x is None else x for x in logps]) for logps in rollout.logprobs],
                padding_value=0.0,
                padding_side="right",
                pad_to_multiple_of=self.pad_to_multiple_of,
            ).to(device=device)
        if self.mask_truncated_completions:
            ends = [*self.eos_token_ids, pad_id]
            kept = ~torch.tensor([ids[-1] not in ends for ids in rollout.completion_ids], device=device)
            completion_mask = completion_mask * kept.unsqueeze(1).int()
            if tool_mask is not None:
                tool_mask = tool_mask * kept.unsqueeze(1).int()
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "num_items_in_batch": self.accelerator.gather(loss_mask.sum()).sum(),
        }
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        chunk = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        every = self.args.steps_per_generation * self.num_iterations
        # Old log-probabilities: where a generation spans optimiser updates (unless deferred to
        # `fill_micro_batches`), and for the vLLM correction unless the loss's own forward gives it.
        off_policy = self.args.gradient_accumulation_steps % every != 0 and not self.defers_old_logps(rows)
        correct = self.use_vllm and self.vllm_importance_sampling_correction and not self.ratio_from_loss_forward
        with torch.no_grad(), gradient_checkpointing_disabled(self.model, self.args.gradient_checkpointing_kwargs):
            if off_policy or correct:
                old = self.per_token_logps(self.model, ids, attention_mask, completion_ids.size(1), chunk)
                batch["old_per_token_logps"] = old
            if correct:
                batch["importance_sampling_ratio"] = self._sampling_correction(
                    old, {"sampling_per_token_logps": sampling_logps, "completion_mask": loss_mask}
                )
            if self.beta != 0.0:
                batch["ref_per_token_logps"] = self._reference_logps(
                    ids, attention_mask, completion_ids.size(1), chunk
                )
        if sampling_logps is not None:
            batch["sampling_per_token_logps"] = sampling_logps
        if tool_mask is not None:
            batch["tool_mask"] = tool_mask
        self._record_reward_metrics(rewards, mode)
        return batch

    def _padded(self, rows: list[list[int]], pad_id: int, side: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-id rows as TRL pads them (`pad_to_multiple_of` too), and their mask."""
        ids = [torch.tensor(row) for row in rows]
        masks = [torch.ones_like(row, dtype=torch.long) for row in ids]
        multiple = self.pad_to_multiple_of
        return (
            pad(ids, padding_value=pad_id, padding_side=side, pad_to_multiple_of=multiple).to(device=device),
            pad(masks, padding_value=0, padding_side=side, pad_to_multiple_of=multiple).to(device=device),
        )

    def _reference_logps(self, ids, attention_mask, logits_to_keep: int, chunk: int) -> torch.Tensor:
        """TRL's reference log-probabilities: the reference model's, or (a PEFT agent without one) the base model's,
        with the adapter disabled (or the initial adapter `ref`, when an existing adapter is trained further)."""
        if self.ref_model is not None:
            return self.per_token_logps(self.ref_model, ids, attention_mask, logits_to_keep, chunk)
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self.per_token_logps(self.model, ids, attention_mask, logits_to_keep, chunk)

    def _record_reward_metrics(self, rewards: torch.Tensor, mode: str) -> None:
        """TRL's reward metrics of the handed-in rewards (the agent's one reward function, `joint_reward`): their
        mean and standard deviation, and the share of rows whose normalising standard deviation is zero."""
        weighted = rewards * self.reward_weights.to(rewards.device)[0]
        k = self.num_generations if mode == "train" else self.num_generations_eval
        if self.multi_objective_aggregation == "normalize_then_sum":
            grouped = rewards.view(-1, k, 1)
            spread = nanstd(grouped, dim=1, keepdim=True) if k > 1 else torch.zeros_like(grouped[:, :1])
            normalised = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (spread + 1e-4)).view(-1)
            normalised = normalised * self.reward_weights.to(rewards.device)[0]
            std = nanstd(normalised).expand_as(normalised) if normalised.numel() > 1 else torch.zeros_like(rewards)
        elif self.scale_rewards == "batch":
            std = nanstd(weighted).expand_as(weighted) if weighted.numel() > 1 else torch.zeros_like(weighted)
        elif k > 1:
            std = nanstd(weighted.view(-1, k), dim=1).repeat_interleave(k, dim=0)
        else:
            std = torch.zeros_like(weighted)
        metrics = self._metrics[mode]
        metrics[f"rewards/{self.reward_func_names[0]}/mean"].append(torch.nanmean(rewards).item())
        metrics[f"rewards/{self.reward_func_names[0]}/std"].append(nanstd(rewards).item())
        metrics["reward"].append(torch.nanmean(weighted).item())
        metrics["reward_std"].append(nanstd(weighted).item())
        metrics["frac_reward_zero_std"].append(torch.isclose(std, torch.zeros_like(std)).float().mean().item())

    @property
    def ratio_from_loss_forward(self) -> bool:
        """Whether the vLLM importance-sampling ratio is computed from the loss's forward instead of a scoring forward.

        True when generation is on-policy: the weights do not change between a generation and the last loss on its
        samples (TRL's condition for leaving out old log-probabilities: `gradient_accumulation_steps` a multiple of
        `steps_per_generation * num_iterations`). The loss forward's detached log-probabilities are then the
        scoring forward's, so the ratio and the loss are the same as TRL's, one forward pass cheaper per generation.
        """
        every = self.args.steps_per_generation * self.num_iterations
        return bool(
            self.use_vllm
            and self.vllm_importance_sampling_correction
            and self.args.gradient_accumulation_steps % every == 0
        )

    def _prepare_inputs(self, generation_batch):
        # The team's loop hands every agent ready micro-batches (dicts); TRL would generate here.
        if isinstance(generation_batch, dict):
            return generation_batch
        raise RuntimeError("Agent trainers train on the micro-batches the team fills (fill_micro_batches).")

    def _generate_and_score_completions(self, inputs):
        raise RuntimeError("Agent trainers generate through generate() and score through score().")

    def _generate(self, prompts: list):
        raise RuntimeError("Agent trainers generate through generate() and score through score().")

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        raise RuntimeError("Agent trainers score only joint rewards handed in by the orchestrator (score()).")

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = getattr(self.args, "max_prompt_length", None)
        lengths = [len(ids) for ids in prompt_ids]
        if limit is None or max(lengths, default=0) <= limit:
            return prompt_ids, images, multimodal_fields
        if images is not None or multimodal_fields:
            raise ValueError(
                f"A prompt of agent {self.agent_index} has {max(lengths)} tokens, above "
                f"max_prompt_length={limit}, and holds images, which cannot be truncated; shorten it or "
                "raise max_prompt_length."
            )
        if not self._warned_truncation:
            self._warned_truncation = True
            logger.warning(
                "Agent %d: %d of %d prompts are longer than max_prompt_length=%d tokens (the longest has %d) and are "
                "truncated from the left. Shorten the prompts, or raise max_prompt_length (None: no limit). This "
                "warning is shown once per agent.",
                self.agent_index,
                sum(n > limit for n in lengths),
                len(lengths),
                limit,
                max(lengths),
            )
        return [ids[-limit:] for ids in prompt_ids], images, multimodal_fields

    def per_token_logps(self, model, input_ids, attention_mask, logits_to_keep: int, batch_size: int) -> torch.Tensor:
        """TRL's per-token log-probabilities of the last `logits_to_keep` tokens (temperature applied as in the loss),
        through this agent's log-probability forward (`logps_and_entropies`)."""
        logps, *_ = self.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size)
        return logps

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep: int, **kwargs: Any):
        """TRL's `_get_per_token_logps_and_entropies` (`kwargs`: the rest of its arguments) with `model` called
        through this agent's log-probability forward (`logprob_forward`)."""
        forward = self.logprob_forward(model, input_ids.size(1) - logits_to_keep, kwargs)
        return self._get_per_token_logps_and_entropies(forward, input_ids, attention_mask, logits_to_keep, **kwargs)

    # ----- micro-batches -----

    def fill_micro_batches(self, batch: dict[str, Any], advantages: torch.Tensor) -> None:
        """Set this generation's training rows: `batch` (from `score`) with its advantages, shuffled and split into
        `steps_per_generation` micro-batches, as TRL buffers its own."""
        # First key: TRL's shuffle reads the row count from the first value, which must not be a scalar.
        batch = {"advantages": advantages.to(batch["completion_ids"].device, torch.float32), **batch}
        micro_batches = split_tensor_dict(shuffle_sequence_dict(batch), self.args.steps_per_generation)
        if self.defers_old_logps() and "old_per_token_logps" not in batch:
            self._fill_old_logps(micro_batches[1:])
        self.set_micro_batches(micro_batches)

    def defers_old_logps(self, rows: list[dict[str, Any]] | None = None) -> bool:
        """Whether the old log-probabilities of a generation are computed after its shuffle, for micro-batches 1 and
        later only, instead of by TRL's scoring for every row.

        TRL needs them when a generation spans several optimiser updates (`steps_per_generation` updates' rows, one
        `gradient_accumulation_steps` each). The first micro-batch is trained before any update, so its old
        log-probabilities are its loss forward's own, which TRL's loss takes when the batch has none: the same ratio
        (1) for one forward pass less. Not with `num_iterations > 1` (the first micro-batch comes back after updates),
        vLLM (TRL's importance-sampling correction reads them) or images (their forward inputs stay TRL's).
        """
        every = self.args.steps_per_generation * self.num_iterations
        return (
            self.args.gradient_accumulation_steps % every != 0
            and self.num_iterations == 1
            and not self.use_vllm
            and not getattr(self, "_is_vlm", False)
            and not any("image" in row or "images" in row for row in rows or ())
        )

    def _fill_old_logps(self, micro_batches: list[dict[str, Any]]) -> None:
        """TRL's scoring forward (no gradients, in `per_device_train_batch_size` chunks) over `micro_batches`, whose
        old log-probabilities it sets."""
        keys = ("prompt_ids", "completion_ids", "prompt_mask", "completion_mask")
        prompts, completions, prompt_mask, completion_mask = (torch.cat([m[k] for m in micro_batches]) for k in keys)
        with torch.no_grad(), gradient_checkpointing_disabled(self.model, self.args.gradient_checkpointing_kwargs):
            logps = self.per_token_logps(
                self.model,
                torch.cat([prompts, completions], dim=1),
                torch.cat([prompt_mask, completion_mask], dim=1),
                completions.size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        for micro_batch, old in zip(micro_batches, logps.split([len(m["completion_ids"]) for m in micro_batches])):
            micro_batch["old_per_token_logps"] = old

    def set_micro_batches(self, batches: list[dict[str, Any]]) -> None:
        """Set this generation's micro-batches as they are (one per gradient-accumulation step)."""
        self._buffered_inputs = list(batches)

    def micro_batch(self, slot: int) -> dict[str, Any]:
        """The micro-batch trained at accumulation step `slot` of this generation."""
        return self._buffered_inputs[slot]

    def train_micro_batch(self, slot: int, sync_gradients: bool) -> torch.Tensor:
        """Forward and backward of micro-batch `slot` (`forward_backward`); returns the detached loss.

        Gradients are averaged over processes only when `sync_gradients` (the last micro-step of an optimiser update),
        as transformers' loop does; DeepSpeed decides that itself from the accumulation boundary.
        """
        if sync_gradients or self.is_deepspeed_enabled:
            context = nullcontext()
        else:
            context = self.accelerator.no_sync(self.model_wrapped)
        with context:
            loss = self.forward_backward(self.micro_batch(slot))
        if not torch.isfinite(loss).all():
            raise FloatingPointError(
                f"Agent {self.agent_index} produced a non-finite loss ({loss.item()}) at step {self.state.global_step}."
            )
        return loss

    def forward_backward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The agent's loss on one micro-batch (`compute_agent_loss`) and its backward pass; returns the detached loss.

        What TRL's `training_step` runs for a GRPO trainer, called here directly with the micro-batch: transformers'
        training step (model and optimiser in training mode, `torch_empty_cache_steps`, LOMO's learning rate, the
        mean over `n_gpu` replicas, Accelerate's backward, under DeepSpeed without its own scaling for gradient
        accumulation: TRL's loss is already divided by the accumulation steps) and TRL's step count and `step_time`.
        """
        started = time.perf_counter()
        model = self.model_wrapped
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        loss = self.compute_agent_loss(model, inputs)
        del inputs
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            clear_device_cache()
        kwargs = {}
        if self.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
            kwargs["learning_rate"] = self._get_learning_rate()
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            kwargs["scale_wrt_gas"] = False
        self.accelerator.backward(loss, **kwargs)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss.detach()

    # ----- loss -----

    def _compute_loss(self, model, inputs):
        return self.compute_agent_loss(model, inputs)

    def compute_agent_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """The loss of one micro-batch; TRL's GRPO policy loss unless a subclass adds to it or replaces it."""
        return self.policy_loss(model, inputs)

    def policy_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's clipped policy loss (with its KL term and metrics) on one micro-batch.

        TRL's loss calls its `model` argument for the log-probabilities, so the model goes in as this agent's
        log-probability forward (`logprob_forward`, with the inputs TRL's loss passes on from the micro-batch).
        On-policy vLLM generation (`ratio_from_loss_forward`): that forward also sets the micro-batch's
        importance-sampling ratio from its own log-probabilities (`_RatioFromForward`), in this loss's copy of
        `inputs`, before TRL's loss reads it."""
        loss_kwargs = {"compute_aux_loss": self.aux_loss_enabled} | {key: inputs.get(key) for key in LOSS_MODEL_INPUTS}
        forward = self.logprob_forward(model, inputs["prompt_ids"].size(1), loss_kwargs)
        if self.ratio_from_loss_forward and "importance_sampling_ratio" not in inputs:
            inputs = dict(inputs)  # the ratio is added for this loss only
            forward = _RatioFromForward(forward, self, inputs)
        return GRPOTrainer._compute_loss(self, forward, inputs)

    def logprob_forward(self, model, prompt_length: int, kwargs: dict[str, Any]) -> AgentLogProbForward:
        """The model TRL's log-probability forward calls for this agent (`adapters/logprob_forward.py`): `model` with
        the training-side kernels for the length of each of its calls, on this agent's model only: shared prompts
        (`_shares_prompts`; `prompt_length`: the rows' prompt columns) and, on a CPU, the completions-only head with
        the in-place backward. `kwargs`: the rest of the arguments of TRL's log-probability forward."""
        shared = prompt_length if self._shares_prompts(model, kwargs) else None
        return AgentLogProbForward(model, prompt_length=shared)

    def _shares_prompts(self, model, kwargs: dict[str, Any]) -> bool:
        """Whether the log-probability forward runs each distinct prompt of a chunk once (`adapters/shared_prompt.py`):
        text only, and one process without DeepSpeed or FSDP, whose wrappers are left as TRL calls them."""
        inputs = {key: value for key, value in kwargs.items() if key not in ("batch_size", "compute_entropy")}
        return (
            all(value is None or value is False for value in inputs.values())
            and self.accelerator.num_processes == 1
            and not self.is_deepspeed_enabled
            and not self.is_fsdp_enabled
            and shares_prompts(model)
        )

    def _sampling_correction(self, trainer_logps: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's importance-sampling ratio of a micro-batch from the trainer's log-probabilities, with its metrics."""
        sampling_logps, mask = inputs["sampling_per_token_logps"], inputs["completion_mask"]
        ratio = importance_sampling_ratio(
            trainer_logps,
            sampling_logps,
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        # TRL's sampling metrics: how far the engine's log-probabilities are from the trainer's, and the ratios.
        valid = mask.bool() & ~torch.isnan(sampling_logps)
        gap = logp_differences(trainer_logps, sampling_logps, mask).abs()[valid]
        per_sequence = self.vllm_importance_sampling_mode.startswith("sequence")
        ratios = ratio.flatten() if per_sequence else ratio[mask.bool()]
        stats = (
            ("sampling/sampling_logp_difference/mean", gap, torch.mean),
            ("sampling/sampling_logp_difference/max", gap, torch.max),
            ("sampling/importance_sampling_ratio/min", ratios, torch.min),
            ("sampling/importance_sampling_ratio/mean", ratios, torch.mean),
            ("sampling/importance_sampling_ratio/max", ratios, torch.max),
        )
        mode = "train" if self.model.training else "eval"
        for name, values, reduce in stats:
            local = reduce(values) if values.numel() else values.new_zeros(())
            self._metrics[mode][name].append(reduce(self.accelerator.gather(local.float())).item())
        return ratio

    def metrics(self, mode: str = "train") -> dict[str, list[float]]:
        """TRL's metric lists of this agent (`mode`: "train" or "eval"), which `log` averages and clears."""
        return self._metrics[mode]

    # ----- optimisation (the team's loop drives it; an agent never runs its own `train()`) -----

    def prepare_for_training(self, max_steps: int, resume_from: str | None) -> None:
        """Wrap the model, create the optimiser and scheduler (restored from `resume_from` when given)."""
        self._prepare_for_training(max_steps, None, resume_from)

    def optimizer_step(self) -> float | None:
        """Clip the gradients (`max_grad_norm`), step the optimiser and scheduler, zero the gradients.

        Returns the gradient norm before clipping (None when not clipped, or when DeepSpeed computed none).
        """
        grad_norm = None
        if self.args.max_grad_norm > 0:
            norm = self._clip_grad_norm(self.model_wrapped)
            grad_norm = float(norm) if norm is not None else None
        self.last_learning_rate = self._get_learning_rate()  # the rate of this update, as transformers logs it
        self.optimizer.step()
        if not self.accelerator.optimizer_step_was_skipped:
            self.lr_scheduler.step()
        self.model_wrapped.zero_grad()
        return grad_norm

    def reset_training_state(self) -> None:
        """Forget the previous `train()`: optimiser, scheduler, wrapped model, buffered rollout, train metrics.

        The Accelerator releases the previous model wrapper, optimiser and DeepSpeed engine (Trainer frees only the
        team agent's, when its loop starts, and leaves the engine's hooks alive), and the wrapper is dropped so that
        the next preparation wraps the model again: a destroyed engine left in `model_wrapped` would be reused.
        """
        release_accelerator(self.accelerator)
        self.model_wrapped = self.model
        if self.is_deepspeed_enabled:
            self.deepspeed = None
        self.optimizer, self.lr_scheduler = None, None
        self._step, self._buffered_inputs = 0, None
        self._metrics["train"].clear()

    # ----- checkpoint files -----

    def save_optimizer_state(self, output_dir: str) -> None:
        """Write the optimiser and scheduler state (DeepSpeed: the engine's checkpoint) into `output_dir`."""
        Trainer._save_optimizer_and_scheduler(self, output_dir)

    def save_scaler(self, output_dir: str) -> None:
        Trainer._save_scaler(self, output_dir)

    def load_weights(self, checkpoint: str) -> None:
        """Load the agent's weights (full or adapter) from a checkpoint's agent directory."""
        Trainer._load_from_checkpoint(self, checkpoint)

    def _build_accelerator_args(self, **kwargs):
        return accelerator_args_reusing_deepspeed(super()._build_accelerator_args(**kwargs))

    def create_accelerator_and_postprocess(self) -> None:
        """transformers' Accelerator of this agent; with `fp16` on a CPU, with fp16 autocast and its own loss scaler
        (`precision.enable_cpu_fp16`), which Accelerate creates on GPUs only. Each agent's Accelerator owns its scaler."""
        super().create_accelerator_and_postprocess()
        enable_cpu_fp16(self.accelerator)


class _RatioFromForward:
    """The log-probability forward of `policy_loss` under on-policy vLLM generation: `forward`, which also sets the
    micro-batch's importance-sampling ratio (`inputs`) from the log-probabilities of its calls, once every row of the
    micro-batch has been scored (TRL's forward calls it once per chunk of rows, in order)."""

    def __init__(self, forward: AgentLogProbForward, agent: AgentGRPOTrainer, inputs: dict[str, Any]):
        self.forward, self.agent, self.inputs = forward, agent, inputs
        self._logps: list[torch.Tensor] = []

    def __call__(self, **kwargs: Any) -> Any:
        out = self.forward(**kwargs)
        completion_ids = self.inputs["completion_ids"]
        self._logps.append(out.log_probs[:, -completion_ids.size(1) :].detach())
        if sum(len(logps) for logps in self._logps) == len(completion_ids):
            logps = torch.cat(self._logps)
            self.inputs["importance_sampling_ratio"] = self.agent._sampling_correction(logps, self.inputs)
        return out


class _TeamEngineSync:
    """What TRL's `_generate` calls as `vllm_generation.sync_weights()` when an agent's weights changed."""

    def __init__(self, engines, agent: AgentGRPOTrainer):
        self.engines = engines
        self.agent = agent

    def sync_weights(self) -> None:
        self.engines.sync(self.agent.agent_index, self.agent.accelerator.unwrap_model(self.agent.model))


def _engine_rollout(prompts: list, trainer: AgentGRPOTrainer) -> dict[str, Any]:
    """TRL's `rollout_func` of an agent that generates with the team's engines: TRL's tokenisation, the engine's
    samples and their log-probabilities."""
    prompt_ids, images, multimodal_fields = trainer._tokenize_prompts(prompts)
    if images is not None or multimodal_fields:
        raise ValueError("use_vllm=True generates from text prompts only; these prompts hold images.")
    completion_ids, logprobs = trainer.vllm_generation.engines.generate(trainer.agent_index, prompt_ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


@contextmanager
def _trl_temperatures(args):
    """Build TRL's `GRPOTrainer` inside so that it samples at `args.temperature` and computes the policy's
    log-probabilities at `args.logprob_temperature` (None: the sampling temperature).

    TRL has one `temperature` for both: its log-probability heads (loss, old and reference log-probabilities) and
    its generation config, which `generation_kwargs` then override. So TRL is given the log-probability temperature
    as `temperature` and the sampling one in `generation_kwargs` (where a `"temperature"` the user put there wins, as
    in TRL). `args` holds the user's values again afterwards; the trainer keeps TRL's (`self.temperature`: the
    log-probabilities', `self.generation_config.temperature`: the sampling one).
    """
    sampling, generation_kwargs = args.temperature, args.generation_kwargs
    logprob = args.logprob_temperature
    if logprob is None or logprob == sampling:
        yield
        return
    args.temperature = logprob
    args.generation_kwargs = {"temperature": sampling, **(generation_kwargs or {})}
    try:
        yield
    finally:
        args.temperature, args.generation_kwargs = sampling, generation_kwargs


@contextmanager
def _head_outside_autocast(model: torch.nn.Module):
    """Keep the LM head in fp32 while generating under autocast, as `cast_lm_head_to_fp32` asks.

    TRL's fp32 head (`cast_lm_head_to_fp32`) casts its input and weight to fp32 and calls `F.linear`, which the
    generation's autocast (this package generates in the training precision; TRL in the weights' dtype) would turn
    back into a bf16/fp16 product: the head's forward runs with autocast off for the block.
    """
    head = model.get_output_embeddings()
    own = "forward" in vars(head)
    forward = head.forward

    def fp32_forward(*args, **kwargs):
        with torch.autocast(device_type=head.weight.device.type, enabled=False):
            return forward(*args, **kwargs)

    head.forward = fp32_forward
    try:
        yield
    finally:
        if own:
            head.forward = forward
        else:
            del head.forward


@contextmanager
def _frozen_weights_cast_once(model: torch.nn.Module, device_type: str):
    """While generating under autocast, let autocast cast frozen weights once instead of at every decoding step.

    Autocast keeps the low-precision copy of a weight for the whole autocast region only when the weight requires
    grad; frozen weights (the base model under LoRA) would be cast again at every token, which makes bf16 generation
    slower than fp32 on a CPU. Generation runs under `no_grad`, so marking them as requiring grad for its duration
    builds no graph; they are frozen again afterwards. Skipped when autocast is off or parameters are sharded.
    """
    frozen = []
    if torch.is_autocast_enabled(device_type) and not zero_sharded(model):
        frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
