"""Evaluate a team of agents on a task without training: K samples per item, metrics written as JSON.

The agents are model ids or paths: full models, or the `agent_i` directories that `trainer.save_model(dir)` writes
(LoRA adapters included); `--model_dir dir` takes every `dir/agent_i`. For code tasks (`humaneval`,
`code_feedback`) the metrics include the test pass rate and, for `humaneval`, pass@k for k up to `--num_samples`,
of the joint program and of the main agent alone, per turn.

    python recipes/evaluate.py --model_dir outputs/coding/models --task humaneval --num_samples 10
    python recipes/evaluate.py --agents path/to/helper path/to/main --task humaneval --num_turns 2
    python recipes/evaluate.py --task humaneval --num_samples 4 --max_new_tokens 256   # the embedded SmolLM2
    python recipes/evaluate.py --dataset_name data.jsonl --dataset_test_split train --reward_func rewards.py:score

Generation follows the `MAGRPOConfig` options (`--temperature`, `--top_p`, `--max_new_tokens`, `--num_turns`,
`--eval_batch_size`, `--seed`, ...); `--help` lists them all. Metrics go to `--output` (default
`output_dir/eval_metrics.json`).
"""

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from common import HelpFormatter, default_model, model_init_kwargs, team_formatters
from trl import ModelConfig
from user_data import TASKS, DataArguments, load_task

from comlrl_trl.compat import CompatTrlParser
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


EVAL_DEFAULTS = dict(
    output_dir="outputs/evaluate",
    temperature=0.8,
    max_new_tokens=256,
    eval_batch_size=8,
    report_to="none",
    seed=0,
    num_generations=2,
    per_device_train_batch_size=2,
)


@dataclass
class EvaluateArguments(DataArguments):
    """What to evaluate: the agents, the task or data, the split and the number of samples per item."""

    task: Literal[TASKS] = field(default="humaneval", metadata={"help": "Task module of comlrl_trl.tasks."})
    agents: list[str] | None = field(
        default=None, metadata={"help": "One model id or path per agent (full model or saved LoRA agent directory)."}
    )
    model_dir: str | None = field(
        default=None, metadata={"help": "A save_model directory: its agent_0, agent_1, ... are the agents."}
    )
    split: Literal["train", "eval"] = field(
        default="eval", metadata={"help": "Split of the built-in task (with --dataset_name: --dataset_test_split)."}
    )
    num_samples: int = field(default=1, metadata={"help": "Samples (paths) per item, K: pass@k for k <= K."})
    max_items: int | None = field(default=None, metadata={"help": "Evaluate only the first N items."})
    chat: bool = field(default=True, metadata={"help": "Send each agent's prompt as a user message."})
    output: str | None = field(
        default=None, metadata={"help": "Metrics JSON path (default output_dir/eval_metrics.json)."}
    )
    save_samples: bool = field(
        default=True,
        metadata={
            "help": "Also write every sampled path (item, prompts' task id, completions per agent "
            "and turn) as JSON lines next to the metrics (*.samples.jsonl)."
        },
    )


def make_parser() -> CompatTrlParser:
    parser = CompatTrlParser(
        (EvaluateArguments, MAGRPOConfig, ModelConfig), description=__doc__, formatter_class=HelpFormatter
    )
    parser.set_defaults(**EVAL_DEFAULTS)
    return parser


def resolve_agents(args: EvaluateArguments, num_agents: int, model_args: ModelConfig) -> list[str]:
    """`--agents`, else the `agent_i` directories of `--model_dir`, else the default model for every agent."""
    if args.agents and args.model_dir:
        raise ValueError("Pass either --agents or --model_dir, not both.")
    if args.agents:
        return list(args.agents)
    if args.model_dir:
        names = (
            [name for name in os.listdir(args.model_dir) if re.fullmatch(r"agent_\d+", name)]
            if os.path.isdir(args.model_dir)
            else []
        )
        if not names:
            raise ValueError(
                f"--model_dir {args.model_dir!r} holds no agent_0, agent_1, ... directories "
                "(as trainer.save_model writes them)."
            )
        return [os.path.join(args.model_dir, f"agent_{i}") for i in range(len(names))]
    return [default_model(model_args)] * num_agents


