"""`vllm_mode="server"`: LoRA agents generating through a running vLLM server (`make test-vllm`).

One OpenAI-compatible vLLM server (the CPU build) is started for the module, serving a tiny "steerable" Qwen2 (see
`tests/test_vllm_engines.py`: a rank-1 LoRA of the last `o_proj` can make it emit token 42 or 77 with probability ~1)
with run-time LoRA loading. The tests check what reaches the server: every agent's adapter, a new one after every
sync, the sampled tokens and their log-probs, and a trainer that generates and trains through it.
"""

import gc
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest
import requests
import torch
from helpers import changed, sampling_ratios, snapshot


vllm = pytest.importorskip("vllm")

from peft import LoraConfig, get_peft_model  # noqa: E402
from test_vllm_engines import PROMPTS, _hf_logprobs, _save_tiny, _steer_adapter  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl_trl.generation import TeamVLLMServer  # noqa: E402
from comlrl_trl.trainers.reinforce import MAGRPOTrainer  # noqa: E402


pytestmark = pytest.mark.vllm

MAX_NEW = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def steer_path(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("server-steer"), tied=False, steerable=True)


KEY = "test-key-27"  # the module server's --api-key


def _launch_server(model_path: str, log_path, *options: str):
    """Start a CPU vLLM server for `model_path` with `options`; return the process, its URL and its log file."""
    port = _free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_API_KEY")
    }
    env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(log_path, "w")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--port", str(port)]
    command += ["--max-model-len", "256", "--dtype", "float32", "--enforce-eager", "--seed", "0", *options]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}", log


def _wait_for(process, url: str, log) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.close()
            pytest.fail(f"the vLLM server did not start:\n{open(log.name).read()[-3000:]}")
        time.sleep(1)


def _stop_server(process, log) -> None:
    process.terminate()
    process.wait(60)
    log.close()


@pytest.fixture(scope="module")
def servers(steer_path, tmp_path_factory):
    """Two vLLM servers of the steerable base model, started side by side: the module's server (up to 2 adapters of
    rank <= 8 loaded at run time, processed log-probs, an API key), and one in vLLM's default raw log-prob mode."""
    logs = tmp_path_factory.mktemp("server-logs")
    options = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--logprobs-mode", "processed_logprobs"]
    launched = [
        _launch_server(steer_path, logs / "server.log", *options, "--api-key", KEY),
        _launch_server(steer_path, logs / "raw.log"),
    ]
    try:
        for process, url, log in launched:
            _wait_for(process, url, log)
        yield launched[0][1], launched[1][1]
    finally:
        for process, _, log in launched:
            if process.poll() is None:
                _stop_server(process, log)


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def _loaded_adapters(url: str) -> list[str]:
    answer = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return sorted(model["id"] for model in answer.json()["data"] if model["parent"])


def _lora(path):
    config = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)


