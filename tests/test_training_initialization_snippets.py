"""Every code snippet of the "Training Initialization" page (spec 002), plus the MAGRPO snippets of the
"Training entities" page (spec 003), run against comlrl_trl.

The snippets are copied as written, with `comlrl` -> `comlrl_trl`, a tiny local model in place of the hub ids, and
only the settings a CPU test needs added to the configs: `max_new_tokens=8`, an `output_dir` under the test's
temporary directory, `report_to="none"` and `gradient_checkpointing=False`. Where a snippet shows a dataset, the
tests may use a two-item `select` of it so that every training run takes a few seconds.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import snapshot
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_callback import ProgressCallback

from comlrl_trl.integrations.progress import TeamProgressCallback
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl_trl.utils.reward_processor import RewardProcessors


# Settings every training config in this file adds to the snippet's own (see the module docstring).
def _fast(tmp_dir, **overrides):
    return dict(max_new_tokens=8, output_dir=str(tmp_dir), report_to="none", gradient_checkpointing=False, **overrides)


# ===== Page 002, "Task Sets" =====

tasks = Dataset.from_dict(
    {
        "prompt": [
            "Describe a city in the clouds.",
            "Invent a new holiday.",
            "Write a bedtime story for a dragon.",
            "Explain how teleportation might work.",
            "Tell a story about dinosaurs.",
            "Describe a world without electricity.",
            "Create a superhero with a unique power.",
            "Write a scene where the moon talks.",
            "Invent a new type of fruit.",
            "Design a playground on Mars.",
        ],
        "target_min": [2.0] * 10,
        "target_max": [3.0] * 10,
    }
)

split = tasks.train_test_split(test_size=0.2, seed=42)
train_dataset = split["train"]
eval_dataset = split["test"]


# ===== Page 002, "Prompts from Tasks" =====


def brief_formatter(item):
    return f"Write a short response to this task:\n{item['prompt']}"


def detailed_formatter(item):
    return f"Write a detailed response to this task:\n{item['prompt']}"


formatters = [brief_formatter, detailed_formatter]


# ===== Page 002, "Rule-Based Rewards" =====


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


# ===== Page 002, "Custom Metrics" =====


def eval_logger(*, agent_completions_turns, batch_items, prompts):
    return [
        {
            f"turn_{turn + 1}/response_chars": sum(len(agent[row][turn]) for agent in agent_completions_turns)
            / len(agent_completions_turns)
            for turn in range(len(agent_completions_turns[0][row]))
        }
        for row in range(len(batch_items))
    ]


def eval_aggregator(rows, *, num_turns):
    return (
        {
            key: sum(row[key] for row in rows) / len(rows)
            for turn in range(num_turns)
            for key in [f"turn_{turn + 1}/response_chars"]
        }
        if rows
        else {}
    )


EVAL_KEYS = {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}


# ===== Page 002, "Training and Evaluation" (one trained trainer shared by the tests that need it) =====


@pytest.fixture(scope="module")
def trained(qwen_path, tmp_path_factory):
    config = MAGRPOConfig(
        num_agents=2,
        num_turns=1,
        num_train_epochs=1,
        num_generations=4,
        eval_interval=4,
        eval_num_samples=len(eval_dataset),
        eval_batch_size=1,
        logging_steps=4,
        **_fast(tmp_path_factory.mktemp("magrpo-out")),
    )

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        formatters=formatters,
        reward_func=reward_func,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        args=config,
    )

    trainer.train()
    metrics = trainer.evaluate(num_eval_samples=len(eval_dataset))
    print(metrics)
    return trainer, metrics


# ----- task sets, formatters, rewards: no models -----


def test_task_set_split_is_eight_and_two_and_repeatable():
    assert len(train_dataset) == 8 and len(eval_dataset) == 2
    assert set(train_dataset.column_names) == {"prompt", "target_min", "target_max"}
    prompts = list(train_dataset["prompt"]) + list(eval_dataset["prompt"])
    assert sorted(prompts) == sorted(tasks["prompt"])
    again = tasks.train_test_split(test_size=0.2, seed=42)
    assert list(again["train"]["prompt"]) == list(train_dataset["prompt"])
    assert list(again["test"]["prompt"]) == list(eval_dataset["prompt"])
    # "train_dataset.shuffle(seed=42) ... produces a fixed order"
    assert list(train_dataset.shuffle(seed=42)["prompt"]) == list(train_dataset.shuffle(seed=42)["prompt"])


def test_formatters_share_the_task_in_different_roles():
    item = train_dataset[0]
    assert brief_formatter(item) == f"Write a short response to this task:\n{item['prompt']}"
    assert detailed_formatter(item) == f"Write a detailed response to this task:\n{item['prompt']}"
    assert "target_min" not in brief_formatter(item)  # only fields a formatter uses enter the prompt


def test_reward_checks_without_models():
    item = train_dataset[0]
    assert item["prompt"] in brief_formatter(item)
    assert reward_func(["Hi"], ["Hello"], batch_items=[item]) == [1.0]
    assert reward_func([""], ["Hello"], batch_items=[item]) == [0.0]
    # Outside [2, 3] the reward decays with the distance to the nearest bound.
    assert reward_func(["ab"], ["ab"], batch_items=[item]) == [pytest.approx(math.exp(-1.0))]


def test_reward_processor_scale():
    processor = RewardProcessors.scale(factor=10.0)
    assert processor(0.5) == pytest.approx(5.0)
    assert [processor(r) for r in reward_func(["Hi", ""], ["Hello", "x"], batch_items=[train_dataset[0]])] == [
        pytest.approx(10.0),
        0.0,
    ]


# ----- training and evaluation -----


def test_training_example_trains_and_evaluates(trained):
    trainer, metrics = trained
    assert set(metrics) == EVAL_KEYS
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    # One turn: the expected return is the turn-1 reward; the page's reward lies in [0, 1].
    assert metrics["eval/turn_1/expected_return"] == metrics["eval/turn_1/reward_mean"]
    assert 0.0 <= metrics["eval/turn_1/reward_mean"] <= 1.0
    assert trainer.state.global_step > 0
    assert trainer.env_step == len(train_dataset) * 4  # K=4 joint actions per task item ("align")

    history = trainer.state.log_history
    # eval_interval=4 counts training task items: before item 0, before item 4, then the manual evaluate().
    eval_steps = [entry["env_step"] for entry in history if "eval/turn_1/reward_mean" in entry]
    assert eval_steps == [0, 16, 32]
    train_steps = [entry["env_step"] for entry in history if "turn_1/reward_mean" in entry]
    assert train_steps and all(b - a >= 4 for a, b in zip(train_steps, train_steps[1:]))
    for entry in history:
        if "turn_1/reward_mean" in entry:
            assert {"turn_1/expected_return", "agent_0/loss", "agent_1/loss"} <= set(entry)


def test_evaluate_without_eval_dataset_returns_empty_dict(qwen_path, tmp_path):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        formatters=formatters,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, **_fast(tmp_path)),
    )
    assert trainer.evaluate() == {}
    assert trainer.evaluate(num_eval_samples=2) == {}


# ----- logging -----


def test_wandb_config_snippet_is_accepted(qwen_path, tmp_path):
    wandb_config = {
        "project": "comlrl",
        "name": "length-ratio-magrpo",
        "tags": ["length-ratio", "magrpo"],
        "config_sections": {
            "dataset": {"name": "length-ratio", "split_seed": 42},
            "output": {"verbose": True},
        },
    }
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        formatters=formatters,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, **_fast(tmp_path)),
        wandb_config=wandb_config,
    )
    # config_sections.output.verbose controls trainer progress output (our bar replaces transformers' one).
    callbacks = trainer.callback_handler.callbacks
    assert any(isinstance(cb, TeamProgressCallback) for cb in callbacks)
    assert not any(isinstance(cb, ProgressCallback) for cb in callbacks)
    quiet = {**wandb_config, "config_sections": {"output": {"verbose": False}}}
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        formatters=formatters,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, **_fast(tmp_path)),
        wandb_config=quiet,
    )
    assert not any(
        isinstance(cb, (ProgressCallback, TeamProgressCallback)) for cb in trainer.callback_handler.callbacks
    )


def test_custom_metrics(qwen_path, tmp_path):
    seen = []

    def recording_logger(**kwargs):  # the page's eval_logger, recording what the trainer hands it
        seen.append(kwargs)
        return eval_logger(**kwargs)

    config = MAGRPOConfig(
        num_agents=2,
        num_turns=1,
        num_train_epochs=1,
        num_generations=4,
        eval_interval=1,
        eval_num_samples=len(eval_dataset),
        logging_steps=4,
        **_fast(tmp_path),
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        formatters=formatters,
        reward_func=reward_func,
        train_dataset=train_dataset.select(range(2)),
        eval_dataset=eval_dataset,
        args=config,
        eval_logger=recording_logger,
        eval_aggregator=eval_aggregator,
    )
    trainer.train()  # periodic evaluations (before items 0 and 1) log the custom metric too
    logged = [entry for entry in trainer.state.log_history if "eval/turn_1/reward_mean" in entry]
    assert len(logged) == 2 and all("eval/turn_1/response_chars" in entry for entry in logged)

    seen.clear()
    metrics = trainer.evaluate(num_eval_samples=len(eval_dataset))
    assert set(metrics) == EVAL_KEYS | {"eval/turn_1/response_chars"}
    assert metrics["eval/turn_1/response_chars"] > 0

    # The logger gets completions in [agent][task item][turn] order and the original task items.
    (call,) = seen
    completions = call["agent_completions_turns"]
    assert len(completions) == 2 and all(len(agent) == len(eval_dataset) for agent in completions)
    assert all(len(turns) == 1 and isinstance(turns[0], str) for agent in completions for turns in agent)
    assert call["batch_items"] == [eval_dataset[i] for i in range(len(eval_dataset))]
    expected = sum(sum(len(agent[row][0]) for agent in completions) / 2 for row in range(len(eval_dataset))) / len(
        eval_dataset
    )
    assert metrics["eval/turn_1/response_chars"] == pytest.approx(expected)


def test_local_metrics_json(trained, tmp_path):
    trainer, _ = trained
    path = tmp_path / "eval-metrics.json"

    metrics = trainer.evaluate(num_eval_samples=len(eval_dataset))
    Path(path).write_text(json.dumps(metrics, indent=2) + "\n")

    assert json.loads(path.read_text()) == metrics
    assert set(metrics) == EVAL_KEYS


# ----- page 002, "LLM-Based Reward Models" -----


def test_llm_reward_model_as_reward_func(qwen_path, tmp_path):
    from transformers import AutoModelForSequenceClassification

    reward_model_id = qwen_path  # a tiny local model with a fresh single-score head
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_id)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_id, num_labels=1).eval()

    @torch.no_grad()
    def model_reward(brief_completions, detailed_completions, *, batch_items):
        task = batch_items[0]["prompt"]
        texts = [
            f"{task}\n\nBrief: {brief}\n\nDetailed: {detailed}"
            for brief, detailed in zip(brief_completions, detailed_completions)
        ]
        inputs = reward_tokenizer(texts, return_tensors="pt", padding=True, truncation=True)
        return reward_model(**inputs).logits[:, 0].tolist()

    scores = model_reward(["Hi", "a longer brief answer"], ["Hello", ""], batch_items=[train_dataset[0]])
    assert len(scores) == 2 and all(isinstance(s, float) and math.isfinite(s) for s in scores)

    before = snapshot(reward_model)
    config = MAGRPOConfig(
        num_agents=2, num_turns=1, num_generations=4, logging_steps=1, eval_interval=0, **_fast(tmp_path)
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        formatters=formatters,
        reward_func=model_reward,
        train_dataset=train_dataset.select(range(2)),
        args=config,
    )
    trainer.train()
    assert trainer.state.global_step > 0
    rewards = [entry["turn_1/reward_mean"] for entry in trainer.state.log_history if "turn_1/reward_mean" in entry]
    assert rewards and all(math.isfinite(r) for r in rewards)
    # Trainers neither move nor update the reward model.
    assert all(torch.equal(before[name], p) for name, p in reward_model.named_parameters())
    assert next(reward_model.parameters()).device.type == "cpu" and not reward_model.training


# ===== Page 003 ("Training entities"), the MAGRPO snippets =====


def three_agent_reward(a, b, c, *, batch_items):
    return [float(len(x) + len(y) + len(z)) for x, y, z in zip(a, b, c)]


def test_homogeneous_three_agents(qwen_path, tmp_path):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        agents=None,
        num_agents=3,
        reward_func=three_agent_reward,
        train_dataset=train_dataset.select(range(2)),
        args=MAGRPOConfig(num_agents=3, num_turns=1, temperature=0.7, top_p=0.9, top_k=None, **_fast(tmp_path)),
    )
    agents = trainer.agents
    assert len(agents) == 3 and len({id(a) for a in agents}) == 3  # each agent gets its own copy
    pointers = {a.get_input_embeddings().weight.data_ptr() for a in agents}
    assert len(pointers) == 3
    assert trainer.args.temperature == 0.7 and trainer.args.top_p == 0.9
    trainer.train()
    assert trainer.state.global_step > 0


def test_heterogeneous_agents_save_and_continue(qwen_path, llama_path, tmp_path):
    small = train_dataset.select(range(2))
    trainer = MAGRPOTrainer(
        agent_model=None,
        agents=[qwen_path, llama_path],
        reward_func=reward_func,
        train_dataset=small,
        args=MAGRPOConfig(
            num_agents=2, num_turns=1, temperature=0.7, top_p=0.9, top_k=None, **_fast(tmp_path / "out-1")
        ),
    )
    # Tokenizers are loaded from the model paths; the two agents have different vocabularies.
    qwen_tok, llama_tok = trainer.tokenizers
    assert len(qwen_tok) != len(llama_tok)
    assert [type(m).__name__ for m in trainer.agents] == ["Qwen2ForCausalLM", "LlamaForCausalLM"]

    # "Save Models"
    saved = tmp_path / "saved-models"
    trainer.train()
    trainer.save_model(str(saved / "run-1"))
    for i, kind in enumerate(["qwen2", "llama"]):
        agent_dir = saved / "run-1" / f"agent_{i}"
        assert (agent_dir / "config.json").is_file() and (agent_dir / "tokenizer_config.json").is_file()
        assert AutoModelForCausalLM.from_pretrained(agent_dir).config.model_type == kind
    trained_weights = [snapshot(m) for m in trainer.agents]

    # "Train from Saved Models"
    continued_trainer = MAGRPOTrainer(
        agents=[
            str(saved / "run-1" / "agent_0"),
            str(saved / "run-1" / "agent_1"),
        ],
        num_agents=2,
        reward_func=reward_func,
        train_dataset=small,
        args=MAGRPOConfig(
            num_agents=2,
            num_turns=1,
            num_train_epochs=3,
            agent_learning_rate=5e-6,
            temperature=0.7,
            top_p=0.9,
            top_k=None,
            **_fast(tmp_path / "out-2"),
        ),
    )
    assert continued_trainer.args.learning_rate == 5e-6
    for before, model in zip(trained_weights, continued_trainer.agents):
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    for original, reloaded in zip(trainer.tokenizers, continued_trainer.tokenizers):
        assert reloaded.get_vocab() == original.get_vocab()
        assert reloaded("a short story").input_ids == original("a short story").input_ids

    continued_trainer.train()
    continued_trainer.save_model(str(saved / "run-2"))
    assert continued_trainer.state.epoch == pytest.approx(3.0)
    for i in range(2):
        agent_dir = saved / "run-2" / f"agent_{i}"
        assert (agent_dir / "config.json").is_file()
        assert AutoTokenizer.from_pretrained(agent_dir).get_vocab() == trainer.tokenizers[i].get_vocab()
