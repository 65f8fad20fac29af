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
`output_dir/eval_metrics.json`; `output_dir` defaults to `evaluate/` inside the evaluated `--model_dir`, else
`outputs/evaluate`), and every sampled path with its reward to `*.samples.jsonl` beside them. A single data file
has one split, `train`: `--dataset_test_split train` evaluates on it (with a warning when that is the training
split).

A directory written by `save_model` holds `team_settings.json`: the run's sampling settings (`max_new_tokens`,
`temperature`, `top_p`, `top_k`, `num_turns`, per-agent overrides, ...) and, from the recipes, its task, chat
formatting, data and reward. With `--model_dir` (or `--agents` naming its `agent_i` directories) these are the
defaults: a value given on the command line or in a `--config` file wins, and the data options (`--task`,
`--dataset_name`, `--dataset_config`, `--prompt_column`, `--reward_func`) are taken from the run only all together,
when none of them is given. The script prints each setting with its source (saved run, user or evaluate default)
and writes them into the metrics JSON under "settings". Without the file (an older save) the defaults below apply.
"""

import argparse
import json
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import yaml
from common import HelpFormatter, close_process_group, default_model, model_init_kwargs, team_formatters
from trl import ModelConfig
from user_data import TASKS, DataArguments, load_task

from comlrl_trl.compat import CompatTrlParser
from comlrl_trl.team_settings import GENERATION_FIELDS, TEAM_SETTINGS_NAME, read_team_settings
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
            "help": "Also write every sampled path (item index and text fields, completions per agent "
            "and turn, reward per turn) as JSON lines next to the metrics (*.samples.jsonl)."
        },
    )


# Names of one setting: a value given under any of them is the user's.
SETTING_NAMES = {"max_new_tokens": ("max_new_tokens", "max_completion_length")}
# agent_overrides keys (canonical) -> the team settings they refine.
OVERRIDE_NAMES = {"max_completion_length": ("max_new_tokens", "max_completion_length")}
# Saved but not used here: the training group size (here --num_samples paths per item) and the team size (the agents).
NOT_APPLIED = ("num_generations", "num_agents")
# The data and reward of a run: taken from the saved run together, only when the user gives none of them.
DATA_SETTINGS = ("task", "dataset_name", "dataset_config", "prompt_column", "reward_func")
# Settings listed with their source in the printout and in the report: the saved ones that apply, the per-agent
# overrides, the prompt format and the data.
REPORTED = (
    *(name for name in GENERATION_FIELDS if name not in NOT_APPLIED),
    "agent_overrides",
    "chat",
    *DATA_SETTINGS,
    "dataset_test_split",
)
SAVED, USER, DEFAULT = "saved run", "user", "evaluate default"


@dataclass
class RunSettings:
    """Where the evaluation's settings came from: the saved `team_settings.json` (or None), the values it gave
    (`applied`), the settings the user gave (`given`) and a one-line note for the report."""

    file: str | None
    applied: dict[str, Any]
    given: set[str]
    note: str

    def source(self, name: str) -> str:
        if self.given.intersection(SETTING_NAMES.get(name, (name,))):
            return USER
        return SAVED if name in self.applied else DEFAULT


def saved_defaults(saved: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The settings of a `team_settings.json` (as `read_team_settings` returns it) that become defaults: every saved
    one the user did not give (`given`: option names from the command line or a --config file). Saved per-agent
    overrides of a setting the user gave are dropped, so that the user's value holds for every agent."""
    defaults = {}
    for name, value in saved["generation"].items():
        if name not in NOT_APPLIED and not given.intersection(SETTING_NAMES.get(name, (name,))):
            defaults[name] = value
    if defaults.get("agent_overrides"):
        kept = [
            {key: value for key, value in entry.items() if not given.intersection(OVERRIDE_NAMES.get(key, (key,)))}
            for entry in defaults["agent_overrides"]
        ]
        defaults["agent_overrides"] = kept if any(kept) else None
        if any(kept):
            defaults["num_agents"] = len(kept)  # validated against the overrides before the agents are counted
    recipe = saved.get("recipe") or {}
    if not given.intersection(DATA_SETTINGS):
        defaults.update({name: recipe[name] for name in DATA_SETTINGS if name in recipe})
    defaults.update(
        {name: recipe[name] for name in ("chat", "dataset_test_split") if name in recipe and name not in given}
    )
    return defaults


def settings_directory(model_dir: str | None, agents: list[str] | None) -> str | None:
    """The save_model directory of the agents: `--model_dir`, or the one directory holding every `--agents` path as
    its `agent_i` (in order); None otherwise."""
    if model_dir:
        return model_dir
    if not agents:
        return None
    parents = {os.path.dirname(os.path.normpath(path)) for path in agents}
    names = [os.path.basename(os.path.normpath(path)) for path in agents]
    if len(parents) == 1 and names == [f"agent_{i}" for i in range(len(agents))]:
        return parents.pop()
    return None


