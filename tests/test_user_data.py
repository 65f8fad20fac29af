"""The recipes on the user's own data: TRL-style --dataset_name (local json/jsonl/csv/parquet files, save_to_disk
directories), --prompt_column and --reward_func module:function; offline, no hub."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict


ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "recipes"))  # as `python recipes/magrpo.py` does

import user_data  # noqa: E402


REWARD_MODULE = '''
CALLS = []


def score(first, second, *, batch_items):
    """1 per character of the second agent's answer that the first agent's answer lacks (any number will do)."""
    CALLS.append([item["question"] for item in batch_items])
    return [float(len(b) - len(a)) for a, b in zip(first, second)]
'''

ROWS = [{"question": f"Question {i}: name a colour.", "answer": f"colour {i}"} for i in range(4)]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """An importable module `my_rewards` (on sys.path) and the same code as a file path."""
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    yield path
    sys.modules.pop("my_rewards", None)


def _write(rows, path: Path) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_load_as_a_train_split(tmp_path, suffix):
    path = _write(ROWS, tmp_path / f"data{suffix}")
    train, test = user_data.load_user_splits(user_data.DataArguments(dataset_name=str(path)))
    assert train["question"] == [row["question"] for row in ROWS] and test is None


def test_save_to_disk_directory_with_both_splits(tmp_path):
    DatasetDict({"train": Dataset.from_list(ROWS[:3]), "validation": Dataset.from_list(ROWS[3:])}).save_to_disk(
        str(tmp_path / "saved")
    )
    args = user_data.DataArguments(dataset_name=str(tmp_path / "saved"), dataset_test_split="validation")
    train, test = user_data.load_user_splits(args)
    assert (len(train), len(test)) == (3, 1) and test[0]["answer"] == "colour 3"
    with pytest.raises(ValueError, match="'training' is not a split.*'train', 'validation'"):
        user_data.load_user_splits(
            user_data.DataArguments(dataset_name=str(tmp_path / "saved"), dataset_train_split="training")
        )


def test_directory_of_data_files(tmp_path):
    (tmp_path / "files").mkdir()
    _write(ROWS[:2], tmp_path / "files" / "train.jsonl")
    _write(ROWS[2:], tmp_path / "files" / "test.jsonl")
    train, test = user_data.load_user_splits(user_data.DataArguments(dataset_name=str(tmp_path / "files")))
    assert (len(train), len(test)) == (2, 2)


def test_reward_func_from_module_or_file(reward_module):
    from_module = user_data.load_reward_func("my_rewards:score")
    from_file = user_data.load_reward_func(f"{reward_module}:score")
    items = [{"question": "q"}]
    assert from_module(["ab"], ["abcd"], batch_items=items) == from_file(["ab"], ["abcd"], batch_items=items) == [2.0]
    with pytest.raises(ValueError, match="module:function"):
        user_data.load_reward_func("my_rewards.score")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        user_data.load_reward_func("my_rewards:nope")
    with pytest.raises(ValueError, match="no file"):
        user_data.load_reward_func(f"{reward_module.parent / 'missing.py'}:score")


def test_task_pieces_from_user_data(tmp_path, reward_module):
    path = _write(ROWS, tmp_path / "data.csv")
    args = user_data.DataArguments(dataset_name=str(path), prompt_column="question", reward_func="my_rewards:score")
    pieces = user_data.load_task("length_ratio", args, num_agents=2, max_train_items=3)
    assert len(pieces.train_dataset) == 3 and pieces.eval_dataset is None
    assert [f(ROWS[1]) for f in pieces.formatters] == ["Question 1: name a colour."] * 2
    assert pieces.transition is None and pieces.eval_logger is None
    with pytest.raises(ValueError, match="--prompt_column 'text' is not a column.*'question'"):
        user_data.load_task(
            "length_ratio",
            user_data.DataArguments(dataset_name=str(path), prompt_column="text", reward_func="my_rewards:score"),
            2,
        )
    with pytest.raises(ValueError, match="--reward_func needs --dataset_name"):
        user_data.load_task("length_ratio", user_data.DataArguments(reward_func="my_rewards:score"), 2)


def _magrpo_recipe():
    spec = importlib.util.spec_from_file_location("magrpo_recipe", ROOT / "recipes" / "magrpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_magrpo_recipe_trains_on_a_jsonl_file_with_a_reward_module(tmp_path, reward_module, qwen_path):
    path = _write(ROWS, tmp_path / "data.jsonl")
    recipe = _magrpo_recipe()
    args = recipe.make_parser().parse_args_and_config(
        args=[
            "--dataset_name",
            str(path),
            "--prompt_column",
            "question",
            "--reward_func",
            "my_rewards:score",
            "--model_name_or_path",
            qwen_path,
            "--max_steps",
            "2",
            "--max_new_tokens",
            "6",
            "--output_dir",
            str(tmp_path / "out"),
            "--plot",
            "false",
            "--num_generations",
            "2",
            "--logging_steps",
            "1",
            "--per_device_train_batch_size",
            "2",
            "--steps_per_generation",
            "1",
        ]
    )  # one item per step, sampled for each step
    summary = recipe.main(*args)
    calls = sys.modules["my_rewards"].CALLS
    assert summary["env_steps"] == 2 * 2 and summary["dataset"] == str(path)
    assert calls[:2] == [["Question 0: name a colour."], ["Question 1: name a colour."]]
    assert summary["final_eval"] == {}  # a single file has no test split
    assert (tmp_path / "out" / "models" / "agent_1" / "adapter_config.json").is_file()
    recipe_settings = json.loads((tmp_path / "out" / "models" / "team_settings.json").read_text())["recipe"]
    assert (recipe_settings["reward"], recipe_settings["task_replaced"]) == ("my_rewards:score", True)


def test_actor_critic_recipe_trains_on_a_csv_file(tmp_path, reward_module, qwen_path):
    path = _write(ROWS, tmp_path / "data.csv")
    spec = importlib.util.spec_from_file_location("actor_critic_recipe", ROOT / "recipes" / "actor_critic.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    argv = [
        "--dataset_name",
        str(path),
        "--prompt_column",
        "question",
        "--reward_func",
        f"{reward_module}:score",
        "--model_name_or_path",
        qwen_path,
        "--max_steps",
        "1",
        "--max_new_tokens",
        "6",
        "--output_dir",
        str(tmp_path / "out"),
        "--plot",
        "false",
        "--use_peft",
        "false",
        "--use_separate_critic",
        "false",
    ]
    summary = recipe.main(*recipe.make_parser("iac").parse_args_and_config(args=argv))
    assert summary["env_steps"] == 4 and summary["reward_func"].endswith("my_rewards.py:score")


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"question": "b", "answer": 2', "Expecting ',' delimiter"),
        ("not json at all", "Expecting value"),
        ('["a", "list"]', "a JSON list, not an object"),
    ],
)
def test_a_malformed_jsonl_line_is_named_with_its_file_and_number(tmp_path, bad_line, reason):
    path = tmp_path / "data.jsonl"
    good = [json.dumps(row) for row in ROWS]
    path.write_text("\n".join([good[0], "", good[1], bad_line, good[2], "also bad"]) + "\n")
    with pytest.raises(ValueError) as raised:
        user_data.load_user_splits(user_data.DataArguments(dataset_name=str(path)))
    message = str(raised.value)
    assert f"line 4 of {path}" in message and reason in message and bad_line[:20] in message
    assert "line 6" not in message  # the first bad line only


def test_a_malformed_line_in_a_directory_of_data_files_is_named(tmp_path):
    (tmp_path / "files").mkdir()
    _write(ROWS[:2], tmp_path / "files" / "train.jsonl")
    (tmp_path / "files" / "test.jsonl").write_text(json.dumps(ROWS[2]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"line 2 of .*test\.jsonl is not a JSON object"):
        user_data.load_user_splits(user_data.DataArguments(dataset_name=str(tmp_path / "files")))


@pytest.mark.parametrize("name", ["./my_data.jsonl", "data/train.csv", "/no/such/dir", "data/sub/dir"])
def test_a_local_dataset_path_that_does_not_exist_is_named(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        user_data.load_user_splits(user_data.DataArguments(dataset_name=name))
    message = str(error.value)
    assert message.startswith(f"--dataset_name {name!r}: no such file or directory ({tmp_path / name}")
    assert "a Hub dataset id" in message


def test_recipe_settings_record_the_reward_that_replaced_the_task():
    from comlrl_trl.team_settings import recipe_section

    own = recipe_section({"task": "length_ratio", "reward_func": "/abs/my_rewards.py:score", "chat": True})
    assert (own["reward"], own["task_replaced"]) == ("/abs/my_rewards.py:score", True)
    builtin = recipe_section({"task": "length_ratio", "reward_func": None, "chat": True})
    assert (builtin["reward"], builtin["task_replaced"]) == ("comlrl_trl.tasks.length_ratio:reward", False)
