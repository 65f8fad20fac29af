"""Bad input fails early with an error naming the agent, the task item and the fix; small sets train."""

import math
import time

import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers import length_ratio_reward

from comlrl_trl.adapters import grpo as grpo_adapter
from comlrl_trl.joint_reward import JointReward
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _trainer(path, make_config, dataset=ITEMS, reward=length_ratio_reward, **kwargs):
    config = dict(num_generations=2, max_new_tokens=4, max_steps=1)
    config.update(kwargs.pop("config", {}))
    return MAGRPOTrainer(
        agent_model=path, reward_func=reward, train_dataset=dataset, args=make_config(**config), **kwargs
    )


def _notes(error) -> str:
    return "\n".join(getattr(error, "__notes__", []))


# ----- prompts -----


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "formatter of agent 1 on task item 0 gave an empty prompt"),
        ([], "formatter of agent 1 on task item 0 gave an empty chat prompt"),
        ([{}], "formatter of agent 1 on task item 0 gave a chat message without a string 'role'"),
        ([{"role": "user"}], "chat message without a string 'role' and a 'content'"),
    ],
)
def test_a_bad_prompt_from_a_formatter_names_the_agent_and_item(qwen_path, make_config, bad, message):
    trainer = _trainer(qwen_path, make_config, formatters=[lambda item: item["prompt"], lambda item: bad])
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_an_empty_prompt_field_is_refused_at_construction(qwen_path, make_config):
    dataset = Dataset.from_dict({"prompt": ["Say something", ""]})
    with pytest.raises(ValueError, match="task item 1 .*'prompt' field.* gave an empty prompt"):
        _trainer(qwen_path, make_config, dataset=dataset)
    with pytest.raises(ValueError, match="evaluation item 1 .* gave an empty prompt"):
        _trainer(qwen_path, make_config, eval_dataset=dataset)


def test_an_empty_prompt_from_the_transition_names_the_agent_and_item(qwen_path, make_config):
    def transition(*, agent_completions, **kwargs):
        return ["Revise your answer", ""]

    trainer = _trainer(qwen_path, make_config, external_transition=transition, config=dict(num_turns=2))
    with pytest.raises(ValueError, match="external_transition of agent 1 on task item 0, after turn 1 gave an empty"):
        trainer.train()


def test_a_formatter_that_raises_is_named(qwen_path, make_config):
    def formatter(item):
        return item["question"]

    trainer = _trainer(qwen_path, make_config, formatters=formatter)
    with pytest.raises(KeyError) as raised:
        trainer.train()
    assert "raised by the formatter of agent 0 on task item 0" in _notes(raised.value)


# ----- rewards -----


def test_a_reward_processor_that_raises_is_named(qwen_path, make_config):
    def processor(value):
        raise ZeroDivisionError("bad scale")

    trainer = _trainer(qwen_path, make_config, reward_processor=processor)
    with pytest.raises(ZeroDivisionError) as raised:
        trainer.train()
    assert "raised by reward_processor on reward" in _notes(raised.value)
    assert "joint action 0 of task item 0, turn 1" in _notes(raised.value)


@pytest.mark.parametrize("value", [1e39, -1e39, math.inf, math.nan])
def test_a_reward_beyond_float32_is_refused_naming_the_item(qwen_path, make_config, value):
    trainer = _trainer(qwen_path, make_config, reward=lambda a, b: [0.5] + [value] * (len(a) - 1))
    with pytest.raises(ValueError, match="joint action 1 of task item 0, turn 1 .* finite in float32"):
        trainer.train()


def test_the_largest_float32_reward_is_accepted():
    biggest = float(torch.finfo(torch.float32).max)
    rewards = JointReward(lambda a, b: [biggest, -biggest])([["x", "y"], ["z", "w"]], {"prompt": "p"}, "task item 0")
    assert rewards == [biggest, -biggest]


# ----- datasets -----


def test_empty_datasets_are_refused_at_construction(qwen_path, make_config):
    empty = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match="train_dataset is empty"):
        _trainer(qwen_path, make_config, dataset=empty)
    with pytest.raises(ValueError, match="eval_dataset is empty.*eval_dataset=None"):
        _trainer(qwen_path, make_config, eval_dataset=empty)


