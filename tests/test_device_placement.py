"""Single-process runs on a machine with several GPUs: every agent loads whole, onto one device."""

import torch
from datasets import Dataset
from helpers import length_ratio_reward

from comlrl_trl.loading import one_device_loading
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


def test_agents_and_references_load_without_device_map_auto(qwen_path, make_config, monkeypatch):
    """TRL passes `device_map="auto"` to from_pretrained when none is given and the process is on a GPU, which spreads
    one agent over every visible GPU. The agents and their reference models must be loaded with device_map=None."""
    import trl.trainer.grpo_trainer as grpo

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # the machine this guards: 4 visible GPUs
    loaded = []
    real = grpo.create_model_from_path

    def recording(model_id, *args, **kwargs):
        loaded.append(dict(kwargs))
        return real(model_id, *args, **kwargs)

    monkeypatch.setattr(grpo, "create_model_from_path", recording)
    MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
        args=make_config(beta=0.1, model_init_kwargs={"dtype": "float32"}),
    )
    assert len(loaded) == 4  # 2 agents, 2 reference models
    assert all("device_map" in kwargs and kwargs["device_map"] is None for kwargs in loaded)
    assert all(kwargs["dtype"] == "float32" for kwargs in loaded)  # the user's settings stay


def test_an_explicit_device_map_is_kept():
    assert one_device_loading(None) == {"device_map": None}
    assert one_device_loading({"device_map": "auto", "dtype": "bfloat16"}) == {
        "device_map": "auto",
        "dtype": "bfloat16",
    }


def test_is_peft_model_unwraps_accelerate_wrappers_and_reads_no_package_metadata(monkeypatch):
    """Asked at every generation, value forward and MADPO reference pass: Accelerate's version read two packages'
    metadata from disk per call (1.1 ms). Ours must give its answers without touching package metadata."""
    import importlib.metadata

    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from comlrl_trl.loading import is_peft_model

    config = Qwen2Config(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    plain = Qwen2ForCausalLM(config)
    lora = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))

    def no_metadata(*args, **kwargs):
        raise AssertionError("package metadata read")

    monkeypatch.setattr(importlib.metadata, "metadata", no_metadata)
    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    assert is_peft_model(lora) and not is_peft_model(plain)
    assert is_peft_model(torch.nn.DataParallel(lora)) and not is_peft_model(torch.nn.DataParallel(plain))
    compiled = torch.compile(lora)  # wraps without compiling until the first call
    assert is_peft_model(compiled) and is_peft_model(torch.nn.DataParallel(compiled))


def test_base_model_is_the_transformers_model_of_plain_lora_and_compiled_lora_models():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from comlrl_trl.loading import base_model

    config = Qwen2Config(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    plain = Qwen2ForCausalLM(config)
    inner = Qwen2ForCausalLM(config)
    lora = get_peft_model(inner, LoraConfig(r=2, target_modules=["q_proj"]))
    assert base_model(plain) is plain
    assert base_model(lora) is inner and isinstance(base_model(lora), Qwen2ForCausalLM)
    assert base_model(torch.compile(lora)) is inner  # the compiled module forwards get_base_model
