"""The readable progress lines (model-free), and the bar's life cycle around a failed train()."""

import pytest

from comlrl_trl.integrations.plotting import reward_curve_series
from comlrl_trl.integrations.progress import format_log_line


def test_training_line_shows_the_headline_metrics_in_order():
    logs = {
        "env_step": 48,
        "turn_1/reward_mean": 0.8125,
        "turn_1/expected_return": 1.5,
        "loss": 0.25,
        "agent_0/loss": 0.1,
        "turn_2/reward_mean": 0.5,
        "turn_2/expected_return": 0.5,
    }
    line = format_log_line(logs, step=12)
    assert line == ("step 12 | env_step 48 | turn_1 reward 0.8125 | turn_1 return 1.5 | loss 0.25 | turn_2 reward 0.5")


def test_eval_and_summary_lines():
    assert format_log_line({"env_step": 8, "eval/turn_1/reward_mean": 0.5}, step=2) == (
        "eval at env_step 8 | turn_1/reward_mean 0.5"
    )
    assert format_log_line({"train_runtime": 12.34}, step=3) == "done in 12.3 s"
    assert format_log_line(
        {"env_step": 40, "preference/pairs": 12.0, "reward_model/accuracy": 0.75, "reward_model/loss": 0.4}, step=0
    ) == ("step 0 | env_step 40 | preference/pairs 12 | reward_model/accuracy 0.75 | reward_model/loss 0.4")
    assert format_log_line({"learning_rate": 1e-5}, step=3) is None


def test_reward_curve_series_follows_env_step():
    history = [
        {"env_step": 4, "turn_1/reward_mean": 0.1},
        {"env_step": 0, "eval/turn_1/reward_mean": 0.3},
        {"env_step": 8, "turn_1/reward_mean": 0.2, "turn_2/reward_mean": 0.4},
        {"train_runtime": 1.0},
    ]
    assert reward_curve_series(history) == {
        "turn_1/reward_mean": ([4, 8], [0.1, 0.2]),
        "eval/turn_1/reward_mean": ([0], [0.3]),
        "turn_2/reward_mean": ([8], [0.4]),
    }


def test_a_failed_train_closes_the_progress_bar(qwen_path, prompts_dataset, make_config):
    """A bar left open is printed again when it is garbage-collected (at exit: after pytest's summary line)."""
    from comlrl_trl.integrations.progress import TeamProgressCallback
    from comlrl_trl.trainers.reinforce import MAGRPOTrainer

    def failing_reward(first, second, *, batch_items):
        raise RuntimeError("reward service down")

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=failing_reward,
        train_dataset=prompts_dataset,
        args=make_config(),
    )
    bars = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TeamProgressCallback)]
    assert len(bars) == 1
    with pytest.raises(RuntimeError, match="reward service down"):
        trainer.train()
    assert bars[0].bar is None


_CHATTY_RUN = """
import sys
import warnings
from datasets import Dataset
from transformers import TrainerCallback
from transformers.utils import logging
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

class Chatty(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        logging.get_logger("comlrl_trl.probe").warning("a log line at step %d", state.global_step)
        logging.get_logger("transformers.probe").warning("a transformers line at step %d", state.global_step)
        warnings.warn(f"a Python warning at step {state.global_step}", UserWarning, stacklevel=1)

MAGRPOTrainer(
    agent_model=sys.argv[1],
    reward_func=lambda a, b: [float(len(y) - len(x)) for x, y in zip(a, b)],
    train_dataset=Dataset.from_dict({"prompt": ["Item 0", "Item 1", "Item 2"]}),
    callbacks=[Chatty()],
    args=MAGRPOConfig(output_dir=sys.argv[2], num_generations=2, max_new_tokens=4, steps_per_generation=1,
                      logging_steps=1, eval_interval=0, report_to="none", gradient_checkpointing=False),
).train()
"""


def test_log_lines_are_written_above_the_bar_never_glued_to_it(qwen_path, tmp_path):
    """While the bar is open, the messages of Python's and transformers' loggers and Python's warnings go through
    tqdm.write: in a real run's stderr each one stands alone after the bar's last carriage return, never appended to
    a bar line."""
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _CHATTY_RUN, qwen_path, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    segments = [part for line in (run.stderr + run.stdout).split("\n") for part in line.split("\r")]
    glued = [part for part in segments if part.startswith("training:") and " at step " in part]
    assert glued == []
    for step in (1, 2, 3):
        assert f"a log line at step {step}" in segments
        assert any(part.endswith(f"] a transformers line at step {step}") for part in segments)  # its own format
        assert any(part.endswith(f"UserWarning: a Python warning at step {step}") for part in segments)
        assert any(part.startswith(f"step {step} | env_step") for part in segments)  # the bar's own log lines
