"""Shared test settings: offline, one thread, tiny models built in-process."""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from comlrl_trl.testing import tiny_model_path  # noqa: E402
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer  # noqa: E402


torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen_path():
    return tiny_model_path("qwen2")


@pytest.fixture(scope="session")
def llama_path():
    return tiny_model_path("llama")


@pytest.fixture
def prompts_dataset():
    return Dataset.from_dict(
        {"prompt": [f"Write a story about item {i}:" for i in range(8)], "target": list(range(8))}
    )


@pytest.fixture
def make_config(tmp_path):
    """A fast MAGRPOConfig for tiny models; keyword arguments override the defaults."""

    def make(config_cls=MAGRPOConfig, **overrides):
        settings = dict(
            output_dir=str(tmp_path / "out"),
            num_agents=2,
            num_generations=4,
            max_new_tokens=8,
            learning_rate=0.1,  # large, so that parameter changes are visible after a few steps
            logging_steps=1,
            gradient_checkpointing=False,
            report_to="none",
            num_train_epochs=1,
            eval_interval=0,
            seed=0,
        )
        if config_cls._default_generation_spans_updates and not (
            {"steps_per_generation", "generation_batch_size"} & overrides.keys()
        ):
            # One generation per optimiser update, TRL's default (ours samples up to two updates' items at once):
            # these tests count generations, steps, logs and evaluations per update. tests/test_generation_batching.py
            # tests our default.
            settings["steps_per_generation"] = overrides.get("gradient_accumulation_steps", 1)
        settings.update(overrides)
        return config_cls(**settings)

    return make


def _zero_reward(completions_0, completions_1):
    return [0.0] * len(completions_0)


@pytest.fixture
def make_team(qwen_path, make_config, prompts_dataset):
    """A two-agent MAGRPOTrainer on the tiny Qwen2 model and the prompts dataset; keyword arguments override
    `make_config`'s settings, `reward_func` the joint reward (0 by default), `peft_config` LoRA agents."""

    def make(reward_func=_zero_reward, peft_config=None, **overrides):
        return MAGRPOTrainer(
            agent_model=qwen_path,
            num_agents=2,
            reward_func=reward_func,
            args=make_config(**overrides),
            train_dataset=prompts_dataset,
            peft_config=peft_config,
        )

    return make
