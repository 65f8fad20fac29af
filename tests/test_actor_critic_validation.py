"""Clear errors for bad actor-critic input, raised when the config or trainer is built."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig


ITEMS = Dataset.from_dict({"prompt": ["a", "b"]})


def _reward(first, second):
    return [0.0] * len(first)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"critic_type": "advantage"}, "critic_type must be 'v'"),
        ({"value_loss_coef": 0.0}, "value_loss_coef must be > 0"),
        ({"value_clip_range": -0.1}, "value_clip_range must be > 0 or None"),
        ({"critic_learning_rate": 0.0}, "critic_learning_rate must be > 0 or None"),
        ({"joint_mode": "cross"}, "joint_mode='align'"),
        ({"num_generations": 0}, "num_generations must be an integer >= 1"),
        ({"value_head_hidden_dim": 0}, "value_head_hidden_dim must be a positive integer or None"),
        ({"critic_value_head_hidden_dim": 2.5}, "critic_value_head_hidden_dim must be a positive integer"),
        (
            {"num_generations": 3, "per_device_train_batch_size": 4},
            r"generation_batch_size \(4\) must be divisible by num_generations \(3\)",
        ),
    ],
)
def test_config_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config = IACConfig(output_dir=str(tmp_path), report_to="none", **overrides)
        IACTrainer(agent_model="unused", critic_model="unused", reward_func=_reward, train_dataset=ITEMS, args=config)


def test_config_defaults(tmp_path):
    iac = IACConfig(output_dir=str(tmp_path))
    assert (iac.num_generations, iac.per_device_train_batch_size, iac.critic_type) == (1, 8, "v")
    assert iac.critic_learning_rate == iac.learning_rate == 5e-6 and iac.advantage_normalization is True
    assert IACConfig(output_dir=str(tmp_path), num_generations=3).per_device_train_batch_size == 9
    assert MAACConfig(output_dir=str(tmp_path), critic_type="Q").critic_type == "q"
    assert not hasattr(MAACConfig(output_dir=str(tmp_path)), "use_separate_critic")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"agents": ["q", "q"], "critic_model": "q"}, "needs tokenizer=... when agents are given"),
        ({"critic_model": "Q", "args": {"use_separate_critic": False}}, "leave critic_model and critics unset"),
        ({"critics": ["Q", "Q"], "args": {"use_separate_critic": False}}, "leave critic_model and critics unset"),
        ({}, r"needs critic_model \(copied for every agent\) or critics \(one per agent, 2 here\)"),
        ({"critics": ["Q"]}, "critics has 1 entries for 2 agents"),
        ({"critics": "Q"}, "critics must be a non-empty list"),
        ({"critic_model": "other", "critics": ["Q", "Q"]}, "critic_model and critics conflict"),
        (
            {"critic_model": "Q", "model_config": {"torch_dtype": "float32", "bogus": 1}},
            r"Unknown model_config keys \['bogus'\]",
        ),
        ({"critic_model": "Q", "args": MAGRPOConfig}, "args must be a IACConfig"),
        ({"critic_model": "Q", "metrics_callback": "not callable"}, "metrics_callback must be a callable"),
    ],
)
def test_iac_construction_errors(qwen_path, tmp_path, kwargs, message):
    kwargs = {
        key: (
            [qwen_path if v == "Q" else v for v in value]
            if isinstance(value, list)
            else qwen_path
            if value == "Q"
            else value
        )
        for key, value in kwargs.items()
    }
    kwargs.setdefault("agent_model", None if "agents" in kwargs else qwen_path)
    args = kwargs.pop("args", {})
    kwargs["args"] = (args if isinstance(args, type) else IACConfig)(
        output_dir=str(tmp_path), **(args if isinstance(args, dict) else {})
    )
    with pytest.raises((ValueError, TypeError), match=message):
        IACTrainer(reward_func=_reward, train_dataset=ITEMS, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "needs one centralised critic: pass critic_model"),
        ({"critics": ["Q", "Q"]}, "one centralised critic, but critics has 2 entries"),
        (
            {"critic_model": "Q", "model_config": {"critic_value_head_hidden_dim": 0}},
            r"model_config\['critic_value_head_hidden_dim'\] must be a positive integer",
        ),
    ],
)
def test_maac_construction_errors(qwen_path, tmp_path, kwargs, message):
    kwargs = {
        key: ([qwen_path] * len(value) if isinstance(value, list) else qwen_path if value == "Q" else value)
        for key, value in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        MAACTrainer(
            agent_model=qwen_path,
            reward_func=_reward,
            train_dataset=ITEMS,
            args=MAACConfig(output_dir=str(tmp_path)),
            **kwargs,
        )


def test_a_critic_model_object_is_copied_for_every_agent(qwen_path, tmp_path):
    critic = AutoModelForCausalLM.from_pretrained(qwen_path)
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=critic,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=IACConfig(output_dir=str(tmp_path)),
    )
    first, second = (c.model for c in trainer.critics)
    assert first is critic and second is not critic
    assert first.get_input_embeddings().weight.data_ptr() != second.get_input_embeddings().weight.data_ptr()


def test_model_config_reaches_actors_and_critics(qwen_path, tmp_path):
    trainer = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=MAACConfig(output_dir=str(tmp_path)),
        model_config={
            "dtype": "bfloat16",
            "critic_model_kwargs": {"dtype": "float32"},
            "critic_value_head_hidden_dim": 6,
        },
    )
    assert {model.dtype for model in trainer.agents} == {torch.bfloat16}
    assert trainer.critics[0].model.dtype == torch.float32
    assert trainer.critics[0].value_head.net[0].out_features == 6
