"""The vLLM engine of a team of agents: sampling with token log-probs, each agent's weights loaded in turn.

Layout: ONE engine per process, what vLLM supports on GPUs (an engine profiles the free GPU memory and sets up
process-wide parallel groups). Agents are grouped by the weights the engine must hold for them (`plan_weights`):

- LoRA agents (peft `PeftModel` with a plain LoRA adapter) whose base models have the same `name_or_path` and equal
  frozen weights form one group: the engine (built with `enable_lora=True`) holds their base, and each agent is
  served by its own `LoRARequest`.
- Every other agent (full fine-tuning, or a peft model that cannot be served as a LoRA adapter: DoRA,
  `modules_to_save`, non-LoRA peft types) is a group of its own, whose merged weights are loaded into the engine
  before the agent generates, when another group's weights are in it or the agent stepped since.

All agents must have the same architecture (`check_one_architecture`). With several processes every process builds
its own engine (vLLM's `external_launcher` backend) and generates its own rows. The engine is built from the model's
config only (`load_format="dummy"`) and receives the in-memory weights through the same path as every later load, so
it always matches the models it was given, whatever checkpoint (or none) they came from.

Weight loads go through the worker's `reload_weights(weights_iterator=...)` (vLLM's layerwise reload). Calling the
vLLM model's `load_weights` directly, as TRL's colocate sync does, fails on the CPU backend with `'Parameter' object
has no attribute 'weight_loader'`: after loading, the CPU backend replaces the layers' parameters by plain tensors
without their loaders, and only the reload path restores them before loading and re-processes the weights after.
The weights travel as tensors, so the engine core must run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set
by default here). A LoRA agent's adapter is written to a temporary directory and loaded under a new LoRA id at every
sync (the agent's previous id is removed first), so vLLM never serves a cached adapter.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..loading import architecture, base_model, is_peft_model


__all__ = [
    "ColocateMemory",
    "TeamVLLM",
    "check_one_architecture",
    "colocate_memory",
    "engine_lengths",
    "plan_weights",
]

# The ranks a vLLM LoRA engine accepts (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ColocateMemory(NamedTuple):
    """Bytes per GPU of a team trained next to a colocated vLLM engine (`colocate_memory`)."""

    parameters: float
    gradients: float
    optimizer: float
    engine: float
    device: float

    @property
    def training(self) -> float:
        """The agents' parameters, gradients and optimiser state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.training + self.engine

    @property
    def fits(self) -> bool:
        return self.total <= self.device


