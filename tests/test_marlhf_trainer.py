"""MARLHF and iterative MARLHF on tiny offline models: pairs, the joint reward model, online RL against it,
evaluation with the task reward, every RL algorithm, re-initialisation per iteration, checkpoints and resume."""

import copy
import gc
import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import changed, snapshot
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import RewardConfig

from comlrl_trl.joint_text import joint_text
from comlrl_trl.trainers.preference import (
    JointRewardTrainer,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterTrainer,
    MARLHFTrainer,
    PreferencePair,
)
from comlrl_trl.trainers.preference.reward_model import RewardModelScorer, load_reward_backbone, load_reward_tokenizer
from comlrl_trl.utils import RewardProcessors, read_checkpoint_metadata


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def length_reward(first, second):
    """A task reward with ties: the second answer's length bucket minus the first's."""
    return [float(len(b) // 8 - len(a) // 8) for a, b in zip(first, second)]


def _config(make_config, config_cls=MARLHFConfig, **overrides):
    settings = dict(
        config_cls=config_cls,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_learning_rate=1e-3,
        reward_num_train_epochs=2,
        # TRL's full-distribution sampling: a tiny random model's candidates at T 0.6 / top-p 0.6 often tie, and
        # tied candidates form no preference pair.
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    settings.update(overrides)
    return make_config(**settings)


def _trainer(path, make_config, trainer_cls=MARLHFTrainer, reward_func=length_reward, **kwargs):
    config = kwargs.pop("config", {})
    config_cls = MARLHFIterConfig if issubclass(trainer_cls, MARLHFIterTrainer) else MARLHFConfig
    return trainer_cls(
        agent_model=path,
        reward_func=reward_func,
        train_dataset=ITEMS,
        args=_config(make_config, config_cls, **config),
        **kwargs,
    )


def _logged(history, key):
    return [row[key] for row in history if key in row]


def _score_alone(model, tokenizer, text):
    """The reward model's score of one text, without batching or padding: the independent reference."""
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0, 0].item()


# ----- the reward model -----


def test_reward_model_scores_under_no_grad_not_inference_mode(qwen_path):
    """ZeRO-3's parameter hooks gather and release the weights in place during the forward, which inference mode
    forbids on tensors created outside it: the scorer uses no_grad, as TRL's reward scoring does."""
    tokenizer = load_reward_tokenizer(qwen_path)
    model = load_reward_backbone(qwen_path, tokenizer, seed=0)
    modes = []
    model.register_forward_pre_hook(
        lambda module, args: modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    )
    scores = RewardModelScorer(model, tokenizer, max_length=None, batch_size=2).score(["a b", "c", "d e f"])
    assert len(scores) == 3
    assert modes == [(False, False), (False, False)]  # 2 batches of at most 2 texts; no graph, no inference mode


def test_reward_model_separates_toy_pairs(qwen_path, tmp_path):
    tokenizer = load_reward_tokenizer(qwen_path)
    model = load_reward_backbone(qwen_path, tokenizer, seed=0)
    chosen = [joint_text([f"Task {i}", f"Task {i}"], [f"answer {i}", "all good"]) for i in range(8)]
    rejected = [joint_text([f"Task {i}", f"Task {i}"], [f"answer {i}", "all bad"]) for i in range(8)]
    scorer = RewardModelScorer(model, tokenizer, max_length=None)
    before = sum(c > r for c, r in zip(scorer.score(chosen), scorer.score(rejected))) / 8
    args = RewardConfig(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        num_train_epochs=4,
        per_device_train_batch_size=2,
        max_length=None,
        use_cpu=True,
        bf16=False,
        center_rewards_coefficient=0.01,
    )
    trainer = JointRewardTrainer(
        model=model.train().requires_grad_(True),
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"chosen": chosen, "rejected": rejected, "margin": [0.5] * 8}),
    )
    assert trainer.train_dataset.column_names == ["margin", "chosen_ids", "rejected_ids"]
    assert trainer.train_dataset[0]["chosen_ids"][-1] == tokenizer.eos_token_id
    trainer.train()
    scorer = RewardModelScorer(trainer.model, tokenizer, max_length=None)
    scores_chosen, scores_rejected = scorer.score(chosen), scorer.score(rejected)
    accuracy = sum(c > r for c, r in zip(scores_chosen, scores_rejected)) / 8
    assert before < 1.0 and accuracy == 1.0
    # Batched, right-padded scoring equals scoring every text alone.
    alone = [_score_alone(trainer.model, tokenizer, text) for text in chosen]
    assert scores_chosen == pytest.approx(alone, abs=1e-5)


