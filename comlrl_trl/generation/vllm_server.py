"""A team of LoRA agents generating through one vLLM server (`vllm_mode="server"`).

The server runs the agents' shared base model and serves each agent as a LoRA adapter that it loads at run time
(vLLM's `/v1/load_lora_adapter`): after every optimiser step, the agent's adapter is written to a directory that the
server can read, loaded under a new name, and the previous one is unloaded. Generation posts token-id prompts to the
server's `/v1/completions`, one request per sample (concurrently), each with its own seed. Full weights are not sent:
that needs TRL's NCCL weight transfer (GPUs only), so fully fine-tuned agents use `vllm_mode="colocate"`.

Start the server with the base model, LoRA enabled and run-time adapter loading allowed:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server --model <base model> \
        --enable-lora --max-loras <agents> --max-lora-rank <rank> --logprobs-mode processed_logprobs --port 8000

With several training processes, the main process (rank 0 of `torch.distributed`) writes and loads the adapters and
the others wait for it; every process sends its own prompts.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from .vllm_engines import _is_lora_adapter, _same_base, _TeamSampling, _write_adapter


__all__ = ["TeamVLLMServer"]


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class TeamVLLMServer(_TeamSampling):
    r"""
    LoRA agents of one base model generating through a running vLLM server; the same interface as `TeamVLLM`.

    Args:
        models (`Sequence[nn.Module]`):
            The agents: peft `PeftModel`s with a plain LoRA adapter (no DoRA, no `modules_to_save`), all on the same
            base model, which the server must serve.
        tokenizers (`Sequence[PreTrainedTokenizerBase]`):
            One tokenizer per agent; its `eos_token_id` (and the model's `generation_config.eos_token_id`) end a
            completion.
        base_url (`str`):
            The server's address, e.g. `"http://10.0.0.5:8000"`.
        adapter_dir (`str`):
            Where the adapters are written; the server must be able to read it under the same path (the same machine,
            or a shared file system).
        temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, seed:
            As in `TeamVLLM`. With a seed, sample i of the n-th call of agent a on process r gets a seed drawn from
            `(seed, r, a, n)`.
        timeout (`float`, *optional*, defaults to `240.0`):
            Seconds to wait for the server to answer its health check at construction.
        max_concurrency (`int`, *optional*, defaults to `64`):
            Requests in flight at once (vLLM batches them).
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        tokenizers: Sequence[PreTrainedTokenizerBase],
        base_url: str,
        adapter_dir: str,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 256,
        seed: int | None = None,
        timeout: float = 240.0,
        max_concurrency: int = 64,
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
        for index, model in enumerate(models):
            if not _is_lora_adapter(model):
                raise ValueError(
                    f"vllm_mode='server' serves LoRA agents only (each agent an adapter the server loads at run "
                    f"time); agent {index} is not a plain LoRA peft model. Full weights would need TRL's NCCL "
                    "weight transfer (GPUs only): use vllm_mode='colocate' for fully fine-tuned agents."
                )
            if not _same_base(models[0], model):
                raise ValueError(
                    f"vllm_mode='server' serves one base model; agent {index}'s base differs from agent 0's. "
                    "Give every agent the same base model, or use vllm_mode='colocate'."
                )
        import requests

        self._requests = requests
        self.base_url = base_url.rstrip("/")
        self._session = requests.Session()
        self._session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=max_concurrency))
        self._wait_until_up(timeout)
        served = self._request("get", "/v1/models")["data"][0]
        self._max_model_length = served.get("max_model_len")
        self._max_concurrency = max_concurrency
        self._versions = [0] * len(models)
        self._names: dict[int, str] = {}
        self._rank, self._world_size = _distributed()
        self._prefix = self._run_prefix()
        self._adapter_dir = adapter_dir
        self._release = weakref.finalize(
            self, _unload_adapters, self._session, self.base_url, self._names, adapter_dir, self._rank == 0
        )
        if self._rank == 0:
            os.makedirs(adapter_dir, exist_ok=True)
        for agent, model in enumerate(models):
            self.sync(agent, model)

    @property
    def num_engines(self) -> int:
        """One: the server."""
        return 1

    def engine_index(self, agent_index: int) -> int:
        self._check_agent(agent_index)
        return 0

    def _run_prefix(self) -> str:
        """A name prefix of this run's adapters, the same on every process, so runs sharing a server never clash."""
        prefix = [uuid.uuid4().hex[:8]]
        if self._world_size > 1:
            torch.distributed.broadcast_object_list(prefix, src=0)
        return prefix[0]

    def _wait_until_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._session.get(f"{self.base_url}/health", timeout=10).status_code == 200:
                    return
            except self._requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"No vLLM server answers at {self.base_url} after {timeout:.0f} s (vllm_server_timeout). Start "
                    "one with the agents' base model and LoRA enabled (docs/vllm.md, 'Server mode'), or fix "
                    "vllm_server_base_url / vllm_server_host / vllm_server_port."
                )
            time.sleep(1.0)

    def _request(self, method: str, path: str, **kwargs) -> dict[str, Any]:
        response = getattr(self._session, method)(f"{self.base_url}{path}", **kwargs)
        if response.status_code != 200:
            hint = ""
            if "lora" in path and response.status_code == 404:
                hint = " (start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)"
            raise RuntimeError(
                f"The vLLM server at {self.base_url} answered {response.status_code} to {path}{hint}: {response.text}"
            )
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return {}  # the adapter endpoints answer in plain text

    def sync(self, agent_index: int, model: nn.Module) -> None:
        """Load `model`'s current adapter into the server under a new name; call it after each optimiser step."""
        self._check_agent(agent_index)
        if not _is_lora_adapter(model):
            raise ValueError(f"`model` for agent {agent_index} must be a LoRA adapter, like the agent it serves.")
        self._versions[agent_index] += 1
        name = f"comlrl-{self._prefix}-agent-{agent_index}-v{self._versions[agent_index]}"
        if self._rank == 0:
            path = os.path.join(self._adapter_dir, name)
            _write_adapter(model, path)
            old = self._names.get(agent_index)
            if old is not None:  # free the slot first: the server holds at most --max-loras adapters
                self._request("post", "/v1/unload_lora_adapter", json={"lora_name": old})
                shutil.rmtree(os.path.join(self._adapter_dir, old), ignore_errors=True)
            self._request("post", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if self._world_size > 1:
            torch.distributed.barrier()  # no process asks for the new adapter before the server has it
        self._names[agent_index] = name

    def generate(self, agent_index: int, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one completion per prompt row for agent `agent_index`; returns what `TeamVLLM.generate` returns."""
        self._check_agent(agent_index)
        fix = "restart the server with a larger --max-model-len"
        self._check_rows(prompt_ids, self._max_model_length, fix)
        seeds = self._next_seeds(agent_index, len(prompt_ids), self._rank)
        common = dict(
            model=self._names[agent_index],
            logprobs=0,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            stop_token_ids=self._stop_ids[agent_index],
            skip_special_tokens=False,
            **self.sampling,
        )

        def send(row_and_seed: tuple[list[int], int | None]) -> tuple[list[int], list[float]]:
            row, seed = row_and_seed
            payload = {**common, "prompt": row, **({"seed": seed} if seed is not None else {})}
            choice = self._request("post", "/v1/completions", json=payload)["choices"][0]
            return list(choice["token_ids"]), [float(lp) for lp in choice["logprobs"]["token_logprobs"]]

        with ThreadPoolExecutor(max_workers=min(self._max_concurrency, len(prompt_ids))) as pool:
            results = list(pool.map(send, zip(prompt_ids, seeds)))
        return [ids for ids, _ in results], [lps for _, lps in results]

    def close(self) -> None:
        """Unload this run's adapters from the server and delete their files; the server keeps running.

        It also runs when the object is garbage-collected or the interpreter exits, so a finished run never leaves
        its adapters loaded on a shared server."""
        self._release()


def _unload_adapters(session: Any, base_url: str, names: dict[int, str], adapter_dir: str, main: bool) -> None:
    """Unload the adapters in `names` and delete their files (main process only), then close the session."""
    import requests

    if main:
        for name in names.values():
            try:
                session.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)
            except requests.RequestException:
                pass  # the server is gone: nothing is left loaded there
            shutil.rmtree(os.path.join(adapter_dir, name), ignore_errors=True)
    names.clear()
    session.close()
