"""A newcomer's mistakes fail when the configuration or trainer is built, naming the field, the value and the fix
(issue 56): typos in Python, YAML and on the command line, value spellings, numeric ranges and reward arity."""

import math
import re
import warnings

import pytest
from datasets import Dataset
from helpers import length_ratio_reward
from test_recipes import _recipe

from comlrl_trl.centralized import CentralizedCollaboration, TaggedCentralizedComparatorAdapter
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFIterConfig, MARLHFTrainer
from comlrl_trl.trainers.reinforce import (
    CentralizedMAGRPOConfig,
    CentralizedMAGRPOTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    MAREINFORCEConfig,
    MAReMaxConfig,
    MARLOOConfig,
)


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})
CONFIGS = [
    MAGRPOConfig,
    MAREINFORCEConfig,
    MARLOOConfig,
    MAReMaxConfig,
    CentralizedMAGRPOConfig,
    IACConfig,
    MAACConfig,
    MADPOConfig,
    MARLHFConfig,
    MARLHFIterConfig,
]


# ----- unknown fields: "did you mean" -----


@pytest.mark.parametrize("config_cls", CONFIGS, ids=[c.__name__ for c in CONFIGS])
def test_a_keyword_typo_names_the_closest_field(config_cls, tmp_path):
    with pytest.raises(TypeError) as error:
        config_cls(output_dir=str(tmp_path), num_generaitons=4)
    message = str(error.value)
    assert message.startswith(f"{config_cls.__name__}: unknown field 'num_generaitons'")
    assert "did you mean 'num_generations'?" in message