def test_frozen_backbone_and_lora_train_only_what_they_should(qwen_path, tmp_path):
    tokenizer = load_reward_tokenizer(qwen_path)
    rows = Dataset.from_dict({"chosen": ["x good", "y good"], "rejected": ["x bad", "y bad"]})

    def run(model, **kwargs):
        args = RewardConfig(
            output_dir=str(tmp_path),
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            learning_rate=1e-2,
            num_train_epochs=2,
            per_device_train_batch_size=2,
            max_length=None,
            use_cpu=True,
            bf16=False,
        )
        trainer = JointRewardTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer, **kwargs)
        before = snapshot(trainer.model)
        trainer.train()
        return before, changed(before, trainer.model)

    before, moved = run(load_reward_backbone(qwen_path, tokenizer, 0), freeze_backbone=True)
    assert set(before) == moved == {"score.weight"}
    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    before, moved = run(load_reward_backbone(qwen_path, tokenizer, 0), peft_config=lora)
    assert moved == set(before) and moved and all("lora_" in n or "score" in n for n in moved)
    with pytest.raises(ValueError, match="only the head"):
        run(load_reward_backbone(qwen_path, tokenizer, 0), peft_config=lora, freeze_backbone=True)


def test_reward_model_is_loaded_without_a_device_map(qwen_path, monkeypatch):
    """On CUDA, TRL's create_model_from_path defaults to device_map="auto", which Accelerate refuses for a model
    trained under DDP or DeepSpeed (and ZeRO-3 partitions the weights itself): the reward model asks for none."""
    from types import SimpleNamespace

    from transformers import AutoModelForSequenceClassification
    from trl.trainer import utils as trl_utils

    monkeypatch.setattr(trl_utils, "PartialState", lambda: SimpleNamespace(device=torch.device("cuda")))
    seen = []
    load = AutoModelForSequenceClassification.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("device_map", "missing"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", classmethod(spy))
    tokenizer = load_reward_tokenizer(qwen_path)
    model = load_reward_backbone(qwen_path, tokenizer, seed=0)
    assert seen == [None] and next(model.parameters()).device.type == "cpu"


def test_reward_model_rows_and_margin():
    pair = PreferencePair(3, ["p1", "p2"], ["a", "b"], ["c", "d"], 2.0, 0.5, 1.0)
    row = pair.reward_model_row(joint_text, use_margin=True)
    assert row == {
        "chosen": joint_text(["p1", "p2"], ["a", "b"]),
        "rejected": joint_text(["p1", "p2"], ["c", "d"]),
        "margin": 1.5,
    }
    assert "margin" not in pair.reward_model_row(joint_text, use_margin=False)
    assert (
        row["chosen"] == "[Agent 1 prompt]\np1\n\n[Agent 1 response]\na\n\n[Agent 2 prompt]\np2\n\n"
        "[Agent 2 response]\nb"
    )


# ----- pairs -----


@pytest.mark.parametrize("selection, cap", [("reward_gap", 2), ("all", None), ("random", 3)])
def test_pairs_drop_ties_and_respect_the_cap(qwen_path, make_config, selection, cap):
    trainer = _trainer(
        qwen_path,
        make_config,
        config=dict(
            pair_selection=selection, preference_pairs_per_sample=cap, preference_num_candidates=5, max_new_tokens=16
        ),
    )
    pairs, mean, _ = trainer._collect_pairs(0)
    assert trainer.rl_trainer.env_step == 5 * 4  # every candidate of every item scored once
    by_item = {}
    for pair in pairs:
        by_item.setdefault(pair.item_index, []).append(pair)
        assert pair.prompts == [ITEMS[pair.item_index]["prompt"]] * 2
        assert pair.chosen_reward > pair.rejected_reward  # ties never form a pair
        assert length_reward([pair.chosen[0]], [pair.chosen[1]]) == [pair.chosen_reward]
        assert length_reward([pair.rejected[0]], [pair.rejected[1]]) == [pair.rejected_reward]
    assert pairs and sorted(by_item) == sorted(set(by_item)) and set(by_item) <= {0, 1, 2, 3}
    for item_pairs in by_item.values():
        assert cap is None or len(item_pairs) <= cap
        if selection == "reward_gap":
            gaps = [p.chosen_reward - p.rejected_reward for p in item_pairs]
            assert gaps == sorted(gaps, reverse=True)
    assert math.isfinite(mean)
    again = _trainer(
        qwen_path,
        make_config,
        config=dict(
            pair_selection=selection, preference_pairs_per_sample=cap, preference_num_candidates=5, max_new_tokens=16
        ),
    )
    assert again._collect_pairs(0)[0] == pairs  # seeded: the same pairs again


def test_no_pairs_is_an_error_that_tells_ties_from_a_single_answer(qwen_path, make_config):
    def constant(first, second):
        return [1.0] * len(first)

    tied = _trainer(qwen_path, make_config, reward_func=constant, config=dict(max_new_tokens=16))
    with pytest.raises(ValueError, match="No preference pairs in iteration 1") as error:
        tied.train()
    assert "a reward that tells the candidates apart" in str(error.value)
    assert "one and the same text" not in str(error.value)  # sampled at T 1 over 16 tokens, the candidates differ

    # top_k=1 samples the most likely token only: every item's 4 joint candidates are one text.
    greedy = _trainer(qwen_path, make_config, config=dict(top_k=1))
    pairs, _, collapsed = greedy._collect_pairs(0)
    assert pairs == [] and collapsed == len(ITEMS) == 4
    with pytest.raises(ValueError, match="In 4 of the 4 items the 4 joint candidates were one and the same text"):
        greedy.train()


def test_joint_formatter_replaces_the_joint_text_everywhere(qwen_path, make_config):
    def compact(prompts, completions):
        return " | ".join(completions)

    trainer = _trainer(qwen_path, make_config, joint_formatter=compact)
    pairs, _, _ = trainer._collect_pairs(0)
    assert pairs[0].reward_model_row(trainer.joint_formatter, False)["chosen"] == " | ".join(pairs[0].chosen)
    assert trainer.learned_reward.joint_texts(ITEMS[0], [["a", "b"], ["c", "d"]]) == ["a | c", "b | d"]
    default = _trainer(qwen_path, make_config)
    assert default.learned_reward.joint_texts(ITEMS[0], [["a"], ["c"]]) == [
        joint_text([ITEMS[0]["prompt"]] * 2, ["a", "c"])
    ]


# ----- online RL against the learned reward -----


def test_rl_rewards_are_the_reward_models_scores_and_evaluation_uses_the_task_reward(
    qwen_path, make_config, tmp_path, monkeypatch
):
    task_calls = []

    def task_reward(first, second):
        values = length_reward(first, second)
        task_calls.append((list(first), list(second), values))
        return values

    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    trainer = _trainer(
        qwen_path,
        make_config,
        reward_func=task_reward,
        reward_processor=RewardProcessors.scale(10.0),
        eval_dataset=ITEMS,
        config=dict(eval_interval=2, eval_num_samples=2, reward_freeze_backbone=True),
    )
    orchestrator = trainer.rl_trainer.orchestrator
    rl_calls, joint = [], orchestrator.joint_reward

    def spy(agent_completions, item, label):
        rewards = joint(agent_completions, item, label)
        rl_calls.append((agent_completions, item, rewards, trainer.learned_reward._use_task_reward))
        return rewards

    monkeypatch.setattr(orchestrator, "joint_reward", spy)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()

    training = [call for call in rl_calls if not call[3]]
    assert len(training) == 4  # 4 items, one RL epoch
    model, tokenizer = trainer.reward_model, trainer.reward_tokenizer
    for (first, second), item, rewards, _ in training:
        assert len(rewards) == 2
        texts = [joint_text([item["prompt"]] * 2, [a, b]) for a, b in zip(first, second)]
        assert rewards == pytest.approx([_score_alone(model, tokenizer, text) for text in texts], abs=1e-5)
    # Evaluation scored the task reward, with its processor: 2 items before the items 0 and 2, and after training.
    evaluations = [call for call in rl_calls if call[3]]
    assert len(evaluations) == 3 * 2
    for (first, second), _, rewards, _ in evaluations:
        assert rewards == [10.0 * r for r in length_reward(first, second)]
    eval_logs = _logged(trainer.log_history, "eval/turn_1/reward_mean")
    assert eval_logs == [sum(c[2][0] for c in evaluations[i : i + 2]) / 2 for i in range(0, 6, 2)]
    # reward_freeze_backbone: the backbone is still the source's, only the head trained.
    source = AutoModelForCausalLM.from_pretrained(qwen_path).model.state_dict()
    assert all(torch.equal(model.model.state_dict()[name], value) for name, value in source.items())
    assert not torch.equal(model.score.weight, load_reward_backbone(qwen_path, tokenizer, seed=0).score.weight)
    # The pairs were ranked by the task reward; the reward model fits them.
    stage = [row for row in trainer.log_history if "reward_model/accuracy" in row][0]
    assert stage["preference/pairs"] == len(trainer.preference_pairs) <= 4 * 2
    assert 0.0 <= stage["reward_model/accuracy"] <= 1.0 and math.isfinite(stage["reward_model/loss"])
    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model), f"agent {i} did not train"
    # evaluate(num_eval_samples=...) scores that many items with the task reward.
    count = len(task_calls)
    metrics = trainer.evaluate(num_eval_samples=1)
    assert len(task_calls) == count + 1 and set(metrics) == {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
    assert metrics["eval/turn_1/reward_mean"] == 10.0 * task_calls[-1][2][0]
    trainer.save_model(str(tmp_path / "saved"))
    assert sorted(os.listdir(tmp_path / "saved")) == ["agent_0", "agent_1", "team_settings.json"]
    assert os.listdir(tmp_path / "cwd") == []


@pytest.mark.parametrize("rl_algorithm", ["magrpo", "mareinforce", "marloo", "maremax", "iac", "maac"])
def test_every_rl_algorithm_trains_every_agent(qwen_path, make_config, rl_algorithm):
    trainer = _trainer(qwen_path, make_config, config=dict(rl_algorithm=rl_algorithm))
    rl = trainer.rl_trainer
    if rl_algorithm in ("iac", "maac"):
        assert type(rl).__name__ == f"{rl_algorithm.upper()}StageTrainer" and len(rl.critics) in (1, 2)
        assert rl.args.num_generations == 2 and rl.args.max_new_tokens == 6 and rl.args.learning_rate == 0.05
    else:
        expected = {"magrpo": "mean", "mareinforce": "raw", "marloo": "rloo", "maremax": "max"}[rl_algorithm]
        assert rl.args.advantage_mode == expected
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model), f"{rl_algorithm}: agent {i} did not train"
    assert _logged(trainer.log_history, "turn_1/reward_mean")


