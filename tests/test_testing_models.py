"""Tests for comlrl_trl.testing: tiny offline models and tokenizers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_trl.testing import build_corpus, build_tiny_model, build_tokenizer, tiny_model_path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

KINDS = ["qwen2", "llama"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.mark.parametrize("kind", KINDS)
def test_load_from_cached_path(kind: str, cache_dir: Path) -> None:
    path = tiny_model_path(kind, cache_dir=cache_dir)
    assert Path(path) == cache_dir / f"{kind}-seed0-v1"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == kind
    assert model.config.vocab_size == len(tok)
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    # Cache hit returns the same directory without rebuilding.
    mtime = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path(kind, cache_dir=cache_dir) == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("kind", KINDS)
def test_reloaded_tokenizer_matches_in_process(kind: str, cache_dir: Path) -> None:
    tok = build_tokenizer(kind)
    reloaded = AutoTokenizer.from_pretrained(tiny_model_path(kind, cache_dir=cache_dir))
    for text in build_corpus()[:50] + ["What is 12 + 7?\n  def f(x):\treturn x+1"]:
        assert tok(text).input_ids == reloaded(text).input_ids
        assert reloaded.decode(reloaded(text).input_ids) == text


def test_env_var_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMLRL_TRL_CACHE", str(tmp_path))
    assert tiny_model_path("llama", seed=3) == str(tmp_path / "llama-seed3-v1")


def test_concurrent_builds_do_not_collide(tmp_path: Path) -> None:
    results: list[str] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(tiny_model_path("qwen2", seed=1, cache_dir=tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen2-seed1-v1"]  # no temp dirs left
    AutoModelForCausalLM.from_pretrained(results[0])


def test_tokenizers_differ() -> None:
    qwen, llama = build_tokenizer("qwen2"), build_tokenizer("llama")
    assert len(qwen) != len(llama)
    assert qwen.eos_token != llama.eos_token
    assert llama.bos_token == "<s>" and qwen.bos_token is None


@pytest.mark.parametrize("kind", KINDS)
def test_chat_template(kind: str) -> None:
    tok = build_tokenizer(kind)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str) and "hi" in text
    if kind == "qwen2":
        assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_weights(kind: str) -> None:
    tok = build_tokenizer(kind)
    a = build_tiny_model(kind, tok, seed=0).state_dict()
    b = build_tiny_model(kind, build_tokenizer(kind), seed=0).state_dict()
    c = build_tiny_model(kind, tok, seed=1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("kind", KINDS)
def test_generate(kind: str, cache_dir: Path) -> None:
    path = tiny_model_path(kind, cache_dir=cache_dir)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = tok(["What is 1 + 2?", "hi"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 2
    assert out.shape[1] > batch["input_ids"].shape[1]


def test_grpo_smoke(tmp_path: Path, cache_dir: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    path = tiny_model_path("qwen2", cache_dir=cache_dir)
    dataset = Dataset.from_dict({"prompt": ["What is 1 + 2?", "Write a poem.", "def f(x):", "Count to 3."] * 2})

    def length_reward(completions: list[str], **kwargs: object) -> list[float]:
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.1,
    )
    trainer = GRPOTrainer(model=path, reward_funcs=length_reward, args=args, train_dataset=dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed, "no parameter changed after two GRPO steps"
