"""What the recipes share to pick their data and reward: a task of comlrl_trl.tasks, or the user's own data set and
reward function, named on the command line as in TRL's scripts.

    python recipes/magrpo.py --task humaneval                                  # a task shipped with comlrl_trl
    python recipes/magrpo.py --dataset_name data/train.jsonl --prompt_column question \
        --reward_func my_rewards.py:score                                      # your data, your reward
    python recipes/magrpo.py --dataset_name org/name --dataset_config main --dataset_train_split train \
        --dataset_test_split validation --reward_func my_package.rewards:score

`--dataset_name` is a hub id or a local path: a `.json`/`.jsonl`/`.parquet`/`.csv` file, a directory written by
`save_to_disk`, or a directory of data files. `--reward_func` is `module:function` (an importable module or a
`.py` file); it gets one list of completions per agent (and, if it takes them, `batch_items=` the items) and
returns one reward per joint action, as every `reward_func` of comlrl_trl. With `--reward_func`, every agent's
prompt is the item's `--prompt_column`; without it, the `--task`'s formatters, reward, transition and evaluation
metrics are used on the given data (which then needs the task's columns, e.g. HumanEval's for `humaneval`).
"""

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError


FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
TASKS = ("length_ratio", "summarize", "code_feedback", "humaneval")


@dataclass
class DataArguments:
    """Where the task items and the reward come from (TRL's dataset options, plus the prompt column and reward)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub id or local path (.json/.jsonl/.parquet/.csv file, save_to_disk directory, or a "
            "directory of data files) of your own data; default: the --task's built-in data."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of --dataset_name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of --dataset_name to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split of --dataset_name to evaluate on (none if it does not exist)."}
    )
    prompt_column: str = field(
        default="prompt", metadata={"help": "Column holding every agent's prompt (with --reward_func)."}
    )
    reward_func: str | None = field(
        default=None,
        metadata={
            "help": "Your reward as module:function (importable module or path/to/file.py); it replaces the "
            "--task's reward and formatters."
        },
    )


def load_user_splits(args: DataArguments) -> tuple[Dataset, Dataset | None]:
    """`(train, test)` splits of `--dataset_name`; `test` is None when the data has no `--dataset_test_split`."""
    return _pick_splits(_load(args.dataset_name, args.dataset_config), args)


def _pick_splits(splits: DatasetDict, args: DataArguments) -> tuple[Dataset, Dataset | None]:
    if args.dataset_train_split not in splits:
        raise ValueError(
            f"--dataset_train_split {args.dataset_train_split!r} is not a split of "
            f"{args.dataset_name!r}; its splits are {sorted(splits)}."
        )
    return splits[args.dataset_train_split], splits.get(args.dataset_test_split)


def _load(name: str, config: str | None) -> DatasetDict:
    _check_local_path(name)
    if os.path.isdir(name) and (
        os.path.isfile(os.path.join(name, "dataset_dict.json")) or os.path.isfile(os.path.join(name, "state.json"))
    ):
        loaded = load_from_disk(name)
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
    extension = os.path.splitext(name)[1].lower()
    try:
        if os.path.isfile(name):
            if extension not in FILE_BUILDERS:
                raise ValueError(f"--dataset_name {name!r}: local files must be one of {sorted(FILE_BUILDERS)}.")
            return load_dataset(FILE_BUILDERS[extension], data_files=name)  # one split: "train"
        return load_dataset(name, config)  # a hub id, or a directory of data files
    except (DatasetGenerationError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        files = [name] if os.path.isfile(name) else _json_files(name)
        for path in files:
            bad = first_bad_json_line(path)
            if bad is not None:
                number, reason, text = bad
                raise ValueError(
                    f"--dataset_name {name!r}: line {number} of {path} is not a JSON object ({reason}): "
                    f"{text[:120]!r}. Each line of a JSON Lines file must hold one JSON object; fix or remove that "
                    "line."
                ) from error
        raise


def _check_local_path(name: str) -> None:
    """A ValueError for a `--dataset_name` that can only be a local path (a data file's extension, a leading `.`,
    `/` or `~`, or more than one `/`) and does not exist, instead of the Hub's "couldn't reach" error."""
    local = (
        os.path.splitext(name)[1].lower() in FILE_BUILDERS or name.startswith((".", "/", "~")) or name.count("/") > 1
    )
    if local and not os.path.exists(os.path.expanduser(name)):
        raise ValueError(
            f"--dataset_name {name!r}: no such file or directory ({os.path.abspath(os.path.expanduser(name))}). Pass "
            f"an existing data file ({', '.join(sorted(FILE_BUILDERS))}), a save_to_disk directory, a directory of "
            "data files, or a Hub dataset id (name or org/name)."
        )


