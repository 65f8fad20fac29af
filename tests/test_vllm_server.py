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


@pytest.fixture(scope="module")
def server(steer_path, tmp_path_factory):
    """A vLLM server with the steerable base model, up to 2 adapters of rank <= 8 loaded at run time."""
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(tmp_path_factory.mktemp("server-log") / "server.log", "w")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", steer_path]
    command += ["--port", str(port), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    command += ["--logprobs-mode", "processed_logprobs", "--max-model-len", "256", "--dtype", "float32"]
    command += ["--enforce-eager", "--seed", "0"]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.close()
            pytest.fail(f"the vLLM server did not start:\n{open(log.name).read()[-3000:]}")
        time.sleep(1)
    yield url
    process.terminate()
    process.wait(60)
    log.close()


def _loaded_adapters(url: str) -> list[str]:
    return sorted(model["id"] for model in requests.get(f"{url}/v1/models").json()["data"] if model["parent"])


def _lora(path):
    config = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)


def test_adapters_are_served_per_agent_and_every_sync_replaces_them(server, steer_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    models = [_lora(steer_path), _lora(steer_path)]
    team = TeamVLLMServer(models, [tokenizer] * 2, server, str(tmp_path), max_completion_length=MAX_NEW, seed=0)
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


def test_a_lora_team_trains_through_the_server(server, steer_path, make_config, monkeypatch):
    from datasets import Dataset

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


def test_two_processes_share_the_server_and_only_the_main_process_loads_adapters(server, steer_path, tmp_path):
    from test_distributed import run_torchrun

    report = run_torchrun("vllm_server_ddp.py", tmp_path, 2, server, steer_path)
    rank0, rank1 = report["ranks"]
    assert rank0["digests"] == rank1["digests"]  # DDP keeps every agent's adapter equal on both ranks
    assert len(rank0["loads"]) == 6 and rank1["loads"] == []  # 2 agents x (start + 2 steps), by rank 0 alone
    for rank in (rank0, rank1):
        assert [agent for agent, _ in rank["generated"]] == [0, 1, 0, 1]  # every rank generates its own rows
        assert rank["served"] == sorted(rank0["loads"][-2:])  # both ranks see the latest adapters only
    assert rank0["generated"] != rank1["generated"]  # other items and seeds per rank
    assert report["served_after_close"] == []