def colocate_memory(
    params: int,
    *,
    agents: int,
    dtype_bytes: int,
    world_size: int,
    zero_stage: int,
    trainable_fraction: float = 1.0,
    shared_base: bool = False,
    gpu_memory_utilization: float,
    device_bytes: float,
) -> ColocateMemory:
    """Bytes per GPU of `agents` agents of `params` parameters each, trained under ZeRO stage `zero_stage` (0: DDP, no
    DeepSpeed) on `world_size` GPUs, plus the colocated vLLM engine, against the device's `device_bytes`.

    Per agent, with P parameters of `dtype_bytes` bytes, T = `trainable_fraction` x P trainable (1 for full
    fine-tuning, the adapter's share of the parameters for LoRA) and W = `world_size`:

    - parameters: P x `dtype_bytes`, divided by W under ZeRO-3 (every agent holds its own copy, LoRA base included);
      with `shared_base` (LoRA agents on one frozen base, `loading.shared_lora_bases`, never under ZeRO-3) the base
      is held once for the team: P + (agents - 1) x T parameters in all instead of agents x P;
    - gradients: T x `dtype_bytes`, divided by W under ZeRO-2 and 3;
    - optimiser (AdamW): under DeepSpeed with 16-bit weights, an fp32 master copy and two fp32 moments, 12 x T bytes;
      otherwise two moments in the weights' dtype, 2 x `dtype_bytes` x T; divided by W under ZeRO-1, 2 and 3;
    - the engine: `gpu_memory_utilization` x `device_bytes` (vLLM takes that share for its weights and KV cache).

    Activations, CUDA context and fragmentation come on top, so a team this says does not fit cannot fit; one it says
    fits may still run out of memory.

    Example (two 7.6B agents, full fine-tuning in bf16 under ZeRO-2 on 8 GPUs of 80 GB, engine at 0.3):

    ```python
    >>> m = colocate_memory(7.6e9, agents=2, dtype_bytes=2, world_size=8, zero_stage=2, gpu_memory_utilization=0.3,
    ...                     device_bytes=80e9)
    >>> m.training / 1e9, m.engine / 1e9, m.fits  # 2 x (15.2 + 1.9 + 11.4) GB, 24 GB, 81 > 80
    (57.0, 24.0, False)
    ```
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"`zero_stage` must be 0 (no DeepSpeed), 1, 2 or 3, got {zero_stage}.")
    if shared_base and zero_stage == 3:
        raise ValueError(
            "`shared_base` with `zero_stage`=3: ZeRO-3 partitions each agent's own base; nothing is shared."
        )
    trainable = trainable_fraction * params
    team_params = params + (agents - 1) * trainable if shared_base else agents * params
    parameters = team_params * dtype_bytes / (world_size if zero_stage >= 3 else 1)
    gradients = trainable * dtype_bytes / (world_size if zero_stage >= 2 else 1)
    per_trainable = 12 if zero_stage >= 1 and dtype_bytes < 4 else 2 * dtype_bytes
    optimizer = trainable * per_trainable / (world_size if zero_stage >= 1 else 1)
    return ColocateMemory(
        parameters=parameters,
        gradients=agents * gradients,
        optimizer=agents * optimizer,
        engine=gpu_memory_utilization * device_bytes,
        device=device_bytes,
    )


def check_colocate_memory(memory: ColocateMemory, *, agents: int, world_size: int, zero_stage: int) -> None:
    """Raise a ValueError with the numbers and the fixes when `memory` (`colocate_memory`) does not fit the device."""
    if memory.fits:
        return
    gb = 1e9
    raise ValueError(
        f"use_vllm=True with vllm_mode='colocate' cannot fit one GPU: the {agents} agents' training state takes "
        f"{memory.training / gb:.1f} GB per GPU (parameters {memory.parameters / gb:.1f} GB, gradients "
        f"{memory.gradients / gb:.1f} GB, optimizer {memory.optimizer / gb:.1f} GB; "
        f"{'ZeRO-' + str(zero_stage) if zero_stage else 'no DeepSpeed'} on {world_size} GPU(s)) and the vLLM engine "
        f"{memory.engine / gb:.1f} GB (vllm_gpu_memory_utilization x the device), {memory.total / gb:.1f} GB in all, "
        f"more than the device's {memory.device / gb:.1f} GB, before activations. Fixes: LoRA agents (peft_config); "
        "ZeRO-2 with more GPUs (gradients and optimizer state are divided among them); a lower "
        "vllm_gpu_memory_utilization; or vllm_mode='server' (the engine on GPUs of its own). docs/scaling.md has a "
        "table of the shapes that fit."
    )


def _zero_stage() -> int:
    """The ZeRO stage of the run's DeepSpeed plugin (Accelerate's state), 0 without DeepSpeed."""
    from accelerate.state import AcceleratorState

    from ..adapters.grpo import deepspeed_state_exists

    plugin = AcceleratorState().deepspeed_plugin if deepspeed_state_exists() else None
    return 0 if plugin is None else int(plugin.zero_stage)


def team_colocate_memory(
    models: Sequence[nn.Module],
    *,
    world_size: int,
    zero_stage: int,
    gpu_memory_utilization: float,
    device_bytes: float,
) -> ColocateMemory:
    """`colocate_memory` of a team of models of one architecture: the parameters and dtype counted, the trainable
    fraction of all of them (parameters with `requires_grad`), and whether their frozen base is one set of `Parameter`
    objects (`loading.shared_lora_bases`)."""
    params = sum(p.numel() for p in models[0].parameters())
    trainable = sum(p.numel() for model in models for p in model.parameters() if p.requires_grad)
    held = {id(p) for model in models for p in model.parameters()}
    shared = len(held) < sum(1 for model in models for _ in model.parameters())
    return colocate_memory(
        params,
        agents=len(models),
        dtype_bytes=_weights_dtype(models[0]).itemsize,
        world_size=world_size,
        zero_stage=zero_stage,
        trainable_fraction=trainable / (params * len(models)),
        shared_base=shared,
        gpu_memory_utilization=gpu_memory_utilization,
        device_bytes=device_bytes,
    )


# TRL's colocate engine passes this: vLLM v1's memory profiler, run with its default (far larger), concludes that
# the KV cache does not fit next to the trainer's models.
_TRL_MAX_NUM_BATCHED_TOKENS = 4096


def engine_lengths(
    *,
    max_prompt_length: int | None,
    max_completion_length: int,
    max_position_embeddings: int | None = None,
    max_model_length: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> dict[str, int | None]:
    """The engine's `max_model_len` and `max_num_batched_tokens`, derived from the run unless the user set them.

    `max_model_len`: the user's `max_model_length`; else the longest prompt plus the longest completion,
    `max_prompt_length + max_completion_length` (the trainers truncate the prompt of every turn, later turns' prompts
    with the history included, to `max_prompt_length`, so this bounds every turn of a multi-turn run), at most the
    model's `max_position_embeddings`; `None` (vLLM takes the model's length) without `max_prompt_length`. A smaller
    `max_model_len` than the model's leaves vLLM more memory for the KV cache of the rows it runs at once.

    `max_num_batched_tokens`: the user's; else 4096, as TRL's colocate engine (vLLM's own default misleads its memory
    profiler into refusing to start next to the trainer's models).

    ```python
    >>> engine_lengths(max_prompt_length=2048, max_completion_length=256, max_position_embeddings=32768)
    {'max_model_len': 2304, 'max_num_batched_tokens': 4096}
    ```
    """
    if max_model_length is None and max_prompt_length is not None:
        max_model_length = max_prompt_length + max_completion_length
        if max_position_embeddings is not None:
            max_model_length = min(max_model_length, max_position_embeddings)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = _TRL_MAX_NUM_BATCHED_TOKENS
    return {"max_model_len": max_model_length, "max_num_batched_tokens": max_num_batched_tokens}


def _empty_cache() -> None:
    """Return PyTorch's cached, unused blocks to the GPU (TRL does so before waking its engine); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_lora_adapter(model: nn.Module) -> bool:
    """Whether vLLM can serve `model` as base + LoRA adapter (a plain LoRA, no DoRA, no `modules_to_save`)."""
    if not is_peft_model(model):
        return False
    from peft import PeftType

    config = model.peft_config[model.active_adapter]
    return config.peft_type == PeftType.LORA and not config.use_dora and not config.modules_to_save


def _base_name(model: nn.Module) -> str:
    return base_model(model).config.name_or_path


def _base_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's frozen base weights under the base model's own names (LoRA tensors skipped)."""
    for name, param in model.named_parameters():
        if model.prefix in name:  # "lora_": adapter tensors of any adapter
            continue
        yield name.removeprefix("base_model.model.").replace(".base_layer", ""), param.detach()


def _same_base(a: nn.Module, b: nn.Module) -> bool:
    if _base_name(a) != _base_name(b):
        return False
    weights_a, weights_b = dict(_base_weights(a)), dict(_base_weights(b))
    return weights_a.keys() == weights_b.keys() and all(
        weights_a[name] is weights_b[name] or torch.equal(weights_a[name], weights_b[name]) for name in weights_a
    )


def plan_weights(models: Sequence[nn.Module], lora_mode: Literal["adapter", "merged"] = "adapter") -> list[list[int]]:
    """Group agents by the weights the team's one engine must hold to generate for them, in order of first agent.

    With `lora_mode="adapter"`, LoRA agents whose bases have the same `name_or_path` and equal frozen weights form one
    group: the engine holds their base once and serves each agent with its adapter. Every other agent (full
    fine-tuning, or a peft model vLLM cannot serve as LoRA) is a group of its own: its (merged) weights are loaded
    into the engine before it generates. With `lora_mode="merged"`, every agent is a group of its own.

    Example:

    ```python
    >>> plan_weights([lora_agent_0, lora_agent_1, full_agent])  # LoRA adapters on the same base
    [[0, 1], [2]]
    ```
    """
    groups: list[list[int]] = []
    for i, model in enumerate(models):
        if lora_mode == "adapter" and _is_lora_adapter(model):
            for group in groups:
                if _is_lora_adapter(models[group[0]]) and _same_base(models[group[0]], model):
                    group.append(i)
                    break
            else:
                groups.append([i])
        else:
            groups.append([i])
    return groups


def check_one_architecture(models: Sequence[nn.Module]) -> None:
    """Raise a ValueError naming the first agent whose architecture differs from agent 0's.

    vLLM runs one engine per process on GPUs, and the team's engine takes each agent's weights in turn, so every agent
    must have the same architecture (model class and every shape-defining config entry)."""
    first = architecture(models[0])
    for index, model in enumerate(models[1:], start=1):
        other = architecture(model)
        differing = sorted(
            (key for key in first.keys() | other.keys() if first.get(key) != other.get(key)),
            key=lambda key: (key != "model class", key),  # the class first, then the config entries
        )
        if differing:
            shown = ", ".join(f"{key}: {first.get(key)!r} vs {other.get(key)!r}" for key in differing[:4])
            raise ValueError(
                f"use_vllm=True with vllm_mode='colocate' runs one vLLM engine per process (what vLLM supports on "
                f"GPUs) and loads each agent's weights into it before the agent generates, so every agent needs the "
                f"same architecture; agent {index} differs from agent 0 ({shown}"
                f"{', ...' if len(differing) > 4 else ''}). Give every agent the same architecture, or generate "
                "with HF generate (use_vllm=False)."
            )


def _write_adapter(model: nn.Module, path: str) -> None:
    """Write `model`'s active LoRA adapter (weights and config) to a new directory `path`, as vLLM loads it."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(path)
    adapter = model.active_adapter
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    save_file(
        {name: tensor.detach().contiguous() for name, tensor in state.items()},
        os.path.join(path, "adapter_model.safetensors"),
    )
    model.peft_config[adapter].save_pretrained(path)


@contextlib.contextmanager
def _merged_weights(model: nn.Module) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """All weights of `model` under the base model's names; a peft model's adapter is merged while they are read."""
    if not is_peft_model(model):
        yield ((name, param.detach()) for name, param in model.named_parameters())
        return
    model.merge_adapter()
    try:
        yield (
            (
                name.removeprefix("base_model.model.")
                .replace(".base_layer", "")
                .replace("modules_to_save.default.", ""),
                param.detach(),
            )
            for name, param in model.named_parameters()
            if model.prefix not in name and "original_module" not in name
        )
    finally:
        model.unmerge_adapter()


class _TeamSampling:
    """What `TeamVLLM` and `TeamVLLMServer` share: the sampling settings, each agent's stop ids, per-call sample seeds
    and the checks of their arguments."""

    def _init_sampling(
        self,
        models: Sequence[nn.Module],
        tokenizers: Sequence[PreTrainedTokenizerBase],
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        repetition_penalty: float,
        max_completion_length: int,
        seed: int | None,
    ) -> None:
        if not models:
            raise ValueError("`models` is empty: pass one model per agent.")
        if len(tokenizers) != len(models):
            raise ValueError(
                f"`tokenizers` has {len(tokenizers)} entries for {len(models)} models: pass one per agent."
            )
        if max_completion_length < 1:
            raise ValueError(f"`max_completion_length` must be >= 1, got {max_completion_length}.")
        self.sampling = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_completion_length,
        )
        self.seed = seed
        self.max_completion_length = max_completion_length
        self._stop_ids = [self._eos_ids(model, tokenizer) for model, tokenizer in zip(models, tokenizers)]
        self._calls = [0] * len(models)

    @staticmethod
    def _eos_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        generation_config = getattr(model, "generation_config", None)  # transformers or peft model: both have one
        eos = generation_config.eos_token_id if generation_config is not None else None
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if not ids:
            raise ValueError("A tokenizer has no `eos_token_id`: set `tokenizer.eos_token_id` so completions can end.")
        return sorted(ids)

    def _check_agent(self, agent_index: int) -> None:
        if not 0 <= agent_index < len(self._stop_ids):
            raise ValueError(f"`agent_index` must be in [0, {len(self._stop_ids)}), got {agent_index}.")

    def _check_rows(self, prompt_ids: list[list[int]], max_model_length: int | None, fix: str) -> None:
        if not prompt_ids or not all(isinstance(row, list) and row for row in prompt_ids):
            raise ValueError("`prompt_ids` must be a non-empty list of non-empty lists of token ids.")
        longest = max(len(row) for row in prompt_ids)
        if max_model_length is not None and longest + self.max_completion_length > max_model_length:
            raise ValueError(
                f"A prompt of {longest} tokens plus `max_completion_length`={self.max_completion_length} exceeds "
                f"`max_model_length`={max_model_length}: {fix} or truncate the prompts."
            )

    def _next_seeds(self, agent_index: int, rows: int, *key: int) -> list[int | None]:
        """One seed per row of this call of agent `agent_index`, drawn from `(seed, *key, agent_index, call)`; Nones
        without a seed. Counts the call."""
        call, self._calls[agent_index] = self._calls[agent_index], self._calls[agent_index] + 1
        if self.seed is None:
            return [None] * rows
        sequence = np.random.SeedSequence([self.seed, *key, agent_index, call])
        return [int(s) for s in sequence.generate_state(rows, dtype=np.uint32)]