# ----- iterations -----


class RecordingIterTrainer(MARLHFIterTrainer):
    """Records every reward model as loaded from its source."""

    def _new_reward_model(self, iteration):
        model = super()._new_reward_model(iteration)
        self.loaded = getattr(self, "loaded", []) + [
            (iteration, {k: v.clone() for k, v in model.state_dict().items()})
        ]
        return model


def test_iterative_trainer_reloads_the_reward_model_and_collects_fresh_pairs(qwen_path, make_config):
    trainer = _trainer(
        qwen_path, make_config, trainer_cls=RecordingIterTrainer, config=dict(num_iterations=2, num_train_epochs=1)
    )
    first_pairs, trained = [], []
    train_reward_model = trainer._train_reward_model

    def record(pairs, iteration):
        output = train_reward_model(pairs, iteration)
        first_pairs.append(list(pairs))
        trained.append({k: v.clone() for k, v in trainer.reward_model.state_dict().items()})
        return output

    trainer._train_reward_model = record
    trainer.train()

    assert [iteration for iteration, _ in trainer.loaded] == [0, 1]
    source = AutoModelForCausalLM.from_pretrained(qwen_path).model.state_dict()
    second = trainer.loaded[1][1]
    for name, value in source.items():  # iteration 2 starts from the source backbone, not from iteration 1's model
        assert torch.equal(second[f"model.{name}"], value), name
    assert any(not torch.equal(trained[0][name], second[name]) for name in second)
    fresh = load_reward_backbone(qwen_path, trainer.reward_tokenizer, seed=1)  # seed + iteration
    assert torch.equal(second["score.weight"], fresh.score.weight)
    assert _logged(trainer.log_history, "iter/iteration") == [1, 2]
    assert _logged(trainer.log_history, "iter/total_preference_pairs") == [
        len(first_pairs[0]),
        len(first_pairs[0]) + len(first_pairs[1]),
    ]
    assert first_pairs[0] != first_pairs[1] and trainer.preference_pairs == first_pairs[1]
    assert trainer.rl_trainer.args.num_iterations == 1  # GRPO's mu, not the preference iterations


