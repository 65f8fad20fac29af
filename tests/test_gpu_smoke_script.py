"""scripts/gpu_smoke.sh without a GPU (issue 58, item 10): it parses, and every part whose GPUs are missing is
skipped honestly, with exit code 3 and a message naming the GPUs it needs and found (never exit 0, as `multi` did),
before writing anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"
ONE_GPU = ["single", "zero2", "zero3", "preference", "resume", "memory", "vllm"]
TWO_GPUS = ["multi", "ddp", "lora2", "iac_critics", "marlhf2"]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or Path("/dev/nvidia0").exists(), reason="checks the behaviour without a GPU"
)


def _run(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **({"PATH": path} if path else {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize("part,needs", [("ddp", 2), ("memory", 1)])
def test_a_part_without_its_gpus_exits_3_with_the_reason(tmp_path, part, needs):
    result = _run(part, str(tmp_path / "out"))
    assert result.returncode == 3, result.stderr
    assert f"gpu_smoke.sh {part}: skipped, needs {needs} GPU(s), found 0" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing written for a skipped part


def test_with_a_driver_torch_counts_the_gpus(tmp_path):
    """An `nvidia-smi` on the PATH (a stand-in here): the script asks torch, which sees no GPU in this CPU build."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    result = _run("ddp", str(tmp_path / "out"), path=f"{bin_dir}:{os.environ['PATH']}")
    assert result.returncode == 3, result.stderr
    assert f"gpu_smoke.sh ddp: skipped, needs 2 GPU(s), found 0 (torch {torch.__version__}, CUDA build" in (
        result.stderr
    )


def test_every_part_is_listed_and_needs_its_gpus(tmp_path):
    """One bash process for all parts (importing torch once per part is the slow step): each part's exit code and
    message, and the usage line naming every part."""
    loop = "; ".join(f'bash "$0" {p} "$1"; echo "{p} rc=$?"' for p in ONE_GPU + TWO_GPUS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        ["bash", "-c", loop, str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=600
    )
    for p in ONE_GPU + TWO_GPUS:
        needs = 2 if p in TWO_GPUS else 1
        assert f"{p} rc=3" in result.stdout, (p, result.stdout, result.stderr)
        assert f"gpu_smoke.sh {p}: skipped, needs {needs} GPU(s), found 0" in result.stderr
    unknown = _run("bogus")
    assert unknown.returncode == 2
    usage = unknown.stderr.split("usage: ", 1)[1]
    assert all(p in usage for p in [*ONE_GPU, *TWO_GPUS, "all"])


def test_all_reports_the_skipped_parts_and_exits_3(tmp_path):
    result = _run("all", str(tmp_path / "out"))
    assert result.returncode == 3
    assert "skipped (missing GPUs): single zero2 zero3 preference resume multi ddp lora2 iac_critics marlhf2" in (
        result.stderr
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