class TeamVLLM(_TeamSampling):
    r"""
    One vLLM engine per process that generates for every agent of a team, with each agent's current weights.

    vLLM supports one engine per process on GPUs (an engine profiles the free GPU memory and sets up process-wide
    parallel groups), so the team shares one. LoRA agents on one base are adapters on it (the base is held once);
    every other agent's weights (merged, for a peft model vLLM cannot serve as LoRA) are loaded into the engine before
    the agent generates, whenever the engine holds another agent's weights or the agent's own changed since (`sync`):
    an in-place copy of the model's tensors into the engine's (`plan_weights` shows the grouping). Every agent must
    therefore have the same architecture (`check_one_architecture`).

    With several processes (torchrun, `accelerate launch`), every process builds its own engine (vLLM's
    `external_launcher` backend, as TRL's colocate mode) and generates its own rows. The caller repeats each prompt K
    times (one row per sample), as the trainers do for HF `generate`.

    Args:
        models (`Sequence[nn.Module]`):
            The agents' models, one per agent: transformers causal LMs, or peft `PeftModel`s, all of one architecture.
        tokenizers (`Sequence[PreTrainedTokenizerBase]`):
            One tokenizer per agent; its `eos_token_id` (and the model's `generation_config.eos_token_id`) end a
            completion.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; the returned log-probs are those of the tempered distribution.
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling: keep the smallest set of tokens whose probabilities add up to `top_p`.
        top_k (`int`, *optional*, defaults to `0`):
            Keep the `top_k` most likely tokens; `0` keeps all of them.
        min_p (`float`, *optional*, defaults to `0.0`):
            Drop tokens whose probability is below `min_p` times that of the most likely token.
        repetition_penalty (`float`, *optional*, defaults to `1.0`):
            Penalty for tokens already in the prompt or the completion; `1.0` means none.
        max_completion_length (`int`, *optional*, defaults to `256`):
            Maximum number of generated tokens per completion.
        gpu_memory_utilization (`float`, *optional*, defaults to `0.3`):
            Fraction of the GPU memory that the engine takes (weights and KV cache); the training models, gradients
            and optimiser states need the rest. On CPU, vLLM only checks that this fraction of the RAM is free when
            the engine starts; the KV cache takes `VLLM_CPU_KVCACHE_SPACE` GiB (set to 2 here unless already set).
        max_model_length (`int`, *optional*):
            Longest prompt plus completion, in tokens. Defaults to `max_prompt_length + max_completion_length` (at
            most the model's `max_position_embeddings`), or the model's `max_position_embeddings` without
            `max_prompt_length` (`engine_lengths`).
        max_prompt_length (`int`, *optional*):
            The run's longest prompt in tokens (the trainers' `max_prompt_length`, which bounds every turn's prompt);
            sets the default `max_model_length`.
        max_num_batched_tokens (`int`, *optional*):
            vLLM's token budget of one scheduler step. Defaults to 4096, as TRL's colocate engine.
        seed (`int`, *optional*):
            With a seed, every sample gets its own seed derived from `(seed, [process,] agent_index, call number,
            row)`, so the same calls give the same completions. Without one, sampling is not reproducible.
        dtype (`str`, *optional*, defaults to `"auto"`):
            Engine dtype (`"float32"`, `"bfloat16"`, `"float16"`); `"auto"` uses the dtype of the models' weights
            (which must then be the same for every agent). Weights are cast to it when they are loaded.
        enforce_eager (`bool`, *optional*):
            Skip vLLM's graph compilation and CUDA graphs. Defaults to `False` on CUDA (CUDA graphs make decoding
            faster) and `True` elsewhere (on CPU compilation took minutes and brought no speed).
        sleep_mode (`bool`, *optional*):
            Free the engine's GPU memory while the agents train (`sleep()`; the next `generate` wakes it); the engine
            is asleep from construction, so the agents' DeepSpeed/accelerate preparation has the memory. Defaults to
            on where vLLM's platform offers sleep mode (CUDA) and off elsewhere; `True` where it is not offered (the
            CPU build) is an error.
        lora_mode (`str`, *optional*, defaults to `"adapter"`):
            `"adapter"`: LoRA agents on the same base are served by their adapters (syncs move only the adapter).
            `"merged"`: every LoRA agent's merged weights are loaded into the engine before it generates, like a fully
            fine-tuned agent's; it then generates as fast as a plain model: on CPU, vLLM's LoRA kernels make
            `"adapter"` generation several times slower.

    Example:

    ```python
    >>> engine = TeamVLLM([agent_0, agent_1], [tokenizer, tokenizer], max_completion_length=64, seed=0)
    >>> completion_ids, logprobs = engine.generate(0, [prompt_ids] * 4)  # 4 samples of one prompt for agent 0
    >>> optimizer.step()
    >>> engine.sync(0, agent_0)  # agent 0's next samples come from its new weights
    ```
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        tokenizers: Sequence[PreTrainedTokenizerBase],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 256,
        gpu_memory_utilization: float = 0.3,
        max_model_length: int | None = None,
        max_prompt_length: int | None = None,
        max_num_batched_tokens: int | None = None,
        seed: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        sleep_mode: bool | None = None,
        lora_mode: Literal["adapter", "merged"] = "adapter",
    ):
        self._init_sampling(
            models,
            tokenizers,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_completion_length=max_completion_length,
            seed=seed,
        )
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"`gpu_memory_utilization` must be in (0, 1], got {gpu_memory_utilization}.")
        if lora_mode not in ("adapter", "merged"):
            raise ValueError(f"`lora_mode` must be 'adapter' or 'merged', got {lora_mode!r}.")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"`dtype` must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}.")
        check_one_architecture(models)
        dtypes = sorted({str(_weights_dtype(model)).removeprefix("torch.") for model in models})
        if dtype == "auto" and len(dtypes) > 1:
            raise ValueError(
                f"`dtype`='auto' takes the weights' dtype, and the agents' weights have several ({', '.join(dtypes)}): "
                "pass `dtype` (the one engine's dtype; weights are cast to it when loaded)."
            )
        self._rank, self._world_size = _distributed()
        if torch.cuda.is_available():  # no device memory to check on CPU
            stage = _zero_stage()
            memory = team_colocate_memory(
                models,
                world_size=self._world_size,
                zero_stage=stage,
                gpu_memory_utilization=gpu_memory_utilization,
                device_bytes=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
            )
            check_colocate_memory(memory, agents=len(models), world_size=self._world_size, zero_stage=stage)
        self._sleep_mode = _sleep_mode_setting(sleep_mode)
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default is far larger
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: TeamVLLM hands the weights to the engine as "
                "tensors in this process. Unset it or set it to 0."
            )
        from vllm import SamplingParams

        self._sampling_params = SamplingParams
        self._tmp = tempfile.TemporaryDirectory(prefix="comlrl-vllm-")
        self._lora_ids: dict[int, int] = {}
        self._next_lora_id = 1
        self._groups = plan_weights(models, lora_mode)
        self._group_of = {agent: g for g, group in enumerate(self._groups) for agent in group}
        self._lora_group = [lora_mode == "adapter" and _is_lora_adapter(models[group[0]]) for group in self._groups]
        self._agent_models = list(models)
        self._resident: int | None = None  # the group whose weights the engine holds (None: random or dropped)
        self._stale: set[int] = set()  # groups whose weights changed since they were loaded
        self._asleep: int | None = None  # the sleep level the engine is in
        self._asleep_parts: set[str] = set()  # what is still asleep: "weights", "kv_cache"
        self.weight_loads = [0] * len(self._groups)
        """How often each group's weights (`weight_groups`) were loaded into the engine."""
        self.load_seconds = 0.0
        """Time spent loading weights into the engine, in seconds."""
        lengths = engine_lengths(
            max_prompt_length=max_prompt_length,
            max_completion_length=max_completion_length,
            max_position_embeddings=getattr(base_model(models[0]).config, "max_position_embeddings", None),
            max_model_length=max_model_length,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self._llm = self._build_engine(models, dtype, lengths, gpu_memory_utilization, enforce_eager)
        self._release = _engine_release(self._llm)
        self._max_model_length = self._llm.llm_engine.model_config.max_model_len
        for agent, model in enumerate(models):
            if self._lora_group[self._group_of[agent]]:
                self.sync(agent, model)
        # asleep from the start, as TRL's engine: the agents' DeepSpeed/accelerate preparation runs after this
        self.sleep()

    @property
    def num_engines(self) -> int:
        """One: the team's engine in this process."""
        return 1

    def engine_index(self, agent_index: int) -> int:
        """Index of the engine that serves agent `agent_index`: always 0."""
        self._check_agent(agent_index)
        return 0

    @property
    def weight_groups(self) -> list[list[int]]:
        """Agents grouped by the weights the engine holds for them (see `plan_weights`)."""
        return [list(group) for group in self._groups]

    def _build_engine(
        self,
        models: Sequence[nn.Module],
        dtype: str,
        lengths: dict[str, int | None],
        gpu_memory_utilization: float,
        enforce_eager: bool | None,
    ) -> Any:
        """The engine, with random weights built from the config alone: each group's weights come before it generates."""
        from vllm import LLM

        first = base_model(models[0])
        config_dir = os.path.join(self._tmp.name, "engine")
        first.config.save_pretrained(config_dir)
        if dtype == "auto":
            dtype = str(_weights_dtype(models[0])).removeprefix("torch.")
        lora_agents = [models[a] for g, group in enumerate(self._groups) if self._lora_group[g] for a in group]
        extra: dict[str, Any] = {}
        if lora_agents:
            rank = max(model.peft_config[model.active_adapter].r for model in lora_agents)
            extra.update(
                enable_lora=True,
                max_loras=len(lora_agents),
                max_cpu_loras=len(lora_agents),
                max_lora_rank=next(r for r in _VLLM_LORA_RANKS if r >= rank),
            )
        if self._sleep_mode:
            extra["enable_sleep_mode"] = True
        if self._world_size > 1:
            extra["distributed_executor_backend"] = "external_launcher"  # one engine per process, vLLM's TP size 1
            _check_launcher_environment(self._rank, self._world_size)
        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available()
        with _process_state_kept():
            return LLM(
                model=config_dir,
                load_format="dummy",
                skip_tokenizer_init=True,
                generation_config="vllm",
                dtype=dtype,
                seed=(0 if self.seed is None else self.seed) + self._rank,
                **lengths,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                logprobs_mode="processed_logprobs",
                **extra,
            )

    def _load(self, group: int) -> None:
        """Make the engine hold `group`'s current weights (a LoRA group's frozen base, or an agent's merged weights),
        unless it already does."""
        self._wake_weights()
        if self._resident == group and group not in self._stale:
            return
        start = time.perf_counter()
        model = self._agent_models[self._groups[group][0]]
        with torch.no_grad():
            if self._lora_group[group]:
                self._reload(_base_weights(model))
            else:
                with _merged_weights(model) as weights:
                    self._reload(weights)
        self.load_seconds += time.perf_counter() - start
        self.weight_loads[group] += 1
        self._resident = group
        self._stale.discard(group)

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._llm.collective_rpc(_reload_in_worker, args=(weights,))
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sync(self, agent_index: int, model: nn.Module) -> None:
        """Take `model` as agent `agent_index`'s current weights; call it after each optimiser step.

        A LoRA agent's adapter is loaded now (written to a temporary directory and loaded under a new LoRA id). Any
        other agent's weights (a peft adapter merged into them) are loaded, cast to the engine's dtype, before its
        next generation.
        """
        self._check_agent(agent_index)
        group = self._group_of[agent_index]
        if self._lora_group[group] and not _is_lora_adapter(model):
            raise ValueError(
                f"`model` for agent {agent_index} must be a LoRA adapter, like the model the engine was built "
                "from: pass the same agent model to sync."
            )
        self._agent_models[agent_index] = model
        if not self._lora_group[group]:
            self._stale.add(group)
            return
        from vllm.lora.request import LoRARequest

        self._wake_weights()
        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        path = os.path.join(self._tmp.name, f"agent-{agent_index}-lora-{lora_id}")
        _write_adapter(model, path)
        old = self._lora_ids.get(agent_index)
        if old is not None:  # free the slot first: max_loras is the number of LoRA agents
            self._llm.llm_engine.remove_lora(old)
            _rmtree(os.path.join(self._tmp.name, f"agent-{agent_index}-lora-{old}"))
        self._llm.llm_engine.add_lora(LoRARequest(f"agent-{agent_index}-v{lora_id}", lora_id, path))
        self._lora_ids[agent_index] = lora_id
        self._llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next `generate` (vLLM's sleep mode); a no-op without sleep mode.

        Level 2 (weights and KV cache dropped) when no agent is a LoRA adapter: the next generation loads its agent's
        weights from the model anyway. Level 1 (weights moved to CPU memory, KV cache dropped) otherwise, so the base
        and the loaded adapters come back as they were. The engine is put to sleep as soon as it is built.

        Waking follows TRL's colocate engine: PyTorch's cached blocks are returned to the GPU (`empty_cache`), then the
        weights wake (`wake_up(tags=["weights"])`) and are loaded or synced, and the KV cache wakes last, just before
        the engine generates (`wake_up(tags=["kv_cache"])`), so it is never allocated while weights are copied.
        """
        if not self._sleep_mode or self._asleep is not None:
            return
        level = 1 if any(self._lora_group) else 2
        self._llm.sleep(level=level)
        self._asleep = level
        self._asleep_parts = {"weights", "kv_cache"}
        if level == 2:
            self._resident = None

    def _wake_weights(self) -> None:
        if "weights" in self._asleep_parts:
            _empty_cache()  # PyTorch's cached blocks back to the GPU first, as TRL does
            self._llm.wake_up(tags=["weights"])
            self._asleep_parts.discard("weights")

    def _wake_kv_cache(self) -> None:
        if "kv_cache" in self._asleep_parts:
            self._llm.wake_up(tags=["kv_cache"])
            self._asleep_parts.discard("kv_cache")
        if not self._asleep_parts:
            self._asleep = None

    def generate(self, agent_index: int, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one completion per prompt row for agent `agent_index`.

        Args:
            agent_index (`int`):
                The agent whose weights (or adapter) generate.
            prompt_ids (`list[list[int]]`):
                Prompt token ids without padding, one row per sample (repeat a prompt K times for K samples).

        Returns:
            `tuple[list[list[int]], list[list[float]]]`: the completion token ids, without padding, ending with an EOS
            id unless `max_completion_length` was reached; and the log-prob of each sampled token under the
            processed (tempered, filtered) sampling distribution, as TRL's importance-sampling correction needs.
        """
        self._check_agent(agent_index)
        group = self._group_of[agent_index]
        self._check_rows(prompt_ids, self._max_model_length, "raise `max_model_length`")
        self._load(group)  # wakes the weights first
        self._wake_kv_cache()  # after the weights are in, as TRL
        key = (self._rank,) if self._world_size > 1 else ()
        seeds = self._next_seeds(agent_index, len(prompt_ids), *key)
        params = [
            self._sampling_params(
                n=1, logprobs=0, stop_token_ids=self._stop_ids[agent_index], seed=seed, **self.sampling
            )
            for seed in seeds
        ]
        lora_request = None
        if self._lora_group[group]:
            from vllm.lora.request import LoRARequest

            lora_id = self._lora_ids[agent_index]
            lora_request = LoRARequest(
                f"agent-{agent_index}-v{lora_id}",
                lora_id,
                os.path.join(self._tmp.name, f"agent-{agent_index}-lora-{lora_id}"),
            )
        outputs = self._llm.generate(
            [{"prompt_token_ids": row} for row in prompt_ids], params, use_tqdm=False, lora_request=lora_request
        )
        completions = [output.outputs[0] for output in outputs]
        completion_ids = [list(c.token_ids) for c in completions]
        logprobs = [[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)] for c in completions]
        return completion_ids, logprobs

    def close(self) -> None:
        """Shut the engine down and delete the temporary adapter and config files."""
        self._release()
        self._llm = None
        gc.collect()
        self._tmp.cleanup()


def _distributed() -> tuple[int, int]:
    """This process's rank and the world size of `torch.distributed` (0 and 1 without it)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _weights_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in base_model(model).parameters() if p.is_floating_point())


def _sleep_mode_setting(sleep_mode: bool | None) -> bool:
    """Whether to use vLLM's sleep mode: where the platform offers it unless turned off; an error where it does not."""
    from vllm.platforms import current_platform

    available = current_platform.is_sleep_mode_available()
    if sleep_mode and not available:
        raise ValueError(
            f"`sleep_mode`=True, but vLLM's {current_platform.device_name or 'current'} platform has no sleep mode (it "
            "needs a CUDA GPU; the CPU build has none): leave `sleep_mode` unset or False."
        )
    return available if sleep_mode is None else sleep_mode


def _check_launcher_environment(rank: int, world_size: int) -> None:
    """vLLM's `external_launcher` backend reads the process's place from the launcher's environment variables."""
    missing = [
        name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
    ]
    if missing:
        raise ValueError(
            f"use_vllm=True on {world_size} processes builds one vLLM engine per process, which reads "
            f"{', '.join(missing)} from the environment: launch with torchrun or `accelerate launch`."
        )
    if int(os.environ["RANK"]) != rank or int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(
            f"RANK={os.environ['RANK']} and WORLD_SIZE={os.environ['WORLD_SIZE']} disagree with torch.distributed "
            f"(rank {rank} of {world_size}): launch with torchrun or `accelerate launch`."
        )


def _engine_release(llm: Any) -> weakref.finalize:
    """What shuts `llm` down, when called or when `llm` is garbage-collected, leaving the other engines running.

    vLLM's own teardown (`EngineCore.shutdown`, which the engine client also runs when it is garbage-collected) ends
    with `cleanup_dist_env_and_memory()`: it destroys vLLM's process-wide parallel groups and torch's default process
    group, which every other engine in this process still uses. Here only this engine's worker and scheduler stop.
    """
    client = llm.llm_engine.engine_core
    client._finalizer.detach()
    return weakref.finalize(llm, _shutdown_core, client.engine_core)


def _shutdown_core(core: Any) -> None:
    core.model_executor.shutdown()
    core.scheduler.shutdown()


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Keep the trainer's process state across an in-process engine start.

    vLLM seeds the global Python, NumPy and torch generators with the engine seed, its CPU worker replaces
    `torch.set_num_threads` by a no-op for the whole process, and the engine core `gc.freeze()`s every object alive
    (so cyclic garbage among them is never collected): all of these are undone.
    """
    import random

    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        gc.unfreeze()


def _reload_in_worker(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker: reload `weights` in place, then re-pack a tied LM head.

    The CPU backend packs every linear layer's weight, the LM head's included, for its GEMM kernels once the weights
    are loaded. A tied LM head gets no weights of its own in a reload, so its packed copy would keep the old
    embedding: it is packed again from the (shared, now updated) embedding. On GPUs this is a no-op.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    worker.reload_weights(weights_iterator=weights)
    model = worker.model_runner.get_model()
    if model.config.get_text_config().tie_word_embeddings:
        for module in model.modules():
            if isinstance(module, ParallelLMHead):
                module.quant_method.process_weights_after_loading(module)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