class LiveRewardModels(MARLHFIterTrainer):
    """Counts the earlier reward models still alive when each new one is built."""

    def _new_reward_model(self, iteration):
        gc.collect()
        built = getattr(self, "built", [])
        self.alive = getattr(self, "alive", []) + [sum(ref() is not None for ref in built)]
        model = super()._new_reward_model(iteration)
        self.built = built + [weakref.ref(model)]
        return model


def test_iterative_trainer_holds_one_reward_model_at_a_time(qwen_path, make_config):
    """Iteration 2's reward model is built after iteration 1's is gone (model, scorer and trainer): before, both were
    alive while the second trained."""
    trainer = _trainer(
        qwen_path, make_config, trainer_cls=LiveRewardModels, config=dict(num_iterations=2, num_train_epochs=1)
    )
    trainer.train()
    assert trainer.alive == [0, 0]
    gc.collect()
    assert [ref() is not None for ref in trainer.built] == [False, True]  # the second one scores the RL stage
    assert trainer.learned_reward.scorer.model is trainer.reward_model


def test_an_indexed_reward_model_device_is_refused_with_several_processes():
    from comlrl_trl.trainers.preference.marlhf_trainer import _check_reward_model_device

    for device in (None, "cpu", "cuda"):  # the process's own device
        _check_reward_model_device(device, 8)
    _check_reward_model_device("cuda:1", 1)  # one process: its reward model on another GPU
    with pytest.raises(ValueError) as raised:
        _check_reward_model_device("cuda:1", 8)
    message = str(raised.value)
    assert "reward_model_device='cuda:1' with 8 processes would put every process's reward model on that" in message
    assert "Leave reward_model_device=None" in message and "'cuda' without an index" in message


