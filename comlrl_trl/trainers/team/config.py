"""The team's configuration: the fields every family shares, on TRL's `GRPOConfig`."""

import math
import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from trl import GRPOConfig

from ...agent_overrides import PER_AGENT_FIELDS, check_positive, validate_agent_overrides
from ...checkpoint import check_output_dir
from ...compat import CoMLRLFieldErrors
from ...core.returns import joint_actions_per_item
from ...precision import bf16_is_fast, cpu_bf16_pays_off


# Defaults shared by CoMLRL's documented fields and their TRL twins. Each pair may be set through either name.
_DEFAULT_LEARNING_RATE = 5e-6
_DEFAULT_MAX_NEW_TOKENS = 256
# Task items per device and optimiser update when per_device_train_batch_size is left unset: one, as in TRL and
# CoMLRL. Four items per update were faster per sample but learned less per epoch (docs/benchmarks.md, "Learning").
_DEFAULT_ITEMS_PER_STEP = 1
# Optimiser updates whose task items are sampled in one batched `generate` call when steps_per_generation is left
# unset (fewer where the training set is small). Decoding is bound by per-token overhead, not by the rows: 8 rows
# cost about what 4 do, so generation, two thirds of a one-item update on a CPU, is shared by these updates. The
# second update of a generation trains on samples of slightly older weights, which TRL's clipped importance ratio
# (old log-probabilities from one scoring forward over the second update's rows) corrects. Five updates per
# generation were faster still but learned less per epoch (docs/benchmarks.md, "Learning").
_DEFAULT_MAX_STEPS_PER_GENERATION = 2