class EvaluateParser(CompatTrlParser):
    """The evaluate script's parser: defaults to the saved run's settings (see the module docstring); after
    `parse_args_and_config`, `run_settings` says where each setting came from."""

    run_settings: RunSettings | None = None

    def parse_args_and_config(self, args=None, *rest, **kwargs):
        args = list(args) if args is not None else sys.argv[1:]
        probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        probe.add_argument("--config")
        probe.add_argument("--model_dir", "--model-dir")
        probe.add_argument("--agents", nargs="+")
        early, _ = probe.parse_known_args(args)
        from_file = {}
        if early.config is not None:
            with open(early.config) as f:
                from_file = yaml.safe_load(f) or {}
        command_line = [a for i, a in enumerate(args) if a != "--config" and (i == 0 or args[i - 1] != "--config")]
        given = set(from_file) | self._given_on_command_line(command_line)
        directory = settings_directory(
            early.model_dir or from_file.get("model_dir"), early.agents or from_file.get("agents")
        )
        saved = read_team_settings(directory) if directory is not None else None
        if saved is not None:
            dests = {action.dest for action in self._actions}
            applied = {k: v for k, v in saved_defaults(saved, given).items() if k in dests}
            self.set_defaults(**applied)
            file = os.path.join(directory, TEAM_SETTINGS_NAME)
            note = (
                f"defaults from the saved run {file} (comlrl_trl {saved.get('comlrl_trl_version')}); "
                "values given on the command line or in --config win"
            )
        else:
            applied, file = {}, None
            note = (
                f"{directory} has no {TEAM_SETTINGS_NAME} (saved by an older comlrl_trl, or not by save_model): "
                f"evaluate's defaults apply (max_new_tokens={EVAL_DEFAULTS['max_new_tokens']}, temperature="
                f"{EVAL_DEFAULTS['temperature']}); pass the run's sampling settings for a score comparable with its "
                "evaluations"
                if directory is not None
                else "no saved run: evaluate's defaults apply"
            )
        if directory is not None and "output_dir" not in given:  # the report goes beside the evaluated run
            self.set_defaults(output_dir=os.path.join(directory, "evaluate"))
        for names in SETTING_NAMES.values():  # one name given: the other's default must not contradict it
            if given.intersection(names):
                self.set_defaults(**dict.fromkeys(names))
        self.run_settings = RunSettings(file=file, applied=applied, given=given, note=note)
        return super().parse_args_and_config(args, *rest, **kwargs)

    def _given_on_command_line(self, args: list[str]) -> set[str]:
        """The destinations that `args` itself sets (defaults left out): parse with every default suppressed."""
        if "-h" in args or "--help" in args:
            return set()
        defaults, parser_defaults = [(action, action.default) for action in self._actions], self._defaults
        try:
            for action in self._actions:
                action.default = argparse.SUPPRESS
            self._defaults = {}
            namespace, _ = argparse.ArgumentParser.parse_known_args(self, args)
        finally:
            for action, default in defaults:
                action.default = default
            self._defaults = parser_defaults
        return set(vars(namespace))


def make_parser() -> EvaluateParser:
    parser = EvaluateParser(
        (EvaluateArguments, MAGRPOConfig, ModelConfig), description=__doc__, formatter_class=HelpFormatter
    )
    parser.set_defaults(**EVAL_DEFAULTS)
    return parser


def settings_report(settings: RunSettings | None, args: EvaluateArguments, config: MAGRPOConfig) -> dict[str, Any]:
    """The settings the evaluation used, each with its value and source, for the printout and the report."""
    values = {}
    for name in REPORTED:
        value = getattr(args, name) if hasattr(args, name) else getattr(config, name)
        values[name] = {"value": value, "source": settings.source(name) if settings is not None else "main() caller"}
    return {
        "file": settings.file if settings is not None else None,
        "note": settings.note if settings is not None else "settings given to main() directly",
        "values": values,
    }


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
                f"--dataset_test_split {args.dataset_test_split!r} is not a split of {args.dataset_name!r}; its "
                f"splits are {task.split_names}. A single data file is one split, 'train': pass "
                "--dataset_test_split train to evaluate on it (the training data, if the run trained on it), or "
                "evaluate held-out data (a directory of train and test files, or another file)."
            )
        if args.dataset_test_split == args.dataset_train_split:
            warnings.warn(
                f"--dataset_test_split {args.dataset_test_split!r} is the training split (--dataset_train_split): "
                "the scores are on the data the run trained on, not on held-out data.",
                stacklevel=2,
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

    def write(self, path: str, rewards: list[list[float]], num_samples: int) -> None:
        """One JSON line per sampled path: the item's `index` and `sample` (0 to K-1), its text fields, the
        completions (`[agent][turn]`), the task's metrics and the joint `reward` of each turn (`rewards`, from the
        trainer's `last_eval_rewards`)."""
        with open(path, "w") as f:
            for i, (sample, turns) in enumerate(zip(self.samples, rewards, strict=True)):
                row = {"index": i // num_samples, "sample": i % num_samples, **sample, "rewards": turns}
                f.write(json.dumps(row) + "\n")


def main(
    args: EvaluateArguments, config: MAGRPOConfig, model_args: ModelConfig, settings: RunSettings | None = None
) -> dict:
    """Evaluate and write the report; `settings` (the parser's `run_settings`) says where each setting came from."""
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
    used = settings_report(settings, args, config)
    if trainer.accelerator.is_main_process:
        lines = [f"  {name}={entry['value']!r} ({entry['source']})" for name, entry in used["values"].items()]
        print(f"settings: {used['note']}\n" + "\n".join(lines), flush=True)
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
        "settings": used,
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
            recorder.write(os.path.splitext(path)[0] + ".samples.jsonl", trainer.last_eval_rewards, args.num_samples)
        print(json.dumps(metrics, indent=2))
        print(f"{report['items']} items x {args.num_samples} samples in {seconds:.0f} s; metrics: {path}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    parser = make_parser()
    main(*parser.parse_args_and_config(), settings=parser.run_settings)
    close_process_group()
