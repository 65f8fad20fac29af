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
