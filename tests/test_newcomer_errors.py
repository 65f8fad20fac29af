"""A newcomer's mistakes fail when the configuration or trainer is built, naming the field, the value and the fix
(issue 56): typos in Python, YAML and on the command line, value spellings, numeric ranges and reward arity."""

import math
import re

import pytest
from test_recipes import _recipe

from comlrl_trl.trainers.actor_critic import IACConfig, MAACConfig
from comlrl_trl.trainers.preference import MADPOConfig, MARLHFConfig, MARLHFIterConfig
from comlrl_trl.trainers.reinforce import (
    CentralizedMAGRPOConfig,
    MAGRPOConfig,
    MAREINFORCEConfig,
    MAReMaxConfig,
    MARLOOConfig,
)


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
