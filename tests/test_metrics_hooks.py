"""Every family trainer takes its arguments in one order (keyword-only after `agent_model`) and runs one custom-metrics
hook: `eval_logger`/`eval_aggregator` everywhere, `metrics_callback` on the actor-critic trainers (IAC, MAAC and
MARLHF's actor-critic stages). A hook a trainer cannot honour, or a positional argument, is refused at construction."""

import inspect

import pytest
from datasets import Dataset

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.preference import (
    MADPOConfig,
    MADPOTrainer,
    MARLHFConfig,
    MARLHFIterTrainer,
    MARLHFTrainer,
)
from comlrl_trl.trainers.reinforce import (
    CentralizedMAGRPOTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    MAREINFORCETrainer,
    MAReMaxTrainer,
    MARLOOTrainer,
)


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(3)], "target": [4, 5, 6]})

# The shared order, written out by hand: a trainer that reorders, drops or adds a shared argument fails below.
SHARED = [
    "agent_model",
    "agents",
    "num_agents",
    "tokenizer",
    "formatters",
    "reward_func",
    "reward_processor",
    "train_dataset",
    "eval_dataset",
    "args",
    "external_transition",
    "wandb_config",
    "eval_logger",
    "eval_aggregator",
    "metrics_callback",
    "peft_config",
    "callbacks",
]
CRITIC = ["critic_model", "critics", "critic_peft_config", "model_config"]
ORDERS = {
    MAGRPOTrainer: SHARED,
    MAREINFORCETrainer: SHARED,
    MARLOOTrainer: SHARED,
    MAReMaxTrainer: SHARED,
    MADPOTrainer: SHARED,
    # IAC/MAAC have no num_agents argument (CoMLRL's: the count is args.num_agents)
    IACTrainer: [name for name in SHARED if name != "num_agents"] + CRITIC,
    MAACTrainer: [name for name in SHARED if name != "num_agents"] + CRITIC,
    MARLHFTrainer: SHARED + CRITIC + ["reward_peft_config", "joint_formatter"],
    MARLHFIterTrainer: SHARED + CRITIC + ["reward_peft_config", "joint_formatter"],
}


@pytest.mark.parametrize("trainer_cls", list(ORDERS), ids=lambda cls: cls.__name__)
def test_every_family_takes_the_shared_arguments_in_one_order(trainer_cls):
    parameters = list(inspect.signature(trainer_cls).parameters.values())
    assert [p.name for p in parameters] == ORDERS[trainer_cls]
    assert parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[1:])  # also: no *args, no **kwargs
    assert all(p.default is None for p in parameters)


def test_centralized_magrpo_is_keyword_only_in_the_shared_order():
    # CoMLRL documents every argument of CentralizedMAGRPOTrainer as keyword-only; the rest go to MAGRPOTrainer.
    parameters = list(inspect.signature(CentralizedMAGRPOTrainer).parameters.values())
    named = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert named == [name for name in SHARED if name in named] + ["centralized_adapter"]
    assert named[:6] == ["agent_model", "agents", "num_agents", "tokenizer", "formatters", "reward_func"]
    assert [p.kind for p in parameters[len(named) :]] == [inspect.Parameter.VAR_KEYWORD]


def _reward(first, second):
    return [float(len(b) - len(a)) for a, b in zip(first, second)]


@pytest.mark.parametrize(
    "trainer_cls", [MAGRPOTrainer, MADPOTrainer, IACTrainer, MAACTrainer, MARLHFTrainer], ids=lambda c: c.__name__
)
def test_a_second_positional_argument_is_refused(trainer_cls):
    # CoMLRL's families ordered their arguments differently; a positional call could silently bind the wrong one.
    with pytest.raises(TypeError, match="positional argument"):
        trainer_cls("model-id", _reward)


def test_madpo_checks_its_config_whatever_else_is_passed(make_config):
    # MADPO's checks once ran only for args given by keyword; now args can only be given by keyword.
    with pytest.raises(TypeError, match="args must be a MADPOConfig, got MAGRPOConfig"):
        MADPOTrainer("model-id", reward_func=_reward, args=make_config(config_cls=MAGRPOConfig))
    with pytest.raises(ValueError, match="must be a multiple of preference_num_candidates=4"):
        MADPOTrainer(
            "model-id",
            reward_func=_reward,
            args=make_config(
                config_cls=MADPOConfig,
                num_generations=None,
                preference_num_candidates=4,
                per_device_train_batch_size=2,
                steps_per_generation=2,
            ),
        )


def _callback(samples):
    return {"n": len(samples)}


def _logger(**kwargs):
    return [{} for _ in kwargs["batch_items"]]