def test_a_yaml_typo_names_the_file_and_the_closest_field(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("task: length_ratio\nnum_generaitons: 4\n")
    with pytest.raises(ValueError) as error:
        _recipe().make_parser().parse_args_and_config(args=["--config", str(config), "--output_dir", str(tmp_path)])
    assert str(error.value) == (
        f"unknown field 'num_generaitons' (in config file {config}); did you mean 'num_generations'?"
    )


def test_a_command_line_typo_names_the_closest_option(tmp_path):
    with pytest.raises(ValueError) as error:
        _recipe().make_parser().parse_args_and_config(
            args=["--output_dir", str(tmp_path), "--learning_rat", "1e-4", "--num_generaitons=4"]
        )
    assert str(error.value) == (
        "unknown field 'num_generaitons' (on the command line); did you mean 'num_generations'?"
    )


def test_a_unique_option_prefix_is_still_taken(tmp_path):
    """argparse takes an unambiguous prefix of an option (`--lora_alp` is `--lora_alpha`); the check keeps that."""
    _, _, model_args = (
        _recipe().make_parser().parse_args_and_config(args=["--output_dir", str(tmp_path), "--lora_alp", "8"])
    )
    assert model_args.lora_alpha == 8


# ----- value spellings: the suggested value is accepted -----


@pytest.mark.parametrize("value, accepted", [("MAGRPO", "mean"), ("MARLOO", "rloo"), ("RLOO", "rloo"), ("Max", "max")])
def test_the_suggested_advantage_mode_is_accepted(value, accepted, tmp_path):
    with pytest.raises(TypeError) as error:
        MAGRPOConfig(output_dir=str(tmp_path), advantage_mode=value)
    suggested = re.search(r"use advantage_mode='(\w+)'", str(error.value)).group(1)
    assert suggested == accepted
    assert MAGRPOConfig(output_dir=str(tmp_path), advantage_mode=suggested).advantage_mode == accepted


def test_an_upper_case_value_without_a_lower_case_twin_lists_the_choices(tmp_path):
    with pytest.raises(TypeError, match=r"advantage_mode='Median' is not one of 'mean', 'raw', 'max', 'rloo'"):
        MAGRPOConfig(output_dir=str(tmp_path), advantage_mode="Median")


def test_the_suggested_algorithm_in_yaml_is_accepted(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("advantage_mode: MAGRPO\n")
    with pytest.raises(ValueError, match=r"use advantage_mode='mean'"):
        _recipe().make_parser().parse_args_and_config(args=["--config", str(config), "--output_dir", str(tmp_path)])
    config.write_text("advantage_mode: mean\n")
    _, parsed, _ = (
        _recipe().make_parser().parse_args_and_config(args=["--config", str(config), "--output_dir", str(tmp_path)])
    )
    assert parsed.advantage_mode == "mean"


# ----- numeric ranges, at construction -----


@pytest.mark.parametrize(
    "config_cls, name, value, shown",
    [
        (MAGRPOConfig, "learning_rate", -1e-5, "learning_rate (agent_learning_rate) must be a number >= 0"),
        (MAGRPOConfig, "learning_rate", math.nan, "learning_rate (agent_learning_rate) must be a number >= 0"),
        (MAGRPOConfig, "agent_learning_rate", -1.0, "learning_rate (agent_learning_rate) must be a number >= 0"),
        (MAGRPOConfig, "temperature", 0.0, "temperature must be a number > 0"),
        (MAGRPOConfig, "top_p", 1.5, "top_p must be a number in (0, 1]"),
        (MAGRPOConfig, "num_train_epochs", -1, "num_train_epochs must be a number > 0"),
        (MAGRPOConfig, "max_new_tokens", 0, "max_completion_length (max_new_tokens) must be an integer >= 1"),
        (MAGRPOConfig, "epsilon", -0.2, "epsilon must be a number > 0"),
        (MAGRPOConfig, "adam_beta2", 1.0, "adam_beta2 must be a number in [0, 1)"),
        (MAGRPOConfig, "max_grad_norm", -1.0, "max_grad_norm must be a number >= 0"),
        (IACConfig, "learning_rate", -1e-3, "learning_rate (agent_learning_rate) must be a number >= 0"),
        (IACConfig, "critic_learning_rate", math.nan, "critic_learning_rate must be > 0"),
        (MARLHFConfig, "reward_learning_rate", math.nan, "reward_learning_rate must be > 0 (a finite number)"),
        (MADPOConfig, "dpo_beta", math.nan, "dpo_beta must be a number > 0 (finite)"),
        (MADPOConfig, "temperature", -1.0, "temperature must be a number > 0"),
    ],
)
def test_an_out_of_range_number_is_refused_at_construction(config_cls, name, value, shown, tmp_path):
    with pytest.raises(ValueError) as error:
        config_cls(output_dir=str(tmp_path), **{name: value})
    message = str(error.value)
    assert shown in message and f"got {value!r}" in message


def test_a_range_error_names_the_default(tmp_path):
    with pytest.raises(ValueError) as error:
        MAGRPOConfig(output_dir=str(tmp_path), learning_rate=-1e-5)
    assert str(error.value) == (
        "learning_rate (agent_learning_rate) must be a number >= 0, got -1e-05; set it in range, or leave it unset "
        "for the default (5e-06)."
    )


# ----- reward arity, before any model loads -----


def _no_loading(*args):
    raise AssertionError("the reward's arity is checked before tokenizers and models are loaded")


def _three_lists(a, b, c, *, batch_items):
    return [0.0] * len(a)


def test_a_reward_for_three_agents_is_refused_for_two_before_loading(qwen_path, tmp_path, monkeypatch):
    monkeypatch.setattr("comlrl_trl.trainers.team.trainer.resolve_tokenizers", _no_loading)
    with pytest.raises(TypeError) as error:
        MAGRPOTrainer(
            agent_model=qwen_path,
            reward_func=_three_lists,
            train_dataset=ITEMS,
            args=MAGRPOConfig(output_dir=str(tmp_path), num_agents=2),
        )
    assert str(error.value) == (
        "reward_func _three_lists(a, b, c, *, batch_items) cannot take num_agents=2 lists of completions (missing a "
        "required argument: 'c'). It is called once per task item as reward_func(agent_0_completions, "
        "agent_1_completions, *, batch_items) (batch_items only if it takes that keyword): give it 2 positional "
        "parameters (or *completions), or set num_agents to the number of lists it takes."
    )


@pytest.mark.parametrize(
    "trainer_cls, config_cls",
    [
        (MAGRPOTrainer, MAGRPOConfig),
        (IACTrainer, IACConfig),
        (MADPOTrainer, MADPOConfig),
        (MARLHFTrainer, MARLHFConfig),
    ],
    ids=["magrpo", "iac", "madpo", "marlhf"],
)
def test_every_family_checks_the_reward_arity(trainer_cls, config_cls, qwen_path, tmp_path):
    with pytest.raises(TypeError, match=r"reward_func <lambda>\(first\) cannot take num_agents=2 lists"):
        trainer_cls(
            agent_model=qwen_path,
            reward_func=lambda first: [0.0] * len(first),
            train_dataset=ITEMS,
            args=config_cls(
                output_dir=str(tmp_path), **({"use_separate_critic": False} if config_cls is IACConfig else {})
            ),
        )


def test_a_centralised_reward_is_checked_against_the_roles(qwen_path, tmp_path):
    with pytest.raises(TypeError, match=r"cannot take num_agents=2 lists .*reward_func\(role_0_completions, "):
        CentralizedMAGRPOTrainer(
            agent_model=qwen_path,
            reward_func=_three_lists,
            train_dataset=ITEMS,
            args=CentralizedMAGRPOConfig(output_dir=str(tmp_path), num_agents=2),
        )


def _star(*completions, batch_items=None):
    return [0.0] * len(completions[0])


def _optional_third(a, b, c=None):
    return [0.0] * len(a)


def _with_kwargs(a, b, **kwargs):
    return [0.0] * len(a)


class _CallableReward:
    def __call__(self, first, second, *, batch_items):
        return [0.0] * len(first)


@pytest.mark.parametrize(
    "reward_func", [_star, _optional_third, _with_kwargs, _CallableReward(), length_ratio_reward, max]
)
def test_every_documented_reward_signature_is_accepted(reward_func):
    from comlrl_trl.inputs import check_reward_arity

    # *completions, a defaulted extra list, **kwargs, a callable object, the docs' reward, a builtin without a
    # signature: none is refused
    check_reward_arity(reward_func, 2)


# ----- own data: no evaluation set -----


def test_training_without_an_eval_dataset_says_that_nothing_is_evaluated(qwen_path, make_config):
    with pytest.warns(UserWarning, match=r"No eval_dataset: no evaluation will run during training") as caught:
        MAGRPOTrainer(
            agent_model=qwen_path,
            reward_func=length_ratio_reward,
            train_dataset=ITEMS,
            args=make_config(eval_interval=16),
        )
    message = next(str(w.message) for w in caught if "No eval_dataset" in str(w.message))
    assert "eval_interval=16" in message and "--dataset_test_split" in message and "eval_interval=0" in message


@pytest.mark.parametrize("settings", [{"eval_dataset": ITEMS, "eval_interval": 16}, {"eval_interval": 0}])
def test_no_warning_with_an_eval_dataset_or_without_periodic_evaluation(settings, qwen_path, make_config, recwarn):
    eval_dataset = settings.pop("eval_dataset", None)
    MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        eval_dataset=eval_dataset,
        args=make_config(**settings),
    )
    assert not [w for w in recwarn if "No eval_dataset" in str(w.message)]


# ----- centralised team: completions without role sections -----


def test_joint_completions_without_role_sections_are_warned_about_with_their_count():
    collaboration = CentralizedCollaboration(
        TaggedCentralizedComparatorAdapter(), None, lambda first, second: [0.0] * len(first), 2
    )
    item = {"prompt": "say something"}
    tagged = "<agent_0>a</agent_0><agent_1>b</agent_1>"
    with pytest.warns(UserWarning) as first:
        collaboration(["no tags", tagged, "none here"], batch_items=[item])
    assert [str(w.message)[:80] for w in first] == [
        "2 of 3 joint completions so far held no role section (TaggedCentralizedComparato"
    ]
    assert "every role got ''" in str(first[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 3 to 9 unparsed: no new warning
        for _ in range(7):
            collaboration(["untagged"], batch_items=[item])
    with pytest.warns(UserWarning, match=r"^10 of 12 joint completions so far held no role section"):
        collaboration(["untagged", tagged], batch_items=[item])
    assert (collaboration.unparsed, collaboration.scored) == (10, 12)
