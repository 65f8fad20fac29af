"""Centralised MAGRPO: one joint policy, its completions split into roles for the joint reward."""

import pytest
from datasets import Dataset
from helpers import changed, snapshot

from comlrl_trl.trainers.preference import CentralizedComparatorParseError, TaggedCentralizedComparatorAdapter
from comlrl_trl.trainers.reinforce import CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


class SplitAtThree:
    """Role 0 gets a completion's first 3 characters, role 1 the rest; records what it saw."""

    def __init__(self):
        self.prompts, self.completions = [], []

    def build_prompt(self, batch_item, agent_prompts):
        self.prompts.append(list(agent_prompts))
        return " | ".join(agent_prompts)

    def parse_completion(self, completion, batch_item, num_agents):
        self.completions.append(completion)
        return [completion[:3], completion[3:]]


def test_tagged_adapter_prompt_and_parsing():
    adapter = TaggedCentralizedComparatorAdapter()
    assert adapter.build_prompt({}, ["Be brief.", "Be long."]) == (
        "You are a centralized coordinator producing the separate outputs of 2 agents.\n"
        "Each output must satisfy its corresponding original prompt. Keep the outputs separate;\n"
        "do not merge them or add commentary outside the required tags.\n\n"
        "Agent 0 original prompt:\nBe brief.\n\nAgent 1 original prompt:\nBe long.\n\n"
        "Return exactly one section for each agent in this format:\n"
        "<agent_0>\n...\n</agent_0>\n<agent_1>\n...\n</agent_1>\n"
    )
    assert adapter.parse_completion("x <agent_0> a </agent_0>\n< AGENT_1 >b\nc</agent_1 >", {}, 2) == ["a", "b\nc"]
    assert adapter.parse_completion("<agent_1>only</agent_1>", {}, 2) == ["", "only"]
    with pytest.raises(CentralizedComparatorParseError):
        adapter.parse_completion("no sections", {}, 2)


def test_one_policy_learns_from_the_roles_joint_reward(qwen_path, make_config):
    adapter = SplitAtThree()
    calls = []

    def reward(first, second, *, batch_items):
        calls.append((list(first), list(second), batch_items[0]["prompt"]))
        return [float(len(b) - len(a)) for a, b in zip(first, second)]

    trainer = CentralizedMAGRPOTrainer(
        centralized_adapter=adapter,
        num_agents=2,
        agent_model=qwen_path,
        reward_func=reward,
        train_dataset=ITEMS,
        formatters=[lambda item: "brief: " + item["prompt"], lambda item: "long: " + item["prompt"]],
        args=make_config(CentralizedMAGRPOConfig, num_agents=2),
    )
    assert len(trainer.agents) == 1 and trainer.num_roles == 2 and trainer.args.num_agents == 1
    before = snapshot(trainer.agents[0])
    trainer.train()

    assert changed(before, trainer.agents[0])
    assert trainer.env_step == 4 * 4  # 4 items x K=4 joint completions
    assert adapter.prompts[0] == ["brief: Item 0: say something", "long: Item 0: say something"]
    # one reward call per item, one list per role: the K completions split at character 3
    assert len(calls) == 4 and [c[2] for c in calls] == [f"Item {i}: say something" for i in range(4)]
    for (first, second, _), start in zip(calls, range(0, 16, 4)):
        completions = adapter.completions[start : start + 4]
        assert first == [c[:3] for c in completions] and second == [c[3:] for c in completions]


def test_unparsable_completions_give_empty_roles_and_eval_logger_sees_roles(qwen_path, make_config):
    seen, rows = [], []

    def reward(first, second):
        seen.append((list(first), list(second)))
        return [0.0] * len(first)

    def eval_logger(*, agent_completions_turns, batch_items, prompts):
        rows.append(agent_completions_turns)
        return [{"empty": float(role0[0] == "")} for role0 in agent_completions_turns[0]]

    trainer = CentralizedMAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=reward,
        train_dataset=ITEMS,
        eval_dataset=ITEMS,
        eval_logger=eval_logger,
        eval_aggregator=lambda rows, num_turns: {"empty": sum(r["empty"] for r in rows)},
        args=make_config(CentralizedMAGRPOConfig, max_steps=1),
    )
    with pytest.warns(UserWarning, match=r"^4 of 4 joint completions so far held no role section"):
        trainer.train()
    metrics = trainer.evaluate(num_eval_samples=2)
    # a random tiny model writes no <agent_i> tags: every role output is ""
    assert seen and all(first == [""] * len(first) and second == [""] * len(second) for first, second in seen)
    assert rows[-1] == [[[""], [""]], [[""], [""]]]  # [role][item][turn]
    assert metrics["eval/empty"] == 2.0


@pytest.mark.parametrize(
    "kwargs, config, error, message",
    [
        ({"agents": ["a", "b"]}, {}, ValueError, "agents must hold one model"),
        ({"num_agents": 3}, {}, ValueError, r"num_agents=3 must equal args.num_agents=2"),
        ({"tokenizer": [None, None]}, {}, ValueError, "pass one tokenizer"),
        ({"centralized_adapter": object()}, {}, TypeError, "centralized_adapter.build_prompt must be callable"),
    ],
)
def test_trainer_errors(kwargs, config, error, message, qwen_path, make_config):
    args = dict(
        agent_model=qwen_path,
        reward_func=lambda a, b: [0.0] * len(a),
        train_dataset=ITEMS,
        args=make_config(CentralizedMAGRPOConfig, **config),
    )
    args.update(kwargs)
    if "agents" in kwargs:
        args.pop("agent_model")
    with pytest.raises(error, match=message):
        CentralizedMAGRPOTrainer(**args)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"num_turns": 2}, "supports num_turns=1 only"),
        ({"agent_overrides": [{}, {}]}, "trains one policy"),
        ({"collaboration_mode": "centralized"}, "CentralizedMAGRPOTrainer with CentralizedMAGRPOConfig"),
    ],
)
def test_config_errors(settings, message, tmp_path):
    with pytest.raises((TypeError, ValueError), match=message):
        CentralizedMAGRPOConfig(output_dir=str(tmp_path), **settings)
