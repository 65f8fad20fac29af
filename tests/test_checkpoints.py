"""Checkpoints: exact resume, crash safety, refusals, TRL's save_strategy path, stateful objects, metadata."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import length_ratio_reward
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback

from comlrl_trl.trainers.reinforce import MAGRPOTrainer, MARLOOConfig, MARLOOTrainer
from comlrl_trl.utils import read_checkpoint_metadata


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _trainer(path, make_config, epochs, trainer_cls=MAGRPOTrainer, **kwargs):
    config = dict(
        num_train_epochs=epochs,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        eval_interval=2,
    )
    config.update(kwargs.pop("config", {}))
    return trainer_cls(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        eval_dataset=ITEMS,
        args=make_config(**config),
        **kwargs,
    )


def _rewards(trainer, key="turn_1/reward_mean"):
    return [row[key] for row in trainer.state.log_history if key in row]


def _assert_same_weights(a, b):
    for model_a, model_b in zip(a.agents, b.agents, strict=True):
        for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_three_epochs_equal_one_plus_resumed_two(qwen_path, make_config, tmp_path):
    straight = _trainer(qwen_path, make_config, 3)
    straight.train()
    first = _trainer(qwen_path, make_config, 1)
    first.train(checkpoint_dir=tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1"]
    resumed = _trainer(qwen_path, make_config, 3)  # num_train_epochs counts the whole run
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"), checkpoint_dir=tmp_path / "ckpt")

    _assert_same_weights(straight, resumed)
    assert _rewards(resumed) == _rewards(straight) and len(_rewards(straight)) == 3 * 4
    assert _rewards(resumed, "eval/turn_1/reward_mean") == _rewards(straight, "eval/turn_1/reward_mean")
    assert resumed.env_step == straight.env_step == 3 * 4 * 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_checkpoint_layout_and_metadata(qwen_path, make_config, tmp_path):
    trainer = _trainer(qwen_path, make_config, 3)
    trainer.train(checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=2)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-2", "checkpoint-3"]  # every 2nd epoch, the end
    checkpoint = tmp_path / "ckpt" / "checkpoint-3"
    for i in range(2):
        files = set(os.listdir(checkpoint / f"agent_{i}"))
        assert {"model.safetensors", "tokenizer.json", "optimizer.pt", "scheduler.pt"} <= files
    metadata = read_checkpoint_metadata(checkpoint)
    assert metadata["trainer_class"].endswith("MAGRPOTrainer") and metadata["sequence"] == 3
    assert len(metadata["run_id"]) == 32 and metadata["wandb"] is None
    assert read_checkpoint_metadata(tmp_path / "ckpt" / "checkpoint-2")["run_id"] == metadata["run_id"]
    with pytest.raises(FileNotFoundError, match="not a complete"):
        read_checkpoint_metadata(tmp_path)


def test_no_checkpoint_without_options(qwen_path, make_config, tmp_path):
    trainer = _trainer(qwen_path, make_config, 1)
    trainer.train()
    output_dir = Path(trainer.args.output_dir)
    assert not output_dir.exists() or not any(p.name.startswith("checkpoint") for p in output_dir.iterdir())


def test_increasing_epochs_on_resume_runs_only_the_new_ones(qwen_path, make_config, tmp_path):
    _trainer(qwen_path, make_config, 2).train(checkpoint_dir=tmp_path / "ckpt")
    resumed = _trainer(qwen_path, make_config, 3)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "ckpt")
    assert resumed.state.global_step == 3 * 4 and resumed.env_step == 3 * 4 * 2
    assert len([row for row in resumed.state.log_history if "agent_0/loss" in row]) == 12
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_run_stopped_inside_an_epoch_names_its_checkpoint_after_that_epoch(qwen_path, make_config, tmp_path, caplog):
    """checkpoint-N: N is the epoch the checkpoint was taken in, counted from 1 (4 updates per epoch here)."""
    _trainer(qwen_path, make_config, 3, config=dict(max_steps=2)).train(checkpoint_dir=tmp_path / "a")
    assert os.listdir(tmp_path / "a") == ["checkpoint-1"]  # 2 of epoch 1's 4 updates (it was checkpoint-0)
    assert read_checkpoint_metadata(tmp_path / "a" / "checkpoint-1")["global_step"] == 2
    _trainer(qwen_path, make_config, 3, config=dict(max_steps=6)).train(checkpoint_dir=tmp_path / "b")
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-1", "checkpoint-2"]  # epoch 1's end, step 6 in epoch 2
    resumed = _trainer(qwen_path, make_config, 1)
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "a")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Resuming from")]
    assert said == [f"Resuming from {tmp_path / 'a' / 'checkpoint-1'} at step 2 (epoch 0.5 of 1)."]
    assert os.listdir(tmp_path / "a") == ["checkpoint-1"]  # epoch 1 completed: the same run's checkpoint-1, replaced
    assert read_checkpoint_metadata(tmp_path / "a" / "checkpoint-1")["global_step"] == 4


def test_logging_steps_counts_optimiser_updates(qwen_path, make_config, tmp_path):
    """As in TRL: a log every logging_steps-th update (and the first); each update here scores 2 joint actions."""
    trainer = _trainer(qwen_path, make_config, 2, config=dict(logging_steps=3))
    trainer.train()
    logged = [(row["step"], row["env_step"]) for row in trainer.state.log_history if "agent_0/loss" in row]
    assert logged == [(1, 2), (3, 6), (6, 12)]  # counting env_step, it logged at steps 1, 3, 5, 7


def test_total_limit_keeps_the_newest(qwen_path, make_config, tmp_path):
    _trainer(qwen_path, make_config, 3).train(checkpoint_dir=tmp_path / "ckpt", checkpoint_total_limit=1)
    assert os.listdir(tmp_path / "ckpt") == ["checkpoint-3"]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_checkpoint_interval(qwen_path, make_config, tmp_path, bad):
    with pytest.raises(ValueError, match="checkpoint_interval"):
        _trainer(qwen_path, make_config, 1).train(checkpoint_dir=tmp_path, checkpoint_interval=bad)


def test_refusals(qwen_path, llama_path, make_config, tmp_path):
    _trainer(qwen_path, make_config, 1).train(checkpoint_dir=tmp_path / "run")
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    other_class = MARLOOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(MARLOOConfig, num_generations=2, max_new_tokens=6),
    )
    with pytest.raises(ValueError, match="trainer_class"):
        other_class.train(resume_from_checkpoint=checkpoint)
    for config, field in [(dict(num_generations=4), "num_generations"), (dict(joint_mode="cross"), "joint_mode")]:
        with pytest.raises(ValueError, match=field):
            _trainer(qwen_path, make_config, 2, config=config).train(resume_from_checkpoint=checkpoint)

    three = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=3,
        reward_func=lambda a, b, c: [0.0] * len(a),
        train_dataset=ITEMS,
        args=make_config(num_agents=3, num_generations=2, max_new_tokens=6),
    )
    with pytest.raises(ValueError, match="num_agents"):
        three.train(resume_from_checkpoint=checkpoint)
    mixed = MAGRPOTrainer(
        agents=[qwen_path, llama_path],
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(num_generations=2, max_new_tokens=6),
    )
    with pytest.raises(ValueError, match="models"):
        mixed.train(resume_from_checkpoint=checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    retemplated = _trainer(qwen_path, make_config, 2, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tokenizers"):
        retemplated.train(resume_from_checkpoint=checkpoint)
    with pytest.raises(FileExistsError, match="another run"):  # a fresh run into a directory of another run
        _trainer(qwen_path, make_config, 1).train(checkpoint_dir=tmp_path / "run")


class CountingCallback(TrainerCallback):
    """A stateful callback: counts optimiser steps across resumes."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class CountingReward:
    def __init__(self):
        self.calls = 0

    def __call__(self, first, second):
        self.calls += 1
        return [float(len(b) - len(a)) for a, b in zip(first, second)]

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_stateful_callbacks_and_reward_functions(qwen_path, make_config, tmp_path):
    def build(epochs):
        callback, reward = CountingCallback(), CountingReward()
        trainer = MAGRPOTrainer(
            agent_model=qwen_path,
            reward_func=reward,
            train_dataset=ITEMS,
            callbacks=[callback],
            args=make_config(num_train_epochs=epochs, num_generations=2, max_new_tokens=6),
        )
        return trainer, callback, reward

    trainer, callback, reward = build(1)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    assert (callback.steps, reward.calls) == (4, 4)
    trainer, callback, reward = build(2)
    trainer.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "ckpt")
    assert (callback.steps, reward.calls) == (8, 8)  # restored, then 4 more each


