"""The online RL stage of MARLHF: a team trainer of the chosen algorithm whose reward is the learned joint reward.

The stage trainer is an ordinary [`MAGRPOTrainer`] (REINFORCE family) or [`IACTrainer`]/[`MAACTrainer`] with one
change: evaluation always scores with the task reward. It is built once and trained once per preference iteration.
"""

import copy
import json
import os
from collections.abc import Callable
from typing import Any, Unpack

from ...adapters.grpo import completion_text
from ...algorithms import get_algorithm
from ..actor_critic import IACTrainer, MAACTrainer
from ..reinforce.magrpo_trainer import MAGRPOTrainer
from ..team.inputs import TeamKwargs
from ..team.trainer import TeamTrainer
from .marlhf_config import MARLHFConfig
from .reward_model import LearnedJointReward


# MARLHF fields that configure the preference stages, never the RL stage's own configuration.
_PREFERENCE_FIELDS = frozenset(
    {
        "rl_algorithm",
        "advantage_mode",
        "preference_num_candidates",
        "preference_pairs_per_sample",
        "pair_selection",
        "reward_model_name",
        "reward_model_device",
        "reward_learning_rate",
        "reward_num_train_epochs",
        "reward_train_batch_size",
        "reward_max_length",
        "reward_freeze_backbone",
        "reward_center_rewards_coefficient",
        "reward_use_margin",
        "preference_output_dir",
        "critic_model_name",
        "rl_num_iterations",
    }
)


class TaskRewardEvaluation:
    """Evaluation of the RL stage uses the task reward (and its processor), never the learned one."""

    learned_reward: LearnedJointReward

    def evaluate(self, *args, **kwargs):
        with self.learned_reward.task_reward_mode():
            return super().evaluate(*args, **kwargs)


class MAGRPOStageTrainer(TaskRewardEvaluation, MAGRPOTrainer):
    """The MARLHF RL stage with a REINFORCE-family algorithm (the baseline comes from `advantage_mode`)."""

    algorithm_name = "MARLHF"


class IACStageTrainer(TaskRewardEvaluation, IACTrainer):
    """The MARLHF RL stage with independent actor-critic."""

    algorithm_name = "MARLHF-IAC"


class MAACStageTrainer(TaskRewardEvaluation, MAACTrainer):
    """The MARLHF RL stage with a centralised critic."""

    algorithm_name = "MARLHF-MAAC"


# rl_algorithm -> stage trainer of the actor-critic back ends (their configuration classes are the registry's)
ACTOR_CRITIC_STAGES = {"iac": IACStageTrainer, "maac": MAACStageTrainer}


def stage_trainer_cls(args: MARLHFConfig) -> type[TeamTrainer]:
    """The class of the RL stage trainer for `args.rl_algorithm`."""
    return ACTOR_CRITIC_STAGES[args.rl_algorithm] if args.uses_actor_critic else MAGRPOStageTrainer


def stage_config(args: MARLHFConfig, rl_num_iterations: int | None):
    """The RL stage's configuration. Create it before any trainer: new TrainingArguments reset Accelerate's state.

    The REINFORCE family uses `args` itself (a copy when GRPO's μ is set separately, see [`MARLHFIterConfig`]). An
    actor-critic stage gets an `IACConfig`/`MAACConfig` built from the fields set by hand in `args`, so that its own
    defaults apply to the rest.
    """
    if not args.uses_actor_critic:
        if rl_num_iterations is None:  # MARLHFConfig: num_iterations is GRPO's mu, as in TRL
            return args
        config = copy.deepcopy(args)  # deepcopy does not rerun __post_init__, so the Accelerate state is kept
        config.num_iterations = rl_num_iterations
        return config
    config_cls = get_algorithm(args.rl_algorithm).config_cls
    known = {f for f in config_cls.__dataclass_fields__ if config_cls.__dataclass_fields__[f].init}
    kwargs = {
        name: value
        for name, value in args.explicit_fields().items()
        if name in known and name not in _PREFERENCE_FIELDS
    }
    kwargs["num_generations"] = args.num_generations
    if rl_num_iterations is not None:  # MARLHFIterConfig: num_iterations counts preference iterations
        kwargs["num_iterations"] = rl_num_iterations
    return config_cls(**kwargs)


def build_stage_trainer(
    marlhf_args: MARLHFConfig,
    stage_args,
    learned_reward: LearnedJointReward,
    agent_model=None,
    *,
    critic_model=None,
    critics=None,
    model_config: dict[str, Any] | None = None,
    critic_peft_config=None,
    **team_kwargs: Unpack[TeamKwargs],
) -> TeamTrainer:
    """The stage trainer for `marlhf_args.rl_algorithm` with MARLHF's team arguments `team_kwargs`, configured by
    `stage_args` and rewarded by `learned_reward` (no reward processor: learned scores are used as they are)."""
    common = {**team_kwargs, "reward_func": learned_reward, "reward_processor": None, "args": stage_args}
    trainer_cls = stage_trainer_cls(marlhf_args)
    if marlhf_args.uses_actor_critic:
        if marlhf_args.rl_algorithm == "maac" and marlhf_args.critic_value_head_hidden_dim is not None:
            # MAAC takes its critic head size through model_config; MARLHFConfig has a field for it
            model_config = {
                **(model_config or {}),
                "critic_value_head_hidden_dim": marlhf_args.critic_value_head_hidden_dim,
            }
        common.pop("num_agents", None)  # IAC/MAAC count their agents with args.num_agents
        trainer = trainer_cls(
            agent_model,
            critic_model=critic_model,
            critics=critics,
            critic_peft_config=critic_peft_config,
            model_config=model_config,
            **common,
        )
    else:
        trainer = trainer_cls(agent_model, **common)
    trainer.learned_reward = learned_reward
    return trainer


def sample_candidates(trainer: TeamTrainer, prompts: list[Any], count: int) -> list[list[str]]:
    """`count` completions per agent for one task item (`prompts[agent]`): one batched generation per agent.

    Returns `[agent][candidate]`; candidate j of every agent forms joint candidate j.
    """
    return [
        [completion_text(c) for c in agent.generate([prompts[a]] * count).completions]
        for a, agent in enumerate(trainer.agent_trainers)
    ]


def default_source(sources: list, what: str, name_field: str) -> str:
    """The model id of the first agent, for a model that defaults to the actors' (reward model, critic)."""
    names = []
    for source in sources:
        if not isinstance(source, str):
            raise ValueError(
                f"{name_field} must be set in MARLHFConfig when the agents are model objects: they "
                f"carry no model id to load the {what} from."
            )
        adapter = os.path.join(source, "adapter_config.json")
        if os.path.isfile(adapter):  # a saved LoRA agent: its base model
            with open(adapter) as f:
                source = json.load(f)["base_model_name_or_path"]
        names.append(source)
    return names[0]


def check_callable(value: Callable | None, name: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable, got {type(value).__name__}.")