def evaluation_items(args: EvaluateArguments, config: MAGRPOConfig):
    """The task pieces and the evaluation items, each repeated `--num_samples` times in a row."""
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be at least 1, got {args.num_samples}.")
    task = load_task(args.task, args, config.num_agents)
    if args.dataset_name is not None:
        items = task.eval_dataset
        if items is None:
            raise ValueError(
                f"--dataset_test_split {args.dataset_test_split!r} is not a split of {args.dataset_name!r}."
            )
    else:
        items = task.eval_dataset if args.split == "eval" else task.train_dataset
    count = len(items) if args.max_items is None else min(args.max_items, len(items))
    return task, items.select([i for i in range(count) for _ in range(args.num_samples)])


class SampleRecorder:
    """Wraps a task's `eval_logger`/`eval_aggregator` (or none) to keep the sampled completions for inspection."""

    def __init__(self, eval_logger, eval_aggregator):
        self.eval_logger, self.eval_aggregator = eval_logger, eval_aggregator
        self.samples = []

    def logger(self, *, agent_completions_turns, batch_items, prompts):
        rows = (
            self.eval_logger(agent_completions_turns=agent_completions_turns, batch_items=batch_items, prompts=prompts)
            if self.eval_logger is not None
            else [{} for _ in batch_items]
        )
        for i, item in enumerate(batch_items):
            self.samples.append(
                {
                    "item": {key: value for key, value in item.items() if isinstance(value, str)},
                    "completions": [agent[i] for agent in agent_completions_turns],
                    "metrics": {k: v for k, v in rows[i].items() if isinstance(v, (int, float))},
                }
            )
        return rows

    def aggregator(self, rows, *, num_turns):
        return self.eval_aggregator(rows, num_turns=num_turns) if self.eval_aggregator is not None else {}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            for sample in self.samples:
                f.write(json.dumps(sample) + "\n")


def main(args: EvaluateArguments, config: MAGRPOConfig, model_args: ModelConfig) -> dict:
    agents = resolve_agents(args, config.num_agents, model_args)
    config.num_agents = len(agents)
    config.model_init_kwargs = model_init_kwargs(model_args)
    task, items = evaluation_items(args, config)
    recorder = SampleRecorder(task.eval_logger, task.eval_aggregator)
    trainer = MAGRPOTrainer(
        agents=agents,
        formatters=team_formatters(task, args.chat),
        reward_func=task.reward,
        external_transition=task.transition if config.num_turns > 1 else None,
        eval_dataset=items,
        eval_logger=recorder.logger,
        eval_aggregator=recorder.aggregator,
        args=config,
    )
    started = time.perf_counter()
    metrics = trainer.evaluate(num_eval_samples=len(items))
    seconds = time.perf_counter() - started
    report = {
        "task": args.task,
        "dataset": args.dataset_name,
        "agents": agents,
        "split": args.dataset_test_split if args.dataset_name else args.split,
        "items": len(items) // args.num_samples,
        "num_samples": args.num_samples,
        "num_turns": config.num_turns,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "chat": args.chat,
        "seed": config.seed,
        "seconds": round(seconds, 1),
        "metrics": metrics,
        "arguments": asdict(args),
    }
    if trainer.accelerator.is_main_process:
        path = args.output or os.path.join(config.output_dir, "eval_metrics.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        if args.save_samples:
            recorder.write(os.path.splitext(path)[0] + ".samples.jsonl")
        print(json.dumps(metrics, indent=2))
        print(f"{report['items']} items x {args.num_samples} samples in {seconds:.0f} s; metrics: {path}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main(*make_parser().parse_args_and_config())
