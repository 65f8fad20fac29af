"""TeamVLLM's sleep and wake order and its derived engine lengths (issue 58, item 4), with a stub engine: vLLM's
CPU build has no sleep mode, so the calls the engine would get on CUDA are recorded here. Plain unit tests: no vLLM
needed (a stand-in `vllm` module provides `SamplingParams`)."""

import sys
import types
from types import SimpleNamespace

import pytest

from comlrl_trl.generation import vllm_engines
from comlrl_trl.generation.vllm_engines import engine_lengths
from comlrl_trl.testing import build_tiny_model, build_tokenizer


class _StubLLM:
    """Records the calls TeamVLLM makes to its engine, in order; generates one EOS-free token per row."""

    def __init__(self, calls):
        self.calls = calls
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags) if tags else 'all'})")

    def collective_rpc(self, function, args):
        list(args[0])  # the weights iterator is consumed by the worker
        self.calls.append("load_weights")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm, lora_request):
        self.calls.append("generate")
        out = SimpleNamespace(token_ids=[3], logprobs=[{3: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(outputs=[out]) for _ in prompts]


@pytest.fixture
def stub_engine(monkeypatch):
    calls: list[str] = []
    built: dict = {}

    def build(self, models, dtype, lengths, gpu_memory_utilization, enforce_eager):
        built.update(lengths)
        calls.append("build")
        return _StubLLM(calls)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    monkeypatch.setattr(vllm_engines, "_sleep_mode_setting", lambda sleep_mode: True)  # as on CUDA
    monkeypatch.setattr(vllm_engines, "_engine_release", lambda llm: lambda: None)
    monkeypatch.setattr(vllm_engines, "_empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(vllm_engines.TeamVLLM, "_build_engine", build)
    return calls, built


def _team():
    tokenizer = build_tokenizer("qwen2")
    return [build_tiny_model("qwen2", tokenizer, seed=i) for i in range(2)], [tokenizer, tokenizer]


def test_the_engine_sleeps_as_soon_as_it_is_built_and_wakes_weights_then_kv_cache(stub_engine):
    calls, _ = stub_engine
    models, tokenizers = _team()
    engine = vllm_engines.TeamVLLM(models, tokenizers, max_completion_length=4)
    # asleep before the trainer prepares the agents (DeepSpeed / accelerate), level 2: no agent is a LoRA adapter
    assert calls == ["build", "sleep(2)"]
    calls.clear()
    engine.generate(0, [[5, 6]] * 2)
    # PyTorch's cache emptied before waking; weights woken, loaded, then the KV cache woken, then generation
    assert calls == [
        "empty_cache",
        "wake_up(weights)",
        "load_weights",
        "reset_prefix_cache",
        "wake_up(kv_cache)",
        "generate",
    ]
    calls.clear()
    engine.generate(1, [[5, 6]] * 2)  # awake: only the other agent's weights are loaded
    assert calls == ["load_weights", "reset_prefix_cache", "generate"]
    calls.clear()
    engine.sleep()
    engine.sleep()  # already asleep: nothing
    engine.generate(1, [[5, 6]] * 2)  # level 2 dropped the weights: agent 1's are loaded again
    assert calls == [
        "sleep(2)",
        "empty_cache",
        "wake_up(weights)",
        "load_weights",
        "reset_prefix_cache",
        "wake_up(kv_cache)",
        "generate",
    ]


def test_the_engine_lengths_come_from_the_run_unless_set(stub_engine):
    _, built = stub_engine
    models, tokenizers = _team()
    vllm_engines.TeamVLLM(models, tokenizers, max_completion_length=16, max_prompt_length=40)
    assert built == {"max_model_len": 56, "max_num_batched_tokens": 4096}  # 40 + 16; TRL's 4096


def test_engine_lengths():
    # the prompt limit plus the completion (every turn's prompt is truncated to max_prompt_length)
    assert engine_lengths(max_prompt_length=2048, max_completion_length=256) == {
        "max_model_len": 2304,
        "max_num_batched_tokens": 4096,
    }
    # at most the model's length
    assert engine_lengths(max_prompt_length=2048, max_completion_length=256, max_position_embeddings=1024) == {
        "max_model_len": 1024,
        "max_num_batched_tokens": 4096,
    }
    # no prompt limit: the model's length (vLLM's default)
    assert engine_lengths(max_prompt_length=None, max_completion_length=256)["max_model_len"] is None
    # the user's settings win
    assert engine_lengths(
        max_prompt_length=2048, max_completion_length=256, max_model_length=8192, max_num_batched_tokens=16384
    ) == {"max_model_len": 8192, "max_num_batched_tokens": 16384}