def test_adapters_are_served_per_agent_and_every_sync_replaces_them(server, steer_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    models = [_lora(steer_path), _lora(steer_path)]
    team = TeamVLLMServer(
        models, [tokenizer] * 2, server, str(tmp_path), max_completion_length=MAX_NEW, seed=0, api_key=KEY
    )
    try:
        first = _loaded_adapters(server)
        assert len(first) == 2 and team.num_engines == 1  # one adapter per agent on the one server
        for agent in (0, 1):
            completions, logprobs = team.generate(agent, PROMPTS)
            assert len(completions) == len(PROMPTS)
            for prompt, row, lps in zip(PROMPTS, completions, logprobs):
                assert 1 <= len(row) == len(lps) <= MAX_NEW
                assert tokenizer.eos_token_id not in row[:-1]
                assert len(row) == MAX_NEW or row[-1] == tokenizer.eos_token_id
                # the server's processed log-probs at temperature 1 are the adapter model's own
                torch.testing.assert_close(
                    torch.tensor(lps), _hf_logprobs(models[agent], prompt, row), atol=1e-3, rtol=0
                )
            assert len({tuple(row) for row in completions}) > 1  # rows are independent samples
        _steer_adapter(models[0], 63)  # token 42
        _steer_adapter(models[1], 62)  # token 77
        team.sync(0, models[0])
        team.sync(1, models[1])
        second = _loaded_adapters(server)
        assert len(second) == 2 and not set(first) & set(second)  # new names; the old adapters are unloaded
        assert all(set(row) == {42} for row in team.generate(0, PROMPTS)[0])
        assert all(set(row) == {77} for row in team.generate(1, PROMPTS)[0])
        assert sorted(os.listdir(tmp_path)) == second  # only the live adapters stay on disk
    finally:
        team.close()
    assert _loaded_adapters(server) == [] and os.listdir(tmp_path) == []


def test_a_seed_makes_server_samples_reproducible(server, steer_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    runs = []
    for attempt in range(2):
        team = TeamVLLMServer(
            [_lora(steer_path)],
            [tokenizer],
            server,
            str(tmp_path / str(attempt)),
            max_completion_length=MAX_NEW,
            seed=3,
            api_key=KEY,
        )
        runs.append([team.generate(0, PROMPTS)[0], team.generate(0, PROMPTS)[0]])
        assert len(_loaded_adapters(server)) == 1
        if attempt == 0:
            team.close()
        else:
            del team  # a team that is garbage-collected unloads its adapters too
            gc.collect()
        assert _loaded_adapters(server) == [] and os.listdir(tmp_path / str(attempt)) == []
    assert runs[0] == runs[1]  # same seed, same calls: same samples
    assert runs[0][0] != runs[0][1]  # a new call draws new samples


def test_server_mode_refuses_what_it_cannot_serve(steer_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    full = AutoModelForCausalLM.from_pretrained(steer_path)
    with pytest.raises(ValueError, match="LoRA agents only.*vllm_mode='colocate'"):
        TeamVLLMServer([full], [tokenizer], "http://127.0.0.1:9", str(tmp_path))
    with pytest.raises(ConnectionError, match=r"No vLLM server answers at http://127.0.0.1:9 after 1 s"):
        TeamVLLMServer([_lora(steer_path)], [tokenizer], "http://127.0.0.1:9", str(tmp_path), timeout=1)
    with pytest.raises(ValueError, match="`request_timeout` must be > 0 seconds, got 0"):
        TeamVLLMServer([_lora(steer_path)], [tokenizer], "http://127.0.0.1:9", str(tmp_path), request_timeout=0)


def test_a_server_without_a_key_on_the_network_is_warned_about(steer_path, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    # 192.0.2.1 (TEST-NET-1) is not this machine: the warning comes before the (failing) health check.
    with pytest.warns(UserWarning, match="reached over the network without an API key: anyone who can reach it"):
        with pytest.raises(ConnectionError):
            TeamVLLMServer([_lora(steer_path)], [tokenizer], "http://192.0.2.1:8000", str(tmp_path), timeout=1)
    for url in ("http://127.0.0.1:9", "http://localhost:9", "http://[::1]:9"):  # loopback: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ConnectionError):
                TeamVLLMServer([_lora(steer_path)], [tokenizer], url, str(tmp_path), timeout=1)


def test_the_server_needs_the_key_and_processed_logprobs(servers, steer_path, tmp_path, monkeypatch):
    server, raw_server = servers
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    with pytest.raises(RuntimeError, match="answered 401 to /v1/models \\(the server was started with --api-key"):
        TeamVLLMServer([_lora(steer_path)], [tokenizer], server, str(tmp_path))
    # vLLM's default log-prob mode is the raw model's: refused at connection, before any adapter is loaded.
    with pytest.raises(ValueError, match="returns raw log-probs or logits .* --logprobs-mode processed_logprobs"):
        TeamVLLMServer([_lora(steer_path)], [tokenizer], raw_server, str(tmp_path))


def test_a_lora_team_trains_through_the_server(server, steer_path, make_config, monkeypatch):
    from datasets import Dataset

    monkeypatch.setenv("VLLM_API_KEY", KEY)  # the trainer's key comes from the environment, as the server's can
    generated = []
    generate = TeamVLLMServer.generate

    def recording(self, agent_index, prompt_ids):
        generated.append((agent_index, len(prompt_ids)))
        return generate(self, agent_index, prompt_ids)

    monkeypatch.setattr(TeamVLLMServer, "generate", recording)
    items = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})
    config = make_config(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server,
        num_generations=4,
        max_new_tokens=MAX_NEW,
        max_steps=2,
        bf16=False,
        top_p=1.0,  # untruncated sampling: the importance-sampling correction is on
        top_k=0,
    )
    trainer = MAGRPOTrainer(
        agent_model=steer_path,
        reward_func=lambda *agents, **kwargs: [float(sum(map(ord, a + b)) % 7) for a, b in zip(*agents)],
        train_dataset=items,
        args=config,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert isinstance(trainer.generation_engines, TeamVLLMServer)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert generated == [(0, 4), (1, 4), (0, 4), (1, 4)]  # every agent, every step, through the server
    assert all(changed(before[a], model) for a, model in enumerate(trainer.agents))  # every adapter trained
    adapters = _loaded_adapters(server)
    assert len(adapters) == 2 and all(name.endswith("-v3") for name in adapters)  # synced at steps 0 and 1
    # The server samples from the adapters being trained: TRL's importance-sampling ratios are near 1.
    ratios = sampling_ratios(trainer)
    assert len(ratios) == 4 and all(0.9 < ratio < 1.1 for ratio in ratios), ratios
    trainer.generation_engines.close()
    assert _loaded_adapters(server) == []


def test_two_processes_share_the_server_and_only_the_main_process_loads_adapters(
    server, steer_path, tmp_path, monkeypatch
):
    from test_distributed import run_torchrun

    monkeypatch.setenv("VLLM_API_KEY", KEY)
    report = run_torchrun("vllm_server_ddp.py", tmp_path, 2, server, steer_path)
    rank0, rank1 = report["ranks"]
    assert rank0["digests"] == rank1["digests"]  # DDP keeps every agent's adapter equal on both ranks
    # The server refused rank 0's last load: rank 0 raises the server's answer, rank 1 learns of it at once (instead
    # of waiting at a barrier until gloo's 30-minute timeout) and raises it too.
    assert rank0["failure"].startswith("RuntimeError: The vLLM server at") and "load_lora_adapter" in rank0["failure"]
    assert rank1["failure"].startswith("RuntimeError: The main process failed to load agent 0's adapter")
    assert "load_lora_adapter" in rank1["failure"] and rank1["failure_seconds"] < 60
    assert len(rank0["loads"]) == 7 and rank1["loads"] == []  # 2 agents x (start + 2 steps) + the refused one
    for rank in (rank0, rank1):
        assert [agent for agent, _ in rank["generated"]] == [0, 1, 0, 1]  # every rank generates its own rows
        assert rank["served"] == sorted(rank0["loads"][-3:-1])  # both ranks saw the latest adapters only
    assert rank0["generated"] != rank1["generated"]  # other items and seeds per rank
    assert report["served_after_close"] == []