def _aggregator(rows, *, num_turns):
    return {}


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: MAGRPOTrainer("m", reward_func=_reward, metrics_callback=_callback), TypeError, "MAGRPOTrainer does"),
        (lambda: MARLOOTrainer("m", reward_func=_reward, metrics_callback=_callback), TypeError, "MARLOOTrainer does"),
        (lambda: MADPOTrainer("m", reward_func=_reward, metrics_callback=_callback), TypeError, "MADPOTrainer does"),
        (
            lambda: MARLHFTrainer("m", reward_func=_reward, train_dataset=ITEMS, metrics_callback=_callback),
            TypeError,
            "MARLHF with rl_algorithm='magrpo' does",
        ),
        (
            lambda: IACTrainer(
                "m", reward_func=_reward, eval_logger=_logger, eval_aggregator=_aggregator, metrics_callback=_callback
            ),
            ValueError,
            "Pass one custom-metrics hook",
        ),
        (lambda: MAACTrainer("m", reward_func=_reward, eval_logger=_logger), ValueError, "pass both or neither"),
        (lambda: MAGRPOTrainer("m", reward_func=_reward, eval_aggregator=_aggregator), ValueError, "both or neither"),
        (
            lambda: MAGRPOTrainer("m", reward_func=_reward, eval_logger="rows", eval_aggregator=_aggregator),
            TypeError,
            "eval_logger must be a callable",
        ),
    ],
)
def test_a_hook_the_trainer_cannot_honour_is_refused_at_construction(build, error, message):
    # "m" is no model: the hook check comes before any loading.
    with pytest.raises(error, match=message) as raised:
        build()
    if "does" in message:  # the refusal names the hook to use instead
        assert "does not take metrics_callback" in str(raised.value) and "eval_logger" in str(raised.value)


# ----- the hook receives what each family documents -----


def _build(trainer_cls, path, make_config, **hooks):
    common = dict(reward_func=_reward, train_dataset=ITEMS, eval_dataset=ITEMS)
    if trainer_cls in (IACTrainer, MAACTrainer):
        config = make_config(
            config_cls=IACConfig if trainer_cls is IACTrainer else MAACConfig, num_generations=1, max_new_tokens=6
        )
        return trainer_cls(path, critic_model=path, args=config, **common, **hooks)
    if trainer_cls is MADPOTrainer:
        config = make_config(
            config_cls=MADPOConfig, num_generations=None, preference_num_candidates=4, max_new_tokens=6
        )
        return trainer_cls(path, args=config, **common, **hooks)
    if isinstance(trainer_cls, str):  # MARLHF with this rl_algorithm
        config = make_config(
            config_cls=MARLHFConfig,
            rl_algorithm=trainer_cls,
            num_generations=2,
            preference_num_candidates=4,
            max_new_tokens=6,
        )
        return MARLHFTrainer(path, args=config, **common, **hooks)
    return trainer_cls(path, args=make_config(max_new_tokens=6), **common, **hooks)


@pytest.mark.parametrize(
    "family",
    [MAGRPOTrainer, MADPOTrainer, IACTrainer, MAACTrainer, "magrpo", "iac"],
    ids=lambda f: getattr(f, "__name__", f),
)
def test_eval_logger_and_aggregator_get_the_documented_arguments(family, qwen_path, make_config):
    logged, aggregated = [], []

    def eval_logger(*, agent_completions_turns, batch_items, prompts):
        logged.append((agent_completions_turns, batch_items, prompts))
        # one row per item: the mean length of the agents' turn-1 responses, plus the item's target
        return [
            {"chars": sum(len(agent[i][0]) for agent in agent_completions_turns) / 2, "target": item["target"]}
            for i, item in enumerate(batch_items)
        ]

    def eval_aggregator(rows, *, num_turns):
        aggregated.append((rows, num_turns))
        return {key: sum(row[key] for row in rows) / len(rows) for key in ("chars", "target")}

    trainer = _build(family, qwen_path, make_config, eval_logger=eval_logger, eval_aggregator=eval_aggregator)
    metrics = trainer.evaluate(num_eval_samples=3)
    assert len(logged) == 1 and len(aggregated) == 1
    completions, items, prompts = logged[0]
    assert items == [ITEMS[i] for i in range(3)]
    assert prompts == [f"Item {i}: say something" for i in range(3)]  # the raw prompt field
    assert len(completions) == 2 and all(len(agent) == 3 for agent in completions)  # [agent][item][turn]
    assert all(len(turns) == 1 and isinstance(turns[0], str) for agent in completions for turns in agent)
    rows, num_turns = aggregated[0]
    chars = [(len(completions[0][i][0]) + len(completions[1][i][0])) / 2 for i in range(3)]
    assert num_turns == 1
    assert rows == [{"chars": chars[i], "target": 4 + i} for i in range(3)]
    assert metrics["eval/chars"] == pytest.approx(sum(chars) / 3)
    assert metrics["eval/target"] == pytest.approx(5.0)  # (4 + 5 + 6) / 3
    assert "eval/turn_1/reward_mean" in metrics


@pytest.mark.parametrize("family", [IACTrainer, MAACTrainer, "iac"], ids=lambda f: getattr(f, "__name__", f))
def test_metrics_callback_gets_each_items_rollout_samples(family, qwen_path, make_config):
    seen = []

    def metrics_callback(rollouts):
        seen.append(rollouts)
        return {
            "chars": sum(len(sample.completion) for sample in rollouts) / len(rollouts),
            "target": rollouts[0].metadata["batch_item"]["target"],
            "label": "text is dropped",
        }

    trainer = _build(family, qwen_path, make_config, metrics_callback=metrics_callback)
    metrics = trainer.evaluate(num_eval_samples=3)
    assert len(seen) == 3  # once per evaluation item
    for i, samples in enumerate(seen):
        assert [s.agent_idx for s in samples] == [0, 1]
        assert all(s.prompt == f"Item {i}: say something" for s in samples)  # the default formatter's prompt
        assert all(s.metadata["batch_item"] == ITEMS[i] and s.metadata["turn_idx"] == 0 for s in samples)
    chars = [sum(len(s.completion) for s in samples) / 2 for samples in seen]
    assert metrics["eval/chars"] == pytest.approx(sum(chars) / 3)
    assert metrics["eval/target"] == pytest.approx(5.0)
    assert "eval/label" not in metrics
