"""The example scripts run end to end (tiny offline model, a few seconds each)."""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
STORY = ROOT / "examples" / "story-len-ratio.py"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tutorial_reward(completions1, completions2, target_min=2.0, target_max=3.0):
    """The reward function exactly as the tutorial page writes it."""
    rewards = []
    for c1, c2 in zip(completions1, completions2):
        len1, len2 = len(c1), len(c2)
        if len1 == 0:
            rewards.append(0.0)
            continue
        ratio = len2 / len1
        if target_min <= ratio <= target_max:
            reward = 1.0
        else:
            if ratio < target_min:
                distance = target_min - ratio
            else:
                distance = ratio - target_max
            reward = math.exp(-distance)
        rewards.append(float(reward))
    return rewards


def test_story_len_ratio_reward_matches_the_tutorial():
    reward = _load(STORY).proper_length_ratio_reward
    first = ["", "ab", "ab", "ab", "ab", "abcd", "x" * 10]
    second = ["abc", "", "ab", "abcde", "abcdefgh", "a" * 30, "y" * 25]
    assert reward(first, second) == pytest.approx(_tutorial_reward(first, second))
    assert reward(first, second, target_min=2, target_max=3) == pytest.approx(
        _tutorial_reward(first, second, target_min=2, target_max=3)
    )
    assert reward(["ab"], ["abcde"]) == [1.0]


def test_story_len_ratio_runs_and_saves_both_agents(tmp_path, qwen_path):
    out = tmp_path / "tmp"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [
            sys.executable,
            str(STORY),
            "--epochs",
            "1",
            "--max-new-tokens",
            "8",
            "--num-generations",
            "2",
            "--output-dir",
            str(out),
            "--model",
            qwen_path,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        agent_dir = out / "models" / f"agent_{i}"
        assert agent_dir.is_dir(), sorted(p.name for p in out.rglob("*"))
        assert (agent_dir / "config.json").is_file() and (agent_dir / "tokenizer_config.json").is_file()
    assert str(out / "models") in result.stdout
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "trainer_output").exists()
