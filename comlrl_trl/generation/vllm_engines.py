"""vLLM engines for a team of agents: sampling with token log-probs, and weight sync after each optimiser step.

Engine layout (`plan_engines`):

- LoRA agents (peft `PeftModel` with a plain LoRA adapter) whose base models have the same `name_or_path` and equal
  frozen weights share ONE engine built with `enable_lora=True`; each agent is served by its own `LoRARequest`.
- Every other agent (full fine-tuning, or a peft model that cannot be served as a LoRA adapter: DoRA,
  `modules_to_save`, non-LoRA peft types) gets its own engine, and its weights are pushed merged.

Engines are built from the model's config only (`load_format="dummy"`) and then receive the in-memory weights through
the same path as a later `sync`, so an engine always matches the model it was given, whatever checkpoint (or none) it
came from.

Weight sync goes through the worker's `reload_weights(weights_iterator=...)` (vLLM's layerwise reload). Calling the
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
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase


__all__ = ["TeamVLLM", "plan_engines"]

# The ranks a vLLM LoRA engine accepts (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _is_lora_adapter(model: nn.Module) -> bool:
    """Whether vLLM can serve `model` as base + LoRA adapter (a plain LoRA, no DoRA, no `modules_to_save`)."""
    if not _is_peft(model):
        return False
    from peft import PeftType

    config = model.peft_config[model.active_adapter]
    return config.peft_type == PeftType.LORA and not config.use_dora and not config.modules_to_save


def _base_name(model: nn.Module) -> str:
    return model.get_base_model().config._name_or_path


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


def plan_engines(models: Sequence[nn.Module], lora_mode: Literal["adapter", "merged"] = "adapter") -> list[list[int]]:
    """Group agents into vLLM engines: agent indices per engine, in order of each engine's first agent.

    With `lora_mode="adapter"`, LoRA agents share an engine when their bases have the same `name_or_path` and equal
    frozen weights; every other agent gets its own engine. With `lora_mode="merged"`, every agent gets its own.

    Example:

    ```python
    >>> plan_engines([lora_agent_0, lora_agent_1, full_agent])  # LoRA adapters on the same base
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
    if not _is_peft(model):
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
    vLLM engines that generate for every agent of a team and take each agent's new weights after an optimiser step.

    The caller repeats each prompt K times (one row per sample), as the trainers do for HF `generate`.

    Args:
        models (`Sequence[nn.Module]`):
            The agents' models, one per agent: transformers causal LMs, or peft `PeftModel`s. LoRA agents on the same
            base share one engine (see `plan_engines`).
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
            Fraction of GPU memory that EACH engine takes (weights and KV cache), so the sum over engines must stay
            below 1. On CPU, vLLM only checks that this fraction of the RAM is free when an engine starts; the KV
            cache takes `VLLM_CPU_KVCACHE_SPACE` GiB per engine (set to 2 here unless already set).
        max_model_length (`int`, *optional*):
            Longest prompt plus completion, in tokens. Defaults to the model's `max_position_embeddings`.
        seed (`int`, *optional*):
            With a seed, every sample gets its own seed derived from `(seed, agent_index, call number, row)`, so the
            same calls give the same completions. Without one, sampling is not reproducible.
        dtype (`str`, *optional*, defaults to `"auto"`):
            Engine dtype (`"float32"`, `"bfloat16"`, `"float16"`); `"auto"` uses the dtype of each model's weights.
            Weights are cast to it at every sync.
        enforce_eager (`bool`, *optional*, defaults to `True`):
            Skip vLLM's graph compilation, which costs start-up time (minutes on CPU) and brought no speed on CPU.
        lora_mode (`str`, *optional*, defaults to `"adapter"`):
            `"adapter"`: LoRA agents on the same base share one engine, each served by its adapter (one copy of the
            base; syncs move only the adapter). `"merged"`: every LoRA agent gets its own engine holding its merged
            weights (one copy of the weights per agent, full syncs), which generates as fast as a plain model: on
            CPU, vLLM's LoRA kernels make `"adapter"` generation several times slower.

    Example:

    ```python
    >>> engines = TeamVLLM([agent_0, agent_1], [tokenizer, tokenizer], max_completion_length=64, seed=0)
    >>> completion_ids, logprobs = engines.generate(0, [prompt_ids] * 4)  # 4 samples of one prompt for agent 0
    >>> optimizer.step()
    >>> engines.sync(0, agent_0)  # agent 0's next samples come from its new weights
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
        seed: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = True,
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
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine; vLLM's CPU default is far larger
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: TeamVLLM.sync hands tensors to the engine in "
                "this process. Unset it or set it to 0."
            )
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "torch.distributed runs with world size "
                f"{torch.distributed.get_world_size()}: TeamVLLM starts its engines inside one process and does not "
                "support multi-process training yet. Train in one process, or generate with HF generate."
            )
        from vllm import SamplingParams

        self._sampling_params = SamplingParams
        self._tmp = tempfile.TemporaryDirectory(prefix="comlrl-vllm-")
        self._lora_ids: dict[int, int] = {}
        self._next_lora_id = 1
        self._groups = plan_engines(models, lora_mode)
        self._engine_of = {agent: e for e, group in enumerate(self._groups) for agent in group}
        self._engines: list[Any] = []
        self._releases: list[weakref.finalize] = []
        self._lora_engine: list[bool] = []
        for e, group in enumerate(self._groups):
            lora = lora_mode == "adapter" and _is_lora_adapter(models[group[0]])
            self._engines.append(
                self._build_engine(
                    e, [models[a] for a in group], lora, dtype, max_model_length, gpu_memory_utilization, enforce_eager
                )
            )
            self._lora_engine.append(lora)
        self._max_model_length = [llm.llm_engine.model_config.max_model_len for llm in self._engines]
        for agent, model in enumerate(models):
            self.sync(agent, model)

    @property
    def num_engines(self) -> int:
        """Number of vLLM engines (one per LoRA base shared by its adapters, one per other agent)."""
        return len(self._engines)

    def engine_index(self, agent_index: int) -> int:
        """Index of the engine that serves agent `agent_index`."""
        self._check_agent(agent_index)
        return self._engine_of[agent_index]

    def _build_engine(
        self,
        index: int,
        models: list[nn.Module],
        lora: bool,
        dtype: str,
        max_model_length: int | None,
        gpu_memory_utilization: float,
        enforce_eager: bool,
    ) -> Any:
        """An engine with random weights built from the config alone: the first `sync` brings the real weights."""
        from vllm import LLM

        base = models[0].get_base_model() if _is_peft(models[0]) else models[0]
        config_dir = os.path.join(self._tmp.name, f"engine-{index}")
        base.config.save_pretrained(config_dir)
        if dtype == "auto":
            dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        lora_args: dict[str, Any] = {}
        if lora:
            rank = max(model.peft_config[model.active_adapter].r for model in models)
            lora_args = dict(
                enable_lora=True,
                max_loras=len(models),
                max_cpu_loras=len(models),
                max_lora_rank=next(r for r in _VLLM_LORA_RANKS if r >= rank),
            )
        with _process_state_kept():
            llm = LLM(
                model=config_dir,
                load_format="dummy",
                skip_tokenizer_init=True,
                generation_config="vllm",
                dtype=dtype,
                seed=0 if self.seed is None else self.seed,
                max_model_len=max_model_length,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                logprobs_mode="processed_logprobs",
                **lora_args,
            )
        self._releases.append(_engine_release(llm))
        if lora:  # the adapters' shared frozen base, once
            self._reload(llm, _base_weights(models[0]))
        return llm

    @staticmethod
    def _reload(llm: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        llm.collective_rpc(_reload_in_worker, args=(weights,))
        llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sync(self, agent_index: int, model: nn.Module) -> None:
        """Push `model`'s current weights into agent `agent_index`'s engine; call it after each optimiser step.

        A LoRA agent pushes only its adapter (written to a temporary directory and loaded under a new LoRA id);
        any other agent pushes all its weights (a peft adapter merged into them), cast to the engine's dtype.
        """
        self._check_agent(agent_index)
        engine = self._engine_of[agent_index]
        if self._lora_engine[engine] and not _is_lora_adapter(model):
            raise ValueError(
                f"`model` for agent {agent_index} must be a LoRA adapter, like the model its engine was "
                "built from: pass the same agent model to sync."
            )
        llm = self._engines[engine]
        if not self._lora_engine[engine]:
            with torch.no_grad(), _merged_weights(model) as weights:
                self._reload(llm, weights)
            return
        from vllm.lora.request import LoRARequest

        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        path = os.path.join(self._tmp.name, f"agent-{agent_index}-lora-{lora_id}")
        _write_adapter(model, path)
        old = self._lora_ids.get(agent_index)
        if old is not None:  # free the slot first: max_loras is the number of agents on this engine
            llm.llm_engine.remove_lora(old)
            _rmtree(os.path.join(self._tmp.name, f"agent-{agent_index}-lora-{old}"))
        llm.llm_engine.add_lora(LoRARequest(f"agent-{agent_index}-v{lora_id}", lora_id, path))
        self._lora_ids[agent_index] = lora_id
        llm.reset_prefix_cache()

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
        engine = self._engine_of[agent_index]
        self._check_rows(prompt_ids, self._max_model_length[engine], "raise `max_model_length`")
        seeds = self._next_seeds(agent_index, len(prompt_ids))
        params = [
            self._sampling_params(
                n=1, logprobs=0, stop_token_ids=self._stop_ids[agent_index], seed=seed, **self.sampling
            )
            for seed in seeds
        ]
        lora_request = None
        if self._lora_engine[engine]:
            from vllm.lora.request import LoRARequest

            lora_id = self._lora_ids[agent_index]
            lora_request = LoRARequest(
                f"agent-{agent_index}-v{lora_id}",
                lora_id,
                os.path.join(self._tmp.name, f"agent-{agent_index}-lora-{lora_id}"),
            )
        outputs = self._engines[engine].generate(
            [{"prompt_token_ids": row} for row in prompt_ids], params, use_tqdm=False, lora_request=lora_request
        )
        completions = [output.outputs[0] for output in outputs]
        completion_ids = [list(c.token_ids) for c in completions]
        logprobs = [[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)] for c in completions]
        return completion_ids, logprobs

    def close(self) -> None:
        """Shut the engines down and delete the temporary adapter and config files.

        Engines of other `TeamVLLM`s in this process keep working.
        """
        for release in self._releases:
            release()
        self._releases.clear()
        self._engines.clear()
        gc.collect()
        self._tmp.cleanup()


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
