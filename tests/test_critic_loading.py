"""How critics are loaded: in the dtype they train in, and under ZeRO-3 partitioned as they are created."""

import importlib.util

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from test_distributed import run_torchrun
from transformers import AutoModelForCausalLM

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _reward(first, second):
    return [0.0] * len(first)


@pytest.fixture
def loads(monkeypatch):
    """The dtype of every `from_pretrained` call, and the dtypes of the weights it returned."""
    seen = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        seen.append((kwargs.get("dtype", kwargs.get("torch_dtype")), {p.dtype for p in model.parameters()}))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    return seen


def test_a_critic_that_trains_whole_is_loaded_in_fp32_not_cast_after(qwen_path, make_config, loads):
    """Asked for bf16, a critic whose every weight trains is loaded in fp32 (its own AdamW's master weights): not
    loaded in bf16 and then cast, which holds both copies of each tensor on the way."""
    trainer = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=make_config(config_cls=MAACConfig),
        model_config={"critic_model_kwargs": {"dtype": torch.bfloat16}},
    )
    assert loads == [(torch.float32, {torch.float32})]  # the critic's one load (the agents load through TRL)
    assert {p.dtype for p in trainer.critics[0].parameters()} == {torch.float32}


def test_a_lora_critic_keeps_its_frozen_base_in_the_dtype_asked_for(qwen_path, make_config, loads):
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=make_config(config_cls=IACConfig, use_separate_critic=True),
        critic_peft_config=lora,
        model_config={"critic_model_kwargs": {"dtype": torch.bfloat16}},
    )
    assert [dtype for dtype, _ in loads] == [torch.bfloat16, torch.bfloat16]
    for critic in trainer.critics:
        assert {p.dtype for p in critic.parameters() if not p.requires_grad} == {torch.bfloat16}
        assert {p.dtype for p in critic.parameters() if p.requires_grad} == {torch.float32}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_zero3_critics_are_never_whole_on_a_process(tmp_path):
    """Under ZeRO-3 on two processes, no process ever holds a whole critic: after every load and every critic built
    (IAC's two separate critics, alive together, then MAAC's joint one), the critic weights a process holds are at
    most its share, full / world, plus ZeRO's padding (each tensor padded to a multiple of the world size) and the
    value head, which DeepSpeed partitions when the critic's engine is built. Before, each process loaded every
    critic whole (in fp32) and DeepSpeed partitioned it only then. A LoRA critic's base is partitioned the same way,
    and its adapters take the base's bf16 (DeepSpeed's optimiser takes one dtype per partition). Each trains a step."""
    report = run_torchrun("critic_zero3_memory.py", tmp_path, 2, zero_stage="3")
    world = report["world"]
    assert world == 2
    for rank, runs in enumerate(report["ranks"]):
        for name, critics in (("iac", 2), ("maac", 1)):
            run = runs[name]
            assert run["loads"] == critics, (rank, name)
            peak = run["peak"]
            element = 2  # bf16: ZeRO-3 stores the partitions in the engine's precision, as loaded
            head = critics * (32 + 1) * element  # each critic's value head (hidden size 32), not yet partitioned
            share = peak["full"] / world + peak["tensors"] * (world - 1) * element + head
            assert 0 < peak["held"] <= share, (rank, name, peak)
            assert peak["held"] < 0.6 * peak["full"], (rank, name, peak)  # never a whole critic
            assert run["dtypes"] == ["torch.bfloat16"], (rank, name)
            assert run["steps"] == 1, (rank, name)
        lora = runs["maac_lora"]  # the base partitioned as it loaded; the adapters, added after, in its bf16
        assert lora["peak"]["held"] < 0.6 * lora["peak"]["full"] and lora["dtypes"] == ["torch.bfloat16"]
        assert lora["steps"] == 1