class _StandInScaler:
    """Stands in for a gradient scaler (Accelerate makes real ones only for fp16 on a GPU): `scale` leaves the loss
    as it is, so training is unchanged; only its state travels through checkpoints."""

    def __init__(self, value):
        self.value = value

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    def update(self):
        pass

    def state_dict(self):
        return {"scale": self.value}

    def load_state_dict(self, state):
        self.value = state["scale"]


def test_every_agents_gradient_scaler_is_saved_and_restored(qwen_path, make_config, tmp_path):
    first = _trainer(qwen_path, make_config, 1, config=dict(eval_interval=0))
    for i, agent in enumerate(first.agent_trainers):
        agent.accelerator.scaler = _StandInScaler(2.0 ** (8 + i))
    first.train(checkpoint_dir=tmp_path / "ckpt")
    (checkpoint,) = [name for name in os.listdir(tmp_path / "ckpt") if name.startswith("checkpoint-")]
    for i in (0, 1):  # each agent's scaler beside its optimiser, agent 0 included
        saved = torch.load(tmp_path / "ckpt" / checkpoint / f"agent_{i}" / "scaler.pt", weights_only=True)
        assert saved == {"scale": 2.0 ** (8 + i)}
    resumed = _trainer(qwen_path, make_config, 2, config=dict(eval_interval=0))
    for agent in resumed.agent_trainers:
        agent.accelerator.scaler = _StandInScaler(1.0)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "ckpt")
    assert [agent.accelerator.scaler.value for agent in resumed.agent_trainers] == [256.0, 512.0]


