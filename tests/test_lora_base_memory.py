"""LoRA agents on one base hold one copy of its frozen weights per process, at the peak while they are built too.

Bytes are counted, not assumed: every distinct storage (`untyped_storage().data_ptr()`) behind the agents'
parameters, once. The tiny Qwen2 model (`comlrl_trl.testing`, float32, tied embeddings) has, by hand,
embeddings 512 x 32 = 16,384; per layer q 32x32+32, k and v 16x32+16 each, o 32x32, MLP 3 x 64x32, 2 norms of 32
(9,344); 2 layers and a final norm of 32: 35,104 parameters, 140,416 bytes. LoRA r=4 on q_proj and v_proj adds
per layer A 4x32 and B 32x4 (q), A 4x32 and B 16x4 (v): 448, so 896 parameters (3,584 bytes) per agent.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import snapshot
from peft import LoraConfig

from comlrl_trl.loading import copy_sharing_parameters, shared_lora_bases
from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


BASE_PARAMS = 512 * 32 + 2 * ((32 * 32 + 32) + 2 * (16 * 32 + 16) + 32 * 32 + 3 * 64 * 32 + 2 * 32) + 32
ADAPTER_PARAMS = 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
FP32 = 4
N = 3


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def three_way_reward(first, second, third, *, batch_items):
    return [len(c) / (1.0 + len(a) + len(b)) for a, b, c in zip(first, second, third)]


def held_bytes(models, trainable: bool | None = None) -> int:
    """Bytes of the distinct storages behind the parameters of `models` (all, or only the trainable or frozen)."""
    storages = {}
    for model in models:
        for p in model.parameters():
            if trainable is None or p.requires_grad == trainable:
                storage = p.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_the_formula_matches_the_tiny_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("qwen2"), dtype=torch.float32)
    assert BASE_PARAMS == 35_104 and ADAPTER_PARAMS == 896
    assert held_bytes([model]) == BASE_PARAMS * FP32 == 140_416


def test_a_copy_shares_every_parameter_but_owns_its_modules():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("qwen2"), dtype=torch.float32)
    copy = copy_sharing_parameters(model)
    assert copy is not model and copy.model.layers[0] is not model.model.layers[0]
    assert all(a is b for a, b in zip(model.parameters(), copy.parameters()))
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # the tie survives
    assert held_bytes([model, copy]) == held_bytes([model])


def test_shared_lora_bases_loads_one_base_for_lora_agents_only(make_config):
    path = tiny_model_path("qwen2")
    args = [make_config(num_agents=4) for _ in range(4)]
    models = shared_lora_bases([path] * 4, [lora(), lora(), None, LoraConfig(r=4, bias="all")], args)
    assert models[2] == path and models[3] == path  # full fine-tuning and a trained base bias: TRL loads them
    assert models[0] is not models[1]
    assert all(a is b for a, b in zip(models[0].parameters(), models[1].parameters()))
    alone = shared_lora_bases([path, "other"], [lora(), lora()], args[:2])
    assert alone == [path, "other"]  # one LoRA agent per base: nothing to share, TRL loads it as before
    with pytest.raises(ValueError, match="one entry per agent"):
        shared_lora_bases([path], [lora(), lora()], args[:2])


def test_three_lora_agents_hold_one_base_at_the_peak_and_after(monkeypatch, make_config, prompts_dataset):
    once = BASE_PARAMS * FP32 + N * ADAPTER_PARAMS * FP32  # 140,416 + 3 x 3,584 = 151,168
    built, peaks = [], []

    class CountingAgent(MAGRPOTrainer.agent_cls):
        """Counts the bytes held by every agent built so far, each time one more is built."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.model)
            peaks.append(held_bytes(built))

    monkeypatch.setattr(MAGRPOTrainer, "agent_cls", CountingAgent)
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"),
        num_agents=N,
        reward_func=three_way_reward,
        train_dataset=prompts_dataset,
        args=make_config(num_agents=N, max_steps=2, bf16=False),
        peft_config=lora(),
    )
    # Loading each agent from its path held k bases after k agents: 144,000, 288,000, 432,000 (measured).
    assert peaks == [BASE_PARAMS * FP32 + k * ADAPTER_PARAMS * FP32 for k in (1, 2, 3)]
    assert max(peaks) <= once
    assert held_bytes(trainer.agents) == once == 151_168
    assert held_bytes(trainer.agents, trainable=True) == N * ADAPTER_PARAMS * FP32
    assert len({id(model) for model in trainer.agents}) == N

    frozen_before = {n: p.detach().clone() for n, p in trainer.agents[0].named_parameters() if not p.requires_grad}
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    after = [snapshot(model) for model in trainer.agents]
    for i in range(N):  # every agent's every adapter moved
        assert all(not torch.equal(before[i][name], after[i][name]) for name in before[i]), i
    names = [name for name in after[0] if "lora_B" in name]
    assert all(not torch.equal(after[0][n], after[1][n]) for n in names)  # each agent trained its own adapter
    assert all(not torch.equal(after[1][n], after[2][n]) for n in names)
    for model in trainer.agents:  # the shared base did not move
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen.keys() == frozen_before.keys()
        assert all(torch.equal(frozen[n], frozen_before[n]) for n in frozen)
    assert held_bytes(trainer.agents) == once


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_zero2_keeps_one_base_after_preparing_every_agent(tmp_path):
    tiny_model_path("qwen2")  # built here, once
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1]),
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    }
    script = Path(__file__).parent / "scripts" / "lora_base_zero2.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script)]
    result = subprocess.run([*command, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert report["engines"] == ["DeepSpeedEngine"] * N
    assert report["frozen_bytes"] == BASE_PARAMS * FP32  # one base for the 3 engines
    assert report["frozen_shared"]  # every agent's frozen parameter is agent 0's storage
    assert report["adapters_moved"] == [True] * N and report["base_moved"] is False