# ----- checkpoints -----


def _same_weights(a, b):
    for model_a, model_b in zip(a.agents + [a.reward_model], b.agents + [b.reward_model], strict=True):
        for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
            assert torch.equal(p, q), name


class CountingReward:
    """A stateful task reward: its call count must survive a resume."""

    def __init__(self):
        self.calls = 0

    def __call__(self, first, second):
        self.calls += 1
        return length_reward(first, second)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_resume_in_the_middle_of_the_rl_stage(qwen_path, make_config, tmp_path):
    config = dict(num_train_epochs=2, eval_interval=4)
    lora = dict(reward_peft_config=LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj"]))
    straight = _trainer(
        qwen_path,
        make_config,
        config=config,
        eval_dataset=ITEMS.select(range(1)),
        **lora,
        reward_func=CountingReward(),
    )
    straight.train(checkpoint_dir=tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    first = tmp_path / "ckpt" / "checkpoint-1"
    assert sorted(os.listdir(first)) == [
        "actors",
        "comlrl_trl_checkpoint.json",
        "comlrl_trl_state.pt",
        "preference",
        "rng_state.pth",
    ]
    middle = tmp_path / "ckpt" / "checkpoint-2"
    assert {"rl", "preference"} <= set(os.listdir(middle))
    assert (
        os.stat(first / "preference" / "reward_model.safetensors").st_ino
        == os.stat(middle / "preference" / "reward_model.safetensors").st_ino
    )  # linked, not copied
    metadata = read_checkpoint_metadata(middle)
    assert metadata["trainer_class"].endswith("MARLHFTrainer") and metadata["sequence"] == 2

    resumed = _trainer(
        qwen_path,
        make_config,
        config=config,
        eval_dataset=ITEMS.select(range(1)),
        **lora,
        reward_func=CountingReward(),
    )
    resumed.train(resume_from_checkpoint=str(middle), checkpoint_dir=tmp_path / "ckpt2")
    _same_weights(straight, resumed)
    # 4 items ranked, then one evaluation item at the start of each RL epoch and after the stage
    assert resumed.task_reward.reward_func.calls == straight.task_reward.reward_func.calls == 4 + 3
    for key in ("turn_1/reward_mean", "eval/turn_1/reward_mean", "reward_model/accuracy"):
        assert _logged(resumed.log_history, key) == _logged(straight.log_history, key), key
    assert os.listdir(tmp_path / "ckpt2") == ["checkpoint-3"]


@pytest.fixture(scope="module")
def iterative_run(tmp_path_factory, qwen_path):
    root = tmp_path_factory.mktemp("iterative")
    config = MARLHFIterConfig(
        output_dir=str(root / "out"),
        num_agents=2,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        gradient_checkpointing=False,
        eval_interval=0,
        seed=0,
        num_iterations=2,
        num_train_epochs=1,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_learning_rate=1e-3,
        pair_selection="random",
        preference_output_dir=str(root / "pairs"),
        # Four items of 2 completions per RL step, and full-distribution sampling: the agents of a third iteration
        # (the resume test) still sample candidates that differ, so that they form preference pairs.
        per_device_train_batch_size=8,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    trainer = MARLHFIterTrainer(agent_model=qwen_path, reward_func=length_reward, train_dataset=ITEMS, args=config)
    trainer.train(checkpoint_dir=root / "ckpt")
    return root, trainer


@pytest.mark.parametrize("checkpoint", [2, 3])
def test_iterative_resume_matches_the_uninterrupted_run(iterative_run, qwen_path, checkpoint):
    root, straight = iterative_run
    assert sorted(os.listdir(root / "ckpt")) == [f"checkpoint-{i}" for i in range(1, 5)]
    assert sorted(os.listdir(root / "pairs"))[:2] == ["pairs_iteration_0001.json", "pairs_iteration_0002.json"]
    config = straight.args
    resumed = MARLHFIterTrainer(agent_model=qwen_path, reward_func=length_reward, train_dataset=ITEMS, args=config)
    resumed.train(
        resume_from_checkpoint=str(root / "ckpt" / f"checkpoint-{checkpoint}"),
        checkpoint_dir=root / f"resumed-{checkpoint}",
    )
    _same_weights(straight, resumed)
    assert resumed.preference_pairs == straight.preference_pairs
    for key in ("turn_1/reward_mean", "iter/iteration", "preference/pairs", "reward_model/accuracy"):
        assert _logged(resumed.log_history, key) == _logged(straight.log_history, key), key
    if checkpoint == 2:  # iteration 2's pairs were collected again: into a resume-* directory, not over the files
        with open(root / "pairs" / "resume-2" / "pairs_iteration_0002.json") as f:
            assert [PreferencePair(**row) for row in json.load(f)] == straight.preference_pairs


def test_iterative_num_iterations_may_grow_on_resume(iterative_run, qwen_path):
    root, straight = iterative_run
    config = copy.deepcopy(straight.args)
    config.num_iterations = 3  # the run had 2 preference iterations; one more is added
    resumed = MARLHFIterTrainer(agent_model=qwen_path, reward_func=length_reward, train_dataset=ITEMS, args=config)
    resumed.train(resume_from_checkpoint=str(root / "ckpt" / "checkpoint-4"), checkpoint_dir=root / "grown")
    assert _logged(resumed.log_history, "iter/iteration") == [1, 2, 3]


# ----- construction errors -----


def test_construction_errors_name_the_argument(qwen_path, make_config):
    model = AutoModelForCausalLM.from_pretrained(qwen_path)
    tokenizer = AutoTokenizer.from_pretrained(qwen_path, padding_side="left")
    with pytest.raises(ValueError, match="reward_model_name must be set"):
        MARLHFTrainer(
            agents=[model, model],
            tokenizer=tokenizer,
            reward_func=length_reward,
            train_dataset=ITEMS,
            args=_config(make_config),
        )
    with pytest.raises(ValueError, match="critic_model only apply to rl_algorithm 'iac' or 'maac'"):
        _trainer(qwen_path, make_config, critic_model=qwen_path)
    with pytest.raises(ValueError, match="critic_model_name must be set"):
        MARLHFTrainer(
            agents=[model, model],
            tokenizer=tokenizer,
            reward_func=length_reward,
            train_dataset=ITEMS,
            args=_config(make_config, rl_algorithm="maac", reward_model_name=qwen_path),
        )
    with pytest.raises(ValueError, match="reward_freeze_backbone=True"):
        _trainer(
            qwen_path,
            make_config,
            config=dict(reward_freeze_backbone=True),
            reward_peft_config=LoraConfig(task_type="SEQ_CLS"),
        )
    with pytest.raises(TypeError, match="train_dataset must be a datasets.Dataset"):
        MARLHFTrainer(
            agent_model=qwen_path, reward_func=length_reward, train_dataset=list(ITEMS), args=_config(make_config)
        )
    with pytest.raises(TypeError, match="joint_formatter"):
        _trainer(qwen_path, make_config, joint_formatter="text")
    with pytest.raises(TypeError, match="args must be a MARLHFConfig"):
        MARLHFTrainer(agent_model=qwen_path, reward_func=length_reward, train_dataset=ITEMS, args=make_config())


class _SavesOnly:
    """A user object with state_dict but no load_state_dict: its state could be saved but never restored."""

    def __init__(self, function):
        self.function = function

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def state_dict(self):
        return {}


@pytest.mark.parametrize(
    "argument, value",
    [("reward_func", _SavesOnly(length_reward)), ("joint_formatter", _SavesOnly(joint_text))],
)
def test_a_half_stateful_object_is_refused_at_construction(qwen_path, make_config, argument, value):
    """MARLHF's own user objects follow the team's rule when the trainer is built, not at its first checkpoint (or
    never, without checkpoint_dir)."""
    with pytest.raises(TypeError, match=rf"{argument} \(_SavesOnly\) defines state_dict\(\) but not load_state_dict"):
        _trainer(qwen_path, make_config, **{argument: value})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rl_algorithm="ppo"), "rl_algorithm must be one of"),
        (dict(preference_num_candidates=1), "preference_num_candidates must be an integer >= 2"),
        (dict(preference_pairs_per_sample=0), "preference_pairs_per_sample must be a positive integer or None"),
        (dict(pair_selection="all"), "must be None with pair_selection='all'"),
        (dict(num_generations=1), "num_generations must be >= 2"),
        (dict(reward_learning_rate=0.0), "reward_learning_rate must be > 0"),
        (dict(reward_max_length=1), "reward_max_length must be >= 2"),
        (dict(reward_model_device="gpu9"), "reward_model_device='gpu9' is not a torch device"),
        (dict(advantage_mode="max"), "conflicts with rl_algorithm='magrpo'"),
        (dict(critic_type="z"), "critic_type must be 'v' or 'q'"),
        (dict(joint_mode="cross"), "joint_mode='align' only"),
    ],
)
def test_config_errors_name_the_field(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(make_config, **overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_iterations=0), "num_iterations must be an integer >= 1"),
        (dict(rl_num_iterations=0), "rl_num_iterations must be an integer >= 1"),
    ],
)
def test_iter_config_errors(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(make_config, MARLHFIterConfig, **overrides)


# ----- two processes -----

_DDP_SCRIPT = """
import json, sys
import torch.distributed as dist
from datasets import Dataset
from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer


def reward(first, second):
    return [float(len(b) // 4 - len(a) // 4) for a, b in zip(first, second)]


def sums(models):
    return [sum(p.detach().double().sum().item() for p in model.parameters()) for model in models]


out = sys.argv[1]
items = Dataset.from_dict({"prompt": [f"Item {i}: tell me" for i in range(4)]})
common = dict(num_generations=2, max_new_tokens=8, learning_rate=0.05, logging_steps=1, report_to="none",
              gradient_checkpointing=False, num_train_epochs=1, eval_interval=1, preference_num_candidates=4,
              preference_pairs_per_sample=2, temperature=1.0, top_p=1.0, top_k=0)  # diverse candidates: no ties
marlhf = MARLHFTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=items,
                       eval_dataset=items.select(range(2)),
                       args=MARLHFConfig(output_dir=out + "/marlhf", reward_learning_rate=1e-3, **common))
start = sums(marlhf.agents)
marlhf.train(checkpoint_dir=out + "/ckpt")
common.pop("num_generations")
madpo = MADPOTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=items,
                     args=MADPOConfig(output_dir=out + "/madpo", **common))
madpo.train()
rank = (sums(marlhf.agents), sums([marlhf.reward_model]), [p.item_index for p in marlhf.preference_pairs],
        sums(madpo.agents))
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, rank)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"ranks": gathered, "start": start, "pairs": marlhf.log_history[0]["preference/pairs"]}))
dist.destroy_process_group()  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
"""


def test_two_processes_collect_pairs_once_and_stay_in_sync(tmp_path):
    script = tmp_path / "preference_ddp.py"
    script.write_text(_DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(tmp_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    # The rank that failed first prints its traceback first; the survivor's (a closed gloo connection) comes last.
    assert result.returncode == 0, result.stderr[:6000] + "\n...\n" + result.stderr[-2000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    first, second = report["ranks"]
    assert first == second  # agents, reward model, pairs and MADPO agents identical on both ranks
    assert first[2] == sorted(first[2]) and set(first[2]) <= {0, 1, 2, 3} and report["pairs"] == len(first[2])
    assert first[0] != report["start"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1", "checkpoint-2"]
