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
tells the others whether that worked (a failure is raised on every process, none is left waiting); every process
sends its own prompts.

Every HTTP request has a timeout. With an API key (`api_key`, or the `VLLM_API_KEY` environment variable that vLLM's
server reads too), every request carries it as a bearer token: start the server with `--api-key`. A server reached
over a non-loopback address without a key lets anyone who reaches it load adapters, so that is warned about.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import time
import uuid
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from .vllm_engines import _distributed, _is_lora_adapter, _same_base, _TeamSampling, _write_adapter


__all__ = ["TeamVLLMServer"]


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
        request_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds to wait for the answer to any one request (a sample, an adapter load) before raising.
        api_key (`str`, *optional*):
            Sent as `Authorization: Bearer <api_key>` with every request (the server's `--api-key`). Defaults to the
            `VLLM_API_KEY` environment variable. Without one, reaching the server over a non-loopback address warns:
            anyone who can reach a server with run-time LoRA loading can load adapters into it.
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
        request_timeout: float = 600.0,
        api_key: str | None = None,
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
                    f"time); agent {index} is not a plain LoRA peft model. Full weights would have to travel over "
                    "TRL's NCCL weight transfer (VLLMClient) to a vLLM server per agent (GPUs only), which is not "
                    "built yet (docs/vllm.md, 'Fully fine-tuned agents and servers'): use vllm_mode='colocate', "
                    "which runs fully fine-tuned agents on one engine per process."
                )
            if not _same_base(models[0], model):
                raise ValueError(
                    f"vllm_mode='server' serves one base model; agent {index}'s base differs from agent 0's. "
                    "Give every agent the same base model, or use vllm_mode='colocate'."
                )
        if request_timeout <= 0:
            raise ValueError(f"`request_timeout` must be > 0 seconds, got {request_timeout}.")
        import requests

        self._requests = requests
        self.base_url = base_url.rstrip("/")
        self._request_timeout = request_timeout
        self._session = requests.Session()
        for scheme in ("http://", "https://"):
            self._session.mount(scheme, requests.adapters.HTTPAdapter(pool_maxsize=max_concurrency))
        api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY") or None
        if api_key is not None:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        elif not _is_loopback(self.base_url):
            warnings.warn(
                f"The vLLM server at {self.base_url} is reached over the network without an API key: anyone who can "
                "reach it can load LoRA adapters into it (run-time LoRA loading is on). Start it with --api-key and "
                "set VLLM_API_KEY (or `api_key`) here; docs/vllm.md, 'Server mode'.",
                stacklevel=2,
            )
        self._wait_until_up(timeout)
        served = self._request("get", "/v1/models")["data"][0]
        self._max_model_length = served.get("max_model_len")
        self._check_logprobs_mode(served["id"])
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
                if self._session.get(f"{self.base_url}/health", timeout=min(10.0, timeout)).status_code == 200:
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

    def _check_logprobs_mode(self, model: str) -> None:
        """Raise unless the server returns processed log-probs (`--logprobs-mode processed_logprobs`).

        One token is sampled with `top_k=1`: its processed log-prob (after the top-k filter) is exactly 0, while the
        raw log-prob (vLLM's default mode) is that of the model's whole distribution, below 0 for any model that is
        not certain of the token."""
        payload = dict(model=model, prompt=[0], max_tokens=1, temperature=1.0, top_k=1, logprobs=0, seed=0)
        choice = self._request("post", "/v1/completions", json=payload)["choices"][0]
        logprob = float(choice["logprobs"]["token_logprobs"][0])
        if abs(logprob) > 1e-4:
            raise ValueError(
                f"The vLLM server at {self.base_url} returns raw log-probs or logits (a top-1 sample came back with "
                f"{logprob:.4f}, where the processed log-prob is 0), but TRL's importance-sampling correction needs "
                "those of the processed sampling distribution: restart it with --logprobs-mode processed_logprobs."
            )

    def _request(self, method: str, path: str, **kwargs) -> dict[str, Any]:
        try:
            response = getattr(self._session, method)(
                f"{self.base_url}{path}", timeout=self._request_timeout, **kwargs
            )
        except self._requests.Timeout as error:
            raise TimeoutError(
                f"The vLLM server at {self.base_url} did not answer {path} within {self._request_timeout:.0f} s "
                "(vllm_server_request_timeout)."
            ) from error
        if response.status_code != 200:
            hint = ""
            if "lora" in path and response.status_code == 404:
                hint = " (start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)"
            if response.status_code == 401:
                hint = " (the server was started with --api-key: set VLLM_API_KEY, or `api_key`, to that key)"
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
        failure: Exception | None = None
        if self._rank == 0:
            try:
                self._load_adapter(agent_index, model, name)
            except Exception as error:  # raised below, on every process
                failure = error
        if self._world_size > 1:
            # The main process's outcome reaches every process before any of them goes on: a failure is raised
            # everywhere instead of leaving the others waiting at their next collective until its timeout. It also
            # orders the load before every process's next request for the new adapter.
            outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
            torch.distributed.broadcast_object_list(outcome, src=0)
            if outcome[0] is not None and failure is None:
                raise RuntimeError(
                    f"The main process failed to load agent {agent_index}'s adapter into the vLLM server: {outcome[0]}"
                )
        if failure is not None:
            raise failure
        self._names[agent_index] = name

    def _load_adapter(self, agent_index: int, model: nn.Module, name: str) -> None:
        """Write the adapter and load it into the server under `name`, after unloading the agent's previous one."""
        path = os.path.join(self._adapter_dir, name)
        _write_adapter(model, path)
        old = self._names.get(agent_index)
        if old is not None:  # free the slot first: the server holds at most --max-loras adapters
            self._request("post", "/v1/unload_lora_adapter", json={"lora_name": old})
            shutil.rmtree(os.path.join(self._adapter_dir, old), ignore_errors=True)
            del self._names[agent_index]  # unloaded: not unloaded again at close
        self._request("post", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

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

    def sleep(self) -> None:
        """Nothing to free in this process: the server keeps its memory (the same interface as `TeamVLLM`)."""

    def close(self) -> None:
        """Unload this run's adapters from the server and delete their files; the server keeps running.

        It also runs when the object is garbage-collected or the interpreter exits, so a finished run never leaves
        its adapters loaded on a shared server."""
        self._release()


def _is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine's loopback interface (`localhost`, 127.0.0.0/8, ::1)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: possibly reached over the network


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