def _json_files(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(
        os.path.join(root, file)
        for root, _, files in os.walk(directory)
        for file in files
        if os.path.splitext(file)[1].lower() in (".json", ".jsonl")
    )


def first_bad_json_line(path: str) -> tuple[int, str, str] | None:
    """`(line number, reason, line)` of the first non-blank line of a JSON Lines file that is not a JSON object;
    None when every line is one (or when the whole file is a single JSON document, as a `.json` file may be)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    if os.path.splitext(path)[1].lower() == ".json":
        try:
            json.loads(text)
            return None
        except ValueError:
            pass
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            return number, f"{error.msg} at column {error.colno}" if hasattr(error, "msg") else str(error), line
        if not isinstance(value, dict):
            return number, f"a JSON {type(value).__name__}, not an object", line
    return None


def load_reward_func(target: str):
    """The function named by `module:function`, where module is importable or a path to a `.py` file."""
    module_name, sep, function_name = target.rpartition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"--reward_func must look like module:function or path/to/file.py:function, got {target!r}.")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ValueError(f"--reward_func {target!r}: no file {module_name!r}.")
        module_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"--reward_func {target!r}: {module_name!r} has no function {function_name!r}.")
    return function


def column_formatter(column: str):
    """A formatter that sends the item's `column` as the prompt."""

    def formatter(item: dict[str, Any]) -> str:
        if column not in item:
            raise KeyError(f"--prompt_column {column!r} is not a column of the data; its columns are {sorted(item)}.")
        return str(item[column])

    return formatter


def load_task(task_name: str, data: DataArguments, num_agents: int, max_train_items: int | None = None):
    """The pieces a trainer needs, as attributes: `formatters`, `reward`, `transition` (or None),
    `eval_logger`/`eval_aggregator` (or None), `train_dataset`, `eval_dataset` (or None), and `split_names` (the
    splits of `--dataset_name`; None for a task's built-in data).

    From `comlrl_trl.tasks.<task_name>`, with `--dataset_name` replacing its data and `--reward_func` replacing
    its reward, formatters and transition (see the module docstring).
    """
    if task_name not in TASKS:
        raise ValueError(f"--task must be one of {list(TASKS)}, got {task_name!r}.")
    task = importlib.import_module(f"comlrl_trl.tasks.{task_name}")
    if data.dataset_name is None:
        if data.reward_func is not None:
            raise ValueError("--reward_func needs --dataset_name (your data): the built-in tasks bring their reward.")
        train, evaluation = task.build_dataset("train"), task.build_dataset("eval")
        split_names = None
    else:
        splits = _load(data.dataset_name, data.dataset_config)
        train, evaluation = _pick_splits(splits, data)
        split_names = sorted(splits)
    if max_train_items is not None:
        train = train.select(range(min(max_train_items, len(train))))
    pieces = SimpleNamespace(
        train_dataset=train,
        eval_dataset=evaluation,
        split_names=split_names,
        formatters=task.formatters(),
        reward=task.reward,
        transition=getattr(task, "transition", None),
        eval_logger=getattr(task, "eval_logger", None),
        eval_aggregator=getattr(task, "eval_aggregator", None),
    )
    if data.reward_func is not None:
        if data.prompt_column not in train.column_names:
            raise ValueError(
                f"--prompt_column {data.prompt_column!r} is not a column of {data.dataset_name!r}; its "
                f"columns are {train.column_names}."
            )
        pieces.reward = load_reward_func(data.reward_func)
        pieces.formatters = [column_formatter(data.prompt_column)] * num_agents
        pieces.transition = pieces.eval_logger = pieces.eval_aggregator = None
    return pieces