def test_trl_save_strategy_with_lora_agents(qwen_path, make_config, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    settings = dict(save_strategy="steps", save_steps=3, save_total_limit=2, output_dir=str(tmp_path / "out"))
    straight = _trainer(qwen_path, make_config, 2, peft_config=lora, config=dict(eval_interval=0))
    straight.train()
    interrupted = _trainer(
        qwen_path, make_config, 2, peft_config=lora, config=dict(max_steps=5, eval_interval=0, **settings)
    )
    interrupted.train()
    assert sorted(n for n in os.listdir(tmp_path / "out") if not n.startswith(".")) == ["checkpoint-3", "checkpoint-5"]
    adapter = tmp_path / "out" / "checkpoint-5" / "agent_1"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "optimizer.pt").is_file()
    resumed = _trainer(qwen_path, make_config, 2, peft_config=lora, config=dict(eval_interval=0, **settings))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))  # mid-epoch resume
    _assert_same_weights(straight, resumed)
    assert _rewards(resumed) == _rewards(straight)


def _run(script_args, tmp_path):
    script = Path(__file__).parent / "scripts" / "checkpoint_run.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run(
        [sys.executable, str(script), *script_args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("kill", [["--kill-while-saving", "2"], ["--kill-before-epoch", "3"]])
def test_sigkill_then_resume_from_latest_complete_checkpoint(tmp_path, kill):
    straight = _run([str(tmp_path / "straight"), str(tmp_path / "straight.json")], tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]

    crashed = _run([str(tmp_path / "ckpt"), str(tmp_path / "crashed.json"), *kill], tmp_path)
    assert crashed.returncode == -9  # SIGKILL
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert ".comlrl_trl.lock" in names  # left by the killed run: its flock died with it, so it blocks nothing
    if kill[0] == "--kill-while-saving":
        assert "checkpoint-1" in names and "checkpoint-2" not in names
        assert any(re.fullmatch(r"\.checkpoint-2\.[0-9a-f]{16}\.partial", name) for name in names)
    else:
        assert {"checkpoint-1", "checkpoint-2"} <= set(names)
    assert read_checkpoint_metadata(tmp_path / "ckpt" / "checkpoint-1")["sequence"] == 1  # nothing earlier lost

    resumed = _run([str(tmp_path / "ckpt"), str(tmp_path / "resumed.json"), "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = json.loads((tmp_path / "straight.json").read_text())
    result = json.loads((tmp_path / "resumed.json").read_text())
    assert result == expected  # same weights, same logged rewards, same env_step
    assert {"checkpoint-1", "checkpoint-2", "checkpoint-3"} <= set(os.listdir(tmp_path / "ckpt"))
    assert not [name for name in os.listdir(tmp_path / "ckpt") if name.startswith(".")]  # staging and lock cleaned


def test_multi_turn_resume_is_exact(qwen_path, make_config, tmp_path):
    def transition(*, agent_completions, **kwargs):
        return [f"Improve: {text[:20]}" for text in agent_completions]

    def build(epochs):
        return _trainer(
            qwen_path, make_config, epochs, external_transition=transition, config=dict(num_turns=2, discount=0.9)
        )

    straight = build(2)
    straight.train()
    build(1).train(checkpoint_dir=tmp_path / "ckpt")
    resumed = build(2)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "ckpt")
    _assert_same_weights(straight, resumed)
    for key in ("turn_1/reward_mean", "turn_2/expected_return", "eval/turn_2/reward_mean"):
        assert _rewards(resumed, key) == _rewards(straight, key) and _rewards(straight, key)
