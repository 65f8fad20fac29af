"""vLLM colocate: the per-GPU memory estimate of the training state plus the engine, and the refusal of teams that
cannot fit (issue 58, item 3). Plain unit tests: no vLLM and no GPU needed (the device is given or patched)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from comlrl_trl.generation import vllm_engines
from comlrl_trl.generation.vllm_engines import check_colocate_memory, colocate_memory, team_colocate_memory
from comlrl_trl.loading import copy_sharing_parameters
from comlrl_trl.testing import build_tiny_model, build_tokenizer


GB = 1e9


def test_two_full_7b_agents_under_zero2_on_8_gpus_do_not_fit_80_gb_next_to_the_engine():
    # per agent: parameters 7.6e9 x 2 = 15.2 GB; gradients 15.2 / 8 = 1.9 GB; AdamW (fp32 master + 2 moments)
    # 7.6e9 x 12 / 8 = 11.4 GB -> 28.5 GB; two agents 57 GB; engine 0.3 x 80 = 24 GB; 81 GB > 80 GB
    m = colocate_memory(
        7.6e9, agents=2, dtype_bytes=2, world_size=8, zero_stage=2, gpu_memory_utilization=0.3, device_bytes=80 * GB
    )
    assert m.parameters == pytest.approx(30.4 * GB)
    assert m.gradients == pytest.approx(3.8 * GB)
    assert m.optimizer == pytest.approx(22.8 * GB)
    assert m.training == pytest.approx(57.0 * GB)
    assert m.engine == pytest.approx(24.0 * GB)
    assert m.total == pytest.approx(81.0 * GB)
    assert not m.fits


def test_the_same_agents_with_lora_fit():
    # 1% trainable: parameters 30.4 GB; gradients 2 x 0.076e9 x 2 / 8 = 0.038 GB; optimizer 2 x 0.076e9 x 12 / 8
    # = 0.228 GB; 30.666 + 24 = 54.666 GB <= 80 GB
    m = colocate_memory(
        7.6e9,
        agents=2,
        dtype_bytes=2,
        world_size=8,
        zero_stage=2,
        trainable_fraction=0.01,
        gpu_memory_utilization=0.3,
        device_bytes=80 * GB,
    )
    assert m.training == pytest.approx(30.666 * GB)
    assert m.total == pytest.approx(54.666 * GB)
    assert m.fits


def test_each_zero_stage_divides_its_share():
    common = dict(agents=1, dtype_bytes=2, world_size=4, gpu_memory_utilization=0.0, device_bytes=80 * GB)
    # DDP: torch AdamW keeps two bf16 moments: 2 + 2 + 4 = 8 GB for 1e9 parameters
    assert colocate_memory(1e9, zero_stage=0, **common)[:3] == pytest.approx((2 * GB, 2 * GB, 4 * GB))
    # ZeRO-1: optimizer (12 bytes, fp32 master and moments) / 4
    assert colocate_memory(1e9, zero_stage=1, **common)[:3] == pytest.approx((2 * GB, 2 * GB, 3 * GB))
    # ZeRO-2: gradients / 4 too
    assert colocate_memory(1e9, zero_stage=2, **common)[:3] == pytest.approx((2 * GB, 0.5 * GB, 3 * GB))
    # ZeRO-3: parameters / 4 too
    assert colocate_memory(1e9, zero_stage=3, **common)[:3] == pytest.approx((0.5 * GB, 0.5 * GB, 3 * GB))
    # fp32 weights under DeepSpeed: no master copy, two fp32 moments (8 bytes)
    fp32 = dict(common, dtype_bytes=4)
    assert colocate_memory(1e9, zero_stage=2, **fp32)[:3] == pytest.approx((4 * GB, 1 * GB, 2 * GB))
    with pytest.raises(ValueError, match="zero_stage"):
        colocate_memory(1e9, zero_stage=4, **common)


def test_the_refusal_names_each_part_the_device_and_the_fixes():
    m = colocate_memory(
        7.6e9, agents=2, dtype_bytes=2, world_size=8, zero_stage=2, gpu_memory_utilization=0.3, device_bytes=80 * GB
    )
    with pytest.raises(ValueError) as error:
        check_colocate_memory(m, agents=2, world_size=8, zero_stage=2)
    message = str(error.value)
    for part in (
        "57.0 GB",
        "parameters 30.4 GB",
        "gradients 3.8 GB",
        "optimizer 22.8 GB",
        "ZeRO-2 on 8 GPU(s)",
        "engine 24.0 GB",
        "81.0 GB in all",
        "device's 80.0 GB",
        "LoRA",
        "more GPUs",
        "vllm_gpu_memory_utilization",
        "vllm_mode='server'",
    ):
        assert part in message
    lora = colocate_memory(
        7.6e9,
        agents=2,
        dtype_bytes=2,
        world_size=8,
        zero_stage=2,
        trainable_fraction=0.01,
        gpu_memory_utilization=0.3,
        device_bytes=80 * GB,
    )
    check_colocate_memory(lora, agents=2, world_size=8, zero_stage=2)  # fits: no error


def test_lora_agents_on_one_base_count_the_base_once():
    # four 7.6B LoRA agents, 1% trainable (T = 0.076e9), ZeRO-2 on 8 GPUs: parameters (7.6e9 + 3 x 0.076e9) x 2 bytes
    # = 15.656 GB (four bases would be 60.8 GB); gradients 4 x 0.076e9 x 2 / 8 = 0.076 GB; AdamW 4 x 0.076e9 x 12 / 8
    # = 0.456 GB -> 16.188 GB + engine 24 GB = 40.188 GB, fits 80 GB (four bases: 61.332 + 24 = 85.332, no)
    common = dict(
        agents=4,
        dtype_bytes=2,
        world_size=8,
        zero_stage=2,
        trainable_fraction=0.01,
        gpu_memory_utilization=0.3,
        device_bytes=80 * GB,
    )
    shared = colocate_memory(7.6e9, shared_base=True, **common)
    assert shared.parameters == pytest.approx(15.656 * GB)
    assert shared.gradients == pytest.approx(0.076 * GB)
    assert shared.optimizer == pytest.approx(0.456 * GB)
    assert shared.total == pytest.approx(40.188 * GB)
    assert shared.fits
    separate = colocate_memory(7.6e9, **common)
    assert separate.parameters == pytest.approx(60.8 * GB)
    assert not separate.fits
    with pytest.raises(ValueError, match="ZeRO-3 partitions each agent's own base"):
        colocate_memory(7.6e9, **dict(common, zero_stage=3), shared_base=True)


def test_the_team_estimate_counts_a_shared_base_once():
    tokenizer = build_tokenizer("qwen2")
    base = build_tiny_model("qwen2", tokenizer, seed=0)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    other = copy_sharing_parameters(base)  # before PEFT wraps either, as `loading.shared_lora_bases` does
    models = [get_peft_model(base, config), get_peft_model(other, config)]
    params = sum(p.numel() for p in models[0].parameters())
    adapter = sum(p.numel() for p in models[0].parameters() if p.requires_grad)
    itemsize = next(models[0].parameters()).dtype.itemsize
    m = team_colocate_memory(models, world_size=1, zero_stage=0, gpu_memory_utilization=0.5, device_bytes=1e6)
    assert m.parameters == pytest.approx((params + adapter) * itemsize)  # one base, two adapters


def _team(lora: bool):
    tokenizer = build_tokenizer("qwen2")
    models = [build_tiny_model("qwen2", tokenizer, seed=i) for i in range(2)]
    if lora:
        models = [get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])) for m in models]
    return models, tokenizer


def test_the_team_estimate_counts_the_models_parameters_dtype_and_trainable_share():
    models, _ = _team(lora=True)
    params = sum(p.numel() for p in models[0].parameters())
    trainable = sum(p.numel() for p in models[0].parameters() if p.requires_grad)
    itemsize = next(models[0].parameters()).dtype.itemsize
    m = team_colocate_memory(models, world_size=2, zero_stage=2, gpu_memory_utilization=0.5, device_bytes=1e6)
    per = 12 if itemsize < 4 else 8
    assert m.parameters == pytest.approx(2 * params * itemsize)
    assert m.gradients == pytest.approx(2 * trainable * itemsize / 2)
    assert m.optimizer == pytest.approx(2 * trainable * per / 2)
    assert m.engine == pytest.approx(0.5e6)


def test_team_vllm_refuses_a_team_that_cannot_fit_the_gpu_before_building_the_engine(monkeypatch):
    models, tokenizer = _team(lora=False)
    params = sum(p.numel() for p in models[0].parameters())
    itemsize = next(models[0].parameters()).dtype.itemsize
    training = 2 * params * itemsize * 4  # DDP, one GPU: parameters, gradients and two AdamW moments
    device = training * 1.1  # the training state fits, not with the engine's 0.3 of the device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": device}))
    monkeypatch.setattr(vllm_engines, "_zero_stage", lambda: 0)
    with pytest.raises(ValueError, match=r"cannot fit one GPU.*no DeepSpeed on 1 GPU\(s\)"):
        vllm_engines.TeamVLLM(models, [tokenizer, tokenizer], gpu_memory_utilization=0.3)