def test_evaluate_on_a_stream_without_items_is_a_clear_error(qwen_path, make_config):
    def nothing():
        yield from ()

    trainer = _trainer(qwen_path, make_config, eval_dataset=IterableDataset.from_generator(nothing))
    with pytest.raises(ValueError, match="eval_dataset yielded no evaluation items"):
        trainer.evaluate()


def test_a_set_smaller_than_one_batch_trains_on_its_items(qwen_path, make_config):
    """IAC's default batch holds several task items; a set of 2 fills it with its own items, in order."""
    seen = []

    def reward(first, second, batch_items):
        seen.append(batch_items[0]["prompt"])
        return [1.0 + len(b) for b in second]

    config = make_config(config_cls=IACConfig, num_generations=1, max_new_tokens=4, num_train_epochs=1)
    batch = config.per_device_train_batch_size  # one response per item: the batch holds this many items
    assert batch >= 4
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=reward,
        train_dataset=Dataset.from_dict({"prompt": ["First item", "Second item"]}),
        args=config,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert seen == ["First item", "Second item"] * (batch // 2)


def test_a_set_smaller_than_one_batch_trains_with_magrpo(qwen_path, make_config):
    seen = []

    def reward(first, second, batch_items):
        seen.append(batch_items[0]["prompt"])
        return length_ratio_reward(first, second, batch_items=batch_items)

    trainer = _trainer(
        qwen_path,
        make_config,
        dataset=Dataset.from_dict({"prompt": ["Only item"]}),
        reward=reward,
        config=dict(per_device_train_batch_size=4, max_steps=-1, num_train_epochs=2),
    )
    trainer.train()
    assert trainer.state.global_step == 2 and seen == ["Only item"] * 4


# ----- configuration -----


@pytest.mark.parametrize("turns", [10**5, 10**6, 10**9])
def test_a_huge_num_turns_is_refused_at_once(turns):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="more than 4096 joint actions"):
        MAGRPOConfig(num_turns=turns, report_to="none")
    assert time.perf_counter() - start < 2.0


def test_the_joint_action_bound_still_admits_what_fits():
    config = MAGRPOConfig(
        num_turns=5, num_generations=4, max_joint_actions_per_item=4 + 16 + 64 + 256 + 1024, report_to="none"
    )
    assert config.num_turns == 5
    with pytest.raises(ValueError, match="more than 1363 joint actions"):
        MAGRPOConfig(num_turns=5, num_generations=4, max_joint_actions_per_item=1363, report_to="none")


@pytest.mark.parametrize("threshold", [math.nan, math.inf, -math.inf])
def test_a_non_finite_early_termination_threshold_is_refused(threshold):
    with pytest.raises(ValueError, match="early_termination_threshold must be a finite number or None"):
        MAGRPOConfig(num_turns=2, early_termination_threshold=threshold, report_to="none")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_turn_gradient_weights_are_refused(bad):
    with pytest.raises(ValueError, match="finite non-negative weights"):
        MAGRPOConfig(num_turns=2, turn_gradient_weights=[1.0, bad], report_to="none")


# ----- long prompts -----


def test_long_prompts_are_truncated_from_the_left_with_a_warning(qwen_path, make_config, monkeypatch):
    warnings = []
    monkeypatch.setattr(grpo_adapter.logger, "warning", lambda message, *args: warnings.append(message % args))
    long_prompt = "word " * 5000 + "Now answer:"
    trainer = _trainer(
        qwen_path, make_config, dataset=Dataset.from_dict({"prompt": [long_prompt]}), config=dict(max_prompt_length=16)
    )
    for model in trainer.agents:
        model.train()
    rollout = trainer.orchestrator.rollout([{"prompt": long_prompt}] * 2)
    tokenizer = trainer.tokenizers[0]
    for batch in rollout.agent_batches:
        assert batch["prompt_ids"].shape[1] == 16
        assert tokenizer.decode(batch["prompt_ids"][0]).endswith("Now answer:")  # the end is kept
    assert len(warnings) == 2  # once per agent
    assert warnings[0].startswith("Agent 0: 2 of 2 prompts are longer than max_prompt_length=16 tokens")
    with pytest.raises(ValueError, match="max_prompt_length must be a positive integer or None"):
        make_config(max_prompt_length=0)