@dataclass
class TeamConfig(CoMLRLFieldErrors, GRPOConfig):
    r"""
    The fields every family shares: the team, its rollout, batching and sampling on top of TRL's `GRPOConfig`.
    Users configure a family's class ([`MAGRPOConfig`], [`IACConfig`], [`MARLHFConfig`], ...), which adds its own.

    Every [`~trl.GRPOConfig`] field is accepted with TRL's meaning; only the fields below are new or have a
    different default. Each agent is trained by its own TRL GRPO trainer built from this configuration, so batch,
    optimiser, precision and loss settings apply to every agent.

    Parameters:
        > Parameters that define the team

        num_agents (`int`, *optional*, defaults to `2`):
            Number of cooperating agents. Must match the agents given to the trainer.
        num_turns (`int`, *optional*, defaults to `1`):
            Turns per episode. Turns after the first need an `external_transition`, which turns every joint action
            into the agents' next prompts; the rollout is then a tree (see `max_joint_actions_per_item`).
        joint_mode (`str`, *optional*, defaults to `"align"`):
            How the agents' completions form joint actions. `"align"` pairs the k-th completion of every agent
            (K joint actions per task item); `"cross"` scores the Cartesian product (K^N joint actions), and a
            completion's return is then the mean of the returns of the joint actions it takes part in.

        discount (`float`, *optional*, defaults to `1.0`):
            Gamma in [0, 1]: the return of a joint action is its reward plus gamma times the mean return of its
            child node.
        early_termination_threshold (`float` or `None`, *optional*, defaults to `None`):
            When set, a node whose mean joint reward exceeds it is not expanded into further turns (its joint
            actions are leaves). `None` always expands, so every branch runs `num_turns` turns.
        external_prompt_passthrough (`bool`, *optional*, defaults to `False`):
            Use the transition's prompts verbatim at later turns instead of passing them through the formatters.
        turn_gradient_weights (`list[float]` or `None`, *optional*, defaults to `None`):
            One non-negative weight per turn, scaling that turn's policy-gradient term (default: all 1).
        max_joint_actions_per_item (`int`, *optional*, defaults to `4096`):
            Upper bound on the joint actions one task item may need (J + J^2 + ... + J^T with J = K in `align`
            and K^N in `cross`); a configuration above it is refused, to stop accidental tree explosions.

        > Parameters that control generation (CoMLRL's names)

        max_new_tokens (`int`, *optional*, defaults to `256`):
            Maximum completion length per agent. Same as TRL's `max_completion_length`; set either one.
        num_generations (`int`, *optional*, defaults to `4`):
            Completions per agent per task item (K). Must be at least 2 (the baseline needs a group).
        temperature (`float`, *optional*, defaults to `0.6`):
            Sampling temperature.
        logprob_temperature (`float` or `None`, *optional*, defaults to `None`):
            Temperature of the log-probabilities the policy loss trains (the loss's, the old and the reference
            ones): the logits are divided by it. `None` uses the sampling `temperature`, as TRL's GRPO does: the
            gradient is that of the policy being sampled. `1.0` trains the model's own distribution on samples drawn
            at `temperature`, as CoMLRL does. Measured (docs/benchmarks.md, "Learning"): on the fully fine-tuned
            tutorial `1.0` learned a little more (ten seeds: 0.615 against 0.578, ahead on eight, 1.3 standard
            errors), on the LoRA demo much less (evaluation 0.57 and 0.54 against 0.79 and 0.79, two seeds), so the
            default stays TRL's. TRL expresses it too: its `temperature` set to this value, the sampling temperature
            in `generation_kwargs`.
        top_p (`float`, *optional*, defaults to `0.6`):
            Nucleus sampling: sample among the most likely tokens that hold this much probability.
        top_k (`int` or `None`, *optional*, defaults to `50`):
            Top-k filtering; `None` or `0` disables it. Sampling defaults are CoMLRL's (0.6, 0.6, 50), not TRL's
            (1.0, 1.0, off): with TRL's, the agents of the length-ratio tutorial learned less per update.
        max_prompt_length (`int` or `None`, *optional*, defaults to `2048`):
            Prompts longer than this many tokens are truncated from the left (the end is kept), with a warning, as
            in TRL's trainers that have this option. `None`: no limit. The default is above TRL's former 512
            because multi-turn revision prompts (problem, both agents' code, test feedback) of the coding tasks
            reach about 1,000 tokens, and cutting from the left would drop the problem statement.

        vllm_lora_mode (`str`, *optional*, defaults to `"adapter"`):
            With `use_vllm=True` (TRL's field; generation through the team's vLLM engine, one per process, see
            docs/vllm.md), how LoRA agents on one base model generate: `"adapter"`, each agent's adapter passed per
            request (the base loaded once); `"merged"`, each agent's weights with its adapter merged loaded into the
            engine before it generates (faster where vLLM's LoRA kernels are slow, e.g. CPUs without AMX). With TRL's
            `vllm_mode="server"` and `vllm_server_base_url`, LoRA agents on one base model generate through a
            running vLLM server instead, which loads each agent's adapter after each of its steps (docs/vllm.md).
        vllm_importance_sampling_correction (`bool` or `None`, *optional*, defaults to `None`):
            With `use_vllm=True`: TRL's correction, which weights each sample by the trainer's over the engine's
            probability. vLLM reports probabilities after top-p/top-k/min-p truncation and the trainer does not, so
            under truncated sampling (the default `top_p=0.6`, `top_k=50`) the ratio is far below 1 for nearly every
            sequence, and TRL's default `sequence_mask` would leave them out of the loss. `None` turns it on only
            where sampling does not truncate; `True` with truncated sampling raises a `ValueError`.
        vllm_server_request_timeout (`float`, *optional*, defaults to `600.0`):
            With `vllm_mode="server"`: seconds to wait for the server's answer to any one request (a sample, an
            adapter load) before raising. The server's API key comes from the `VLLM_API_KEY` environment variable.

        > Parameters that control the update

        agent_learning_rate (`float`, *optional*, defaults to `5e-6`):
            Learning rate of every agent's optimiser. Same as `learning_rate`; set either one.
        advantage_mode (`str`, *optional*, defaults to `"mean"`):
            Baseline subtracted from each completion's return within its group: `"mean"` (MAGRPO), `"raw"` (no
            baseline, MAREINFORCE), `"max"` (MAReMax) or `"rloo"` (leave-one-out mean, MARLOO).
        advantage_normalization (`bool` or `None`, *optional*, defaults to `None`):
            Whether advantages are centred and divided by the group standard deviation. Same as TRL's
            `scale_rewards` (`True` is `"group"`, `False` is `"none"`); `None` follows `scale_rewards`. With
            normalisation on, all four baselines give the same advantages.
        per_device_train_batch_size (`int` or `None`, *optional*, defaults to `None`):
            Completions per agent per device and micro-step, as in TRL. `None` means `num_generations`: one task
            item per device per optimiser update, as in TRL and CoMLRL.
        steps_per_generation (`int` or `None`, *optional*, defaults to `None`):
            Micro-steps whose completions are sampled in one `generate` call, as in TRL. `None` samples the task
            items of up to 2 optimiser updates at once (`2 * gradient_accumulation_steps`), fewer where that would
            leave items of a small training set out of an epoch or not divide `eval_interval`. The later updates of
            a generation are slightly off-policy; TRL's clipped importance ratio corrects them. `1` (with
            `gradient_accumulation_steps=1`) samples for every update, on-policy.

        agent_overrides (`list[dict]` or `None`, *optional*, defaults to `None`):
            One dict per agent of per-agent settings that replace this configuration's values for that agent only
            (`{}` keeps them): `learning_rate`/`agent_learning_rate`, `lr_scheduler_type`, `lr_scheduler_kwargs`,
            `warmup_steps`, `weight_decay`, `adam_beta1`, `adam_beta2`, `adam_epsilon`, `temperature`, `top_p`,
            `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`/`max_completion_length` and
            `generation_kwargs`. Team settings (`num_generations`, `joint_mode`, `num_turns`, batch sizes, ...) are
            refused. A JSON string is accepted on the command line.

        keep_freed_cpu_memory (`bool`, *optional*, defaults to `False`):
            On a CPU, make the C library (glibc) keep the memory that tensors free for reuse instead of returning it
            to the kernel, so that the gradients and buffers reallocated at every update do not page-fault their
            memory in again (`comlrl_trl.fast.memory.keep_freed_cpu_memory`: 7-11% less CPU time for the short
            SmolLM2-135M full fine-tuning epochs of `benchmarks/bench.py` on an idle machine, 18% on a busy one, none
            measurable for the tutorial's 3 fully fine-tuned epochs of 48 new tokens; the same peak memory there,
            about 90 MB more on tiny models). What it changes is process-wide and never undone: glibc's `mallopt`
            settings (no `mmap` for large allocations, no trimming of the heap, 256 MB heap growth) for every library
            and thread of the process, from the first trainer built with it to the process's end. `False` (the
            default) leaves malloc as it is.
        cpu_fp16_generation_weights (`bool`, *optional*, defaults to `False`):
            When an agent generates in fp32 on a CPU (no bf16 units there, or `bf16=False`), round each linear
            layer's weight to fp16 once per `generate` call and multiply with fbgemm's fp16-weight kernel (fp32
            activations and sums; `comlrl_trl/fast/packed_linear.py`). Decoding reads the weights at every
            token, and fp32 products of a few rows read them slowly: SmolLM2-135M generated 48 tokens with 31%
            less CPU time on an AVX2 CPU, packing included. Trainable weights are packed only for calls of at least
            32 new tokens (packing costs what about 20 decoding steps save); frozen ones (a LoRA base) once, kept
            in memory as an fp16 copy. It changes the policy that samples: completions are drawn from weights a
            rounding of at most 2**-11 away from the trained ones (bf16 runs round to 2**-8), so an fp32 run no
            longer samples from the policy it trains (the loss, the old log-probabilities and evaluation scores are
            computed from the fp32 weights). No learning measurement shows that this costs nothing, hence off by
            default. Layers with fewer than 256 inputs stay fp32. `False` (the default): generation in fp32, token
            for token transformers' own.
        joint_generation (`bool`, *optional*, defaults to `True`):
            On a CPU, sample every agent's completions in one decoding loop instead of one `generate` call per agent
            (`comlrl_trl/fast/joint_decoding.py`): each row goes through its own agent's weights, and what the
            agents share (a LoRA team's frozen base model, attention, sampling) runs once for all rows. Decoding a
            few rows on a CPU costs nearly as much as decoding twice as many. The samples follow the same
            distributions, but are not the tokens separate calls draw (one draw per step covers every agent). Applies
            to Llama and Qwen2 teams of one architecture that sample with the same settings; elsewhere, and with
            `False`, every agent generates in its own call.
        generation_backend (`str`, *optional*, defaults to `"auto"`):
            How completions are sampled (`comlrl_trl/generation/team_generator.py`). `"transformers"`: each agent's
            own TRL generation (transformers' `generate`), with nothing but the training precision around it.
            `"cpu"`: the lean CPU generator (`comlrl_trl/fast/`): the speed-ups above and `joint_generation`, each
            keeping transformers' tokens; an error where the agents do not generate on a CPU. `"auto"`: the lean
            CPU generator on a CPU, else `"transformers"`. With the team's vLLM engines (`use_vllm`) the agents
            sample through them whatever this says.

        > Parameters that control evaluation and logging

        logging_steps (`int`, *optional*, defaults to `10`):
            Log the training metrics every `logging_steps` optimiser updates (`global_step`), as in TRL; the first
            update always logs too, so that a short run still reports its rewards. Each log line also gives
            `env_step` (joint-action reward evaluations so far).
        eval_interval (`int`, *optional*, defaults to `16`):
            Evaluate before task item 0 of every epoch and then every `eval_interval` training task items;
            `0` evaluates only when `evaluate()` is called.
        eval_num_samples (`int`, *optional*, defaults to `4`):
            Number of evaluation task items, taken from the start of the evaluation split.
        eval_batch_size (`int`, *optional*, defaults to `1`):
            Batch size of the evaluation data loader (not the number of responses: evaluation samples one response
            per agent per item).
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            Let a new run write into an `output_dir` that holds the results of an earlier run (`team_settings.json`,
            `models/`, `metrics.json`), replacing them. Without it such a run is refused when `train()` starts;
            resuming a run (`resume_from_checkpoint`) may always write into its own `output_dir`. A live run in
            another process always holds its `output_dir` (`.comlrl_trl.lock`), whatever this says.

    Defaults that differ from [`~trl.GRPOConfig`]: `num_generations=4`, `learning_rate=5e-6`,
    `lr_scheduler_type="constant"` (TRL's linear decay to 0 learned less per epoch), `temperature=0.6`, `top_p=0.6`,
    `top_k=50`,
    `max_completion_length=256`, `shuffle_dataset=False` (the task order is kept; shuffle the dataset yourself or
    set `shuffle_dataset=True` for per-epoch shuffling), `save_strategy="no"`, `logging_nan_inf_filter=False` (a
    non-finite loss is an error, never silently replaced), `steps_per_generation` (up to two updates' items
    sampled at once), `bf16`, which is on only where the device runs bf16 matrix products natively (GPUs with bf16, CPUs with
    AMX or AVX512-BF16; generation then runs under bf16 autocast too), and `gradient_checkpointing`, off on the
    CPU (where it only costs time) and TRL's `True` elsewhere. On a CPU-only machine `use_cpu` is turned on (so
    that `torchrun` starts a real multi-process CPU group).
    """

    num_agents: int = field(default=2, metadata={"help": "Number of cooperating agents."})
    num_turns: int = field(default=1, metadata={"help": "Turns per episode."})
    joint_mode: Literal["align", "cross"] = field(
        default="align",
        metadata={"help": "Joint actions: 'align' (k-th with k-th, K per item) or 'cross' (all K^N combinations)."},
    )
    discount: float = field(default=1.0, metadata={"help": "Gamma in [0, 1] for multi-turn returns."})
    early_termination_threshold: float | None = field(
        default=None, metadata={"help": "Do not expand a node whose mean reward exceeds this; None: always expand."}
    )
    external_prompt_passthrough: bool = field(
        default=False, metadata={"help": "Use the transition's prompts verbatim at later turns."}
    )
    turn_gradient_weights: list[float] | None = field(
        default=None, metadata={"help": "One non-negative weight per turn scaling its loss; None: all 1."}
    )
    max_joint_actions_per_item: int = field(
        default=4096, metadata={"help": "Refuse configurations whose rollout tree needs more joint actions per item."}
    )
    advantage_mode: Literal["mean", "raw", "max", "rloo"] = field(
        default="mean", metadata={"help": "Group baseline: 'mean', 'raw', 'max' or 'rloo'."}
    )
    advantage_normalization: bool | None = field(
        default=None,
        metadata={"help": "Divide advantages by the group std. None follows `scale_rewards` (default 'group')."},
    )
    agent_learning_rate: float | None = field(
        default=None,
        metadata={"help": f"Agents' learning rate (alias of learning_rate, default {_DEFAULT_LEARNING_RATE})."},
    )
    max_new_tokens: int | None = field(
        default=None,
        metadata={
            "help": f"Max completion tokens (alias of max_completion_length, default {_DEFAULT_MAX_NEW_TOKENS})."
        },
    )
    agent_overrides: list[dict[str, Any]] | str | None = field(
        default=None,
        metadata={
            "help": "One dict of per-agent settings per agent (learning_rate, lr_scheduler_type, weight_decay, "
            "temperature, top_p, top_k, max_new_tokens, generation_kwargs, ...); a JSON list here."
        },
    )
    vllm_lora_mode: Literal["adapter", "merged"] = field(
        default="adapter",
        metadata={
            "help": "use_vllm with LoRA agents: an adapter per agent, or each agent's merged weights loaded in turn."
        },
    )
    vllm_server_request_timeout: float = field(
        default=600.0,
        metadata={"help": "vllm_mode='server': seconds to wait for any one answer of the server before raising."},
    )
    keep_freed_cpu_memory: bool = field(
        default=False,
        metadata={
            "help": "On a CPU, keep freed memory in the process for reuse (7-11%% less CPU time on short SmolLM2 "
            "epochs): sets glibc's mallopt for the whole process, never undone. Default False: malloc left as it is."
        },
    )
    cpu_fp16_generation_weights: bool = field(
        default=False,
        metadata={
            "help": "fp32 generation on a CPU: sample with fp16-rounded weights (31%% faster decoding), which changes "
            "the sampling policy; no learning measurement shows it costs nothing. Default False: exact fp32."
        },
    )
    joint_generation: bool = field(
        default=True,
        metadata={
            "help": "On a CPU, decode every agent's rows in one loop (each with its own weights); False: one call each."
        },
    )
    generation_backend: Literal["auto", "transformers", "cpu"] = field(
        default="auto",
        metadata={
            "help": "How completions are sampled: 'cpu' (lean CPU generator), 'transformers' (each agent's generate), "
            "'auto' (cpu on a CPU)."
        },
    )
    eval_interval: int = field(
        default=16, metadata={"help": "Evaluate every this many training task items (and before item 0); 0: manual."}
    )
    eval_num_samples: int = field(default=4, metadata={"help": "Number of evaluation task items."})
    eval_batch_size: int = field(default=1, metadata={"help": "Batch size of the evaluation data loader."})

    # TRL fields whose default changes here.
    learning_rate: float | None = field(
        default=None,
        metadata={"help": f"Agents' learning rate (alias of agent_learning_rate, default {_DEFAULT_LEARNING_RATE})."},
    )
    max_completion_length: int | None = field(
        default=None,
        metadata={"help": f"Max completion tokens (alias of max_new_tokens, default {_DEFAULT_MAX_NEW_TOKENS})."},
    )
    num_generations: int | None = field(default=4, metadata={"help": "Completions per agent per task item (K)."})
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per agent per device and micro-step; None: num_generations (one item per update)."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Recompute activations in the backward pass; None: off on CPU, on elsewhere."}
    )
    # A constant learning rate (CoMLRL's plain AdamW), not TRL's linear decay to 0: on the tutorial, evaluated alike,
    # the agents reached 0.72 against 0.57 after 3 epochs with it (docs/benchmarks.md, "Learning").
    lr_scheduler_type: str = field(
        default="constant", metadata={"help": "LR schedule (transformers' SchedulerType); TRL's default is linear."}
    )
    # Sampling: CoMLRL's values. At TRL's temperature 1.0 (no top-p or top-k) the agents learned less per update
    # on the tutorial, evaluated alike (docs/benchmarks.md, "Learning").
    temperature: float = field(default=0.6, metadata={"help": "Sampling temperature."})
    # TRL's log-probabilities (at the sampling temperature). CoMLRL's, at temperature 1, learned more on the fully
    # fine-tuned tutorial and much less on the LoRA demo (docs/benchmarks.md, "Learning").
    logprob_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Temperature of the policy's log-probabilities in the loss; None: the sampling temperature (TRL)."
        },
    )
    top_p: float = field(default=0.6, metadata={"help": "Nucleus sampling: keep the top tokens of this mass."})
    top_k: int | None = field(default=50, metadata={"help": "Top-k filtering; None or 0 disables it."})
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "With use_vllm: weight each sample by trainer/engine probability (TRL's correction). None: on "
            "where sampling does not truncate (top_p=1, top_k=0, no min_p); True with truncated sampling is refused."
        },
    )
    max_prompt_length: int | None = field(
        default=2048, metadata={"help": "Truncate longer prompts from the left (with a warning); None: no limit."}
    )
    shuffle_dataset: bool | None = field(default=False, metadata={"help": "Reshuffle the task items every epoch."})
    save_strategy: str = field(default="no", metadata={"help": "TRL checkpoint strategy."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Let a new run replace the results of an earlier run in output_dir (refused otherwise)."},
    )
    logging_nan_inf_filter: bool = field(
        default=False, metadata={"help": "Kept False: a non-finite loss raises instead of being hidden."}
    )

    def __post_init__(self):
        self.learning_rate = _merge_alias(
            "agent_learning_rate",
            self.agent_learning_rate,
            "learning_rate",
            self.learning_rate,
            _DEFAULT_LEARNING_RATE,
        )
        self.agent_learning_rate = self.learning_rate
        self.max_completion_length = _merge_alias(
            "max_new_tokens",
            self.max_new_tokens,
            "max_completion_length",
            self.max_completion_length,
            _DEFAULT_MAX_NEW_TOKENS,
        )
        self.max_new_tokens = self.max_completion_length
        self.advantage_normalization, self.scale_rewards = _merge_normalization(
            self.advantage_normalization, self.scale_rewards
        )
        if self.top_k is None:
            self.top_k = 0
        self._check_num_generations()
        if self.per_device_train_batch_size is None:
            self.per_device_train_batch_size = self._default_batch_size()
        # Whether steps_per_generation follows the training set (`fit_generation_to_dataset`): the default does.
        self.generation_from_default = (
            self._default_generation_spans_updates
            and self.steps_per_generation is None
            and self.generation_batch_size is None
        )
        if self.generation_from_default:
            self.steps_per_generation = self.gradient_accumulation_steps * _DEFAULT_MAX_STEPS_PER_GENERATION
        if not self.use_cpu and not torch.accelerator.is_available():
            warn_if_cuda_expected()
            # Without an accelerator, Accelerate only forms a multi-process CPU group (gloo) when told it runs on
            # the CPU; otherwise every torchrun rank would silently train alone on the full data.
            self.use_cpu = True
        # Whether bf16 follows the device and the models (`fit_precision_to_models`): the default does, a set value not.
        self.bf16_from_default = self.bf16 is None
        if self.bf16 is None:
            # TRL turns bf16 on everywhere; here it is on where the device has fast bf16 matrix products.
            self.bf16 = not self.fp16 and bf16_is_fast(self.use_cpu)
        # transformers >= 5.18 calls it `activation_checkpointing` (`gradient_checkpointing` then mirrors it); older
        # releases (e.g. 5.17, which vLLM's CPU build needs) have only `gradient_checkpointing`.
        current_name = (
            "activation_checkpointing" if hasattr(self, "activation_checkpointing") else "gradient_checkpointing"
        )
        if self.gradient_checkpointing is None and getattr(self, current_name) is None:
            # It trades compute for activation memory: on a CPU (plenty of memory, scarce compute) it only costs time.
            setattr(self, current_name, not self.use_cpu)
        self._validate_multi_agent_fields()
        self._check_unset_correction_clips()
        self.agent_overrides = validate_agent_overrides(self)
        self._grpo_post_init()

    def _grpo_post_init(self):
        super().__post_init__()  # TRL's own checks and batch arithmetic

    def _check_unset_correction_clips(self):
        # TRL refuses a *_truncate mode without bounds when the correction is on; unset (None) it may resolve to on
        # for an agent (untruncated sampling), which TRL's own check, seeing None, would let through.
        if (
            self.vllm_importance_sampling_correction is None
            and self.vllm_importance_sampling_mode in ("token_truncate", "sequence_truncate")
            and self.vllm_importance_sampling_clip_min is None
            and self.vllm_importance_sampling_clip_max is None
        ):
            raise ValueError(
                "At least one of vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max must be set "
                f"when vllm_importance_sampling_mode is {self.vllm_importance_sampling_mode!r} (the correction may "
                "be on: vllm_importance_sampling_correction is unset); or set vllm_importance_sampling_correction="
                "False."
            )

    def _check_num_generations(self):
        if self.num_generations is None or self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (the group baseline needs several samples), got {self.num_generations}."
            )

    # Whether an unset steps_per_generation samples several updates' task items at once (fitted to the training set).
    _default_generation_spans_updates = True

    def _default_batch_size(self) -> int:
        return self.num_generations * _DEFAULT_ITEMS_PER_STEP

    def fit_precision_to_models(self, models) -> None:
        """Turn bf16 off again on a CPU when it was left to its default and a model is too small to gain from it.

        Trainers call this with their models (ids, paths or model objects) before any of their trainers exists; the
        first call decides, so that every trainer of a run (agents, critics, reward models) shares one precision.
        """
        if self.bf16 and self.bf16_from_default and self.use_cpu and not cpu_bf16_pays_off(models):
            self.bf16 = False
            self.mixed_precision = "no"  # TrainingArguments derived it from bf16 when it was built
        self.bf16_from_default = False

    def fit_generation_to_dataset(self, num_items: int, evaluates: bool = False) -> None:
        """With the default steps_per_generation, sample fewer updates' items at once where the default would change
        what an epoch does.

        TRL samples `generation_batch_size` rows at a time and drops an epoch's last incomplete generation batch.
        Generating for one optimiser update at a time (TRL's default, `steps_per_generation =
        gradient_accumulation_steps`) leaves out the fewest items; the default generates for the largest number of
        updates, at most `_DEFAULT_MAX_STEPS_PER_GENERATION`, that leaves out no more than that (10 items of one item
        per update: 2 updates per generation, 7 items: 1) and, when the trainer `evaluates`
        periodically, divides `eval_interval`, so that evaluations still come every `eval_interval` items (they run
        between generations).
        """
        if not self.generation_from_default:
            return
        rows_per_update = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
        if rows_per_update % self.num_generations:
            # Several updates per generation would split a group of completions; generate for each update.
            updates = 1
        else:
            items_per_update = rows_per_update // self.num_generations

            def kept(updates: int) -> int:
                per_generation = items_per_update * updates
                return num_items // per_generation * per_generation

            def fits(updates: int) -> bool:
                return kept(updates) == kept(1) and not (
                    evaluates and self.eval_interval > 0 and self.eval_interval % (items_per_update * updates)
                )

            updates = next((u for u in range(_DEFAULT_MAX_STEPS_PER_GENERATION, 1, -1) if fits(u)), 1)
        self.steps_per_generation = self.gradient_accumulation_steps * updates
        self.generation_batch_size = self.per_device_train_batch_size * self.world_size * self.steps_per_generation

    def _check_ranges(self):
        """Numeric fields out of range fail here, naming the field, not later inside torch or the sampler."""
        for name, check in _RANGE_CHECKS.items():
            value = getattr(self, name, None)
            if (problem := check(value)) is not None:
                alias, default = _RANGE_ALIASES.get(name, (None, self.__dataclass_fields__[name].default))
                raise ValueError(
                    f"{name}{f' ({alias})' if alias else ''} must be {problem}, got {value!r}; set it in range, or "
                    f"leave it unset for the default ({default!r})."
                )

    def _validate_multi_agent_fields(self):
        self._check_ranges()
        if self.max_prompt_length is not None and (
            isinstance(self.max_prompt_length, bool)
            or not isinstance(self.max_prompt_length, int)
            or self.max_prompt_length < 1
        ):
            raise ValueError(
                f"max_prompt_length must be a positive integer or None (no limit), got {self.max_prompt_length!r}."
            )
        if self.vllm_lora_mode not in ("adapter", "merged"):
            raise ValueError(f"vllm_lora_mode must be 'adapter' or 'merged', got {self.vllm_lora_mode!r}.")
        if self.vllm_server_request_timeout <= 0:
            raise ValueError(
                f"vllm_server_request_timeout must be > 0 seconds, got {self.vllm_server_request_timeout}."
            )
        for name in ("num_agents", "num_turns", "eval_batch_size", "eval_num_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if isinstance(self.eval_interval, bool) or not isinstance(self.eval_interval, int) or self.eval_interval < 0:
            raise ValueError(
                f"eval_interval must be an integer >= 0 (0: manual evaluation only), got {self.eval_interval!r}."
            )
        if not self.beta >= 0:
            raise ValueError(
                f"beta is the KL coefficient and must be >= 0 (0: no reference model), got {self.beta!r}."
            )
        if self.logprob_temperature is not None and (problem := check_positive(self.logprob_temperature)):
            raise ValueError(
                f"logprob_temperature must be {problem} (1.0: the model's own distribution, as CoMLRL) or None (the "
                f"sampling temperature, as TRL's GRPO), got {self.logprob_temperature!r}."
            )
        if self.logging_steps < 1:
            raise ValueError(f"logging_steps counts optimiser updates and must be >= 1, got {self.logging_steps!r}.")
        check_output_dir(self.output_dir)
        _check_choice("joint_mode", self.joint_mode, ("align", "cross"))
        _check_choice("generation_backend", self.generation_backend, ("auto", "transformers", "cpu"))
        _check_choice("advantage_mode", self.advantage_mode, ("mean", "raw", "max", "rloo"))
        self._validate_turns()
        if self.eval_strategy not in ("no", None) and str(self.eval_strategy) != "IntervalStrategy.NO":
            raise ValueError(
                f"eval_strategy={self.eval_strategy!r} is not used by multi-agent trainers: evaluation follows "
                "eval_interval (task items). Leave eval_strategy='no' and set eval_interval instead."
            )

    def _validate_turns(self):
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}.")
        threshold = self.early_termination_threshold
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold)
        ):
            raise ValueError(
                f"early_termination_threshold must be a finite number or None (always expand), got {threshold!r}."
            )
        if self.turn_gradient_weights is not None:
            weights = list(self.turn_gradient_weights)
            if len(weights) != self.num_turns or not all(math.isfinite(w) and w >= 0 for w in weights):
                raise ValueError(
                    f"turn_gradient_weights must hold num_turns={self.num_turns} finite non-negative weights, got "
                    f"{weights if len(weights) <= 16 else f'{len(weights)} values'}."
                )
            self.turn_gradient_weights = [float(w) for w in weights]
        per_node = self.num_generations if self.joint_mode == "align" else self.num_generations**self.num_agents
        needed = joint_actions_per_item(per_node, self.num_turns, cap=self.max_joint_actions_per_item)
        if needed > self.max_joint_actions_per_item:
            raise ValueError(
                f"One task item would need more than {self.max_joint_actions_per_item} joint actions "
                f"(J + J^2 + ... + J^T with J={per_node} joint "
                f"actions per node in {self.joint_mode!r} mode and T={self.num_turns} turns), the "
                f"max_joint_actions_per_item. Use fewer turns or generations, "
                "joint_mode='align', early termination, or raise max_joint_actions_per_item deliberately."
            )


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The fields set through a CoMLRL alias: the alias and the default.
_RANGE_ALIASES = {
    "learning_rate": ("agent_learning_rate", _DEFAULT_LEARNING_RATE),
    "max_completion_length": ("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS),
}
# Numeric fields -> a check returning what the value must be (None when it is fine). The sampling and optimiser ones
# are the per-agent checks of `agent_overrides` (a learning rate of 0 freezes the agents).
_RANGE_CHECKS = {
    **{
        name: PER_AGENT_FIELDS[name]
        for name in (
            "learning_rate",
            "warmup_steps",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_epsilon",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "max_completion_length",
        )
    },
    "num_train_epochs": lambda v: None if _finite(v) and v > 0 else "a number > 0",
    "max_grad_norm": lambda v: None if v is None or (_finite(v) and v >= 0) else "a number >= 0 (0: no clipping)",
    "epsilon": lambda v: None if _finite(v) and v > 0 else "a number > 0 (the clip range of the ratio)",
    "epsilon_high": lambda v: None if v is None or (_finite(v) and v > 0) else "None or a number > 0",
    "gradient_accumulation_steps": lambda v: None if _integer(v) and v >= 1 else "an integer >= 1",
    "num_iterations": lambda v: None if _integer(v) and v >= 1 else "an integer >= 1",
    "per_device_train_batch_size": lambda v: None if _integer(v) and v >= 1 else "an integer >= 1",
    "steps_per_generation": lambda v: None if v is None or (_integer(v) and v >= 1) else "None or an integer >= 1",
}


def post_init_with_one_generation(config, post_init) -> None:
    """Run TRL's GRPOConfig checks for a configuration with `num_generations=1` (critic-based trainers).

    GRPOConfig insists on 2+ generations for its group baseline. Its batch arithmetic is homogeneous in the group
    size, so run `post_init` with doubled sizes and halve them back.
    """
    config.num_generations, config.per_device_train_batch_size = 2, config.per_device_train_batch_size * 2
    if config.generation_batch_size is not None:
        config.generation_batch_size *= 2
    try:
        post_init()
    finally:
        config.num_generations, config.per_device_train_batch_size = 1, config.per_device_train_batch_size // 2
        if config.generation_batch_size is not None:
            config.generation_batch_size //= 2


def _merge_alias(comlrl_name, comlrl_value, trl_name, trl_value, default):
    """Resolve a field under CoMLRL's documented name and its TRL twin: either may be set; both set to different
    values is an error."""
    if comlrl_value is not None and trl_value is not None and comlrl_value != trl_value:
        raise ValueError(
            f"{comlrl_name}={comlrl_value!r} and {trl_name}={trl_value!r} set the same thing to different values; "
            f"set only one of them."
        )
    if comlrl_value is not None:
        return comlrl_value
    return trl_value if trl_value is not None else default


def _merge_normalization(advantage_normalization, scale_rewards):
    """`advantage_normalization` is CoMLRL's name for TRL's `scale_rewards` (True: 'group', False: 'none')."""
    scale = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    _check_choice("scale_rewards", scale, ("group", "batch", "none"))
    if advantage_normalization is None:
        return scale != "none", scale
    if advantage_normalization != (scale != "none"):
        if scale == "group":  # TRL's default: CoMLRL's field decides
            return advantage_normalization, "group" if advantage_normalization else "none"
        raise ValueError(
            f"advantage_normalization={advantage_normalization!r} conflicts with scale_rewards={scale_rewards!r}; "
            "set only one of them."
        )
    return advantage_normalization, scale


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}.")


def cuda_expected() -> str | None:
    """Why this machine looks like it has an NVIDIA GPU (`nvidia-smi` on the PATH, `CUDA_VISIBLE_DEVICES` naming a
    device), or None."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible not in (None, "", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r}"
    if shutil.which("nvidia-smi") is not None:
        return "nvidia-smi is installed"
    return None


def warn_if_cuda_expected() -> None:
    """Warn when a GPU seems present but torch cannot use it (a CPU build of torch, typically): training would
    silently run on the CPU."""
    reason = cuda_expected()
    if reason is not None:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        warnings.warn(
            f"{reason}, but torch {torch.__version__} ({build}) sees no GPU, so training runs on the CPU. Install a "
            "CUDA build of torch (README, 'GPU install': make install TORCH=...), or hide the GPU "
            '(CUDA_VISIBLE_DEVICES="") to train on the CPU on purpose.',
            stacklevel=3,
        )
