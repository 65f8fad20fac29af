"""Two processes on the CPU (gloo DDP) through torchrun: both agents are DDP-wrapped and stay in sync."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_two_process_ddp_trains_both_agents_in_sync(tmp_path):
    script = Path(__file__).parent / "scripts" / "ddp_smoke.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    report = json.loads(line[len("RESULT "):])
    assert report["world"] == 2 and report["dist"] == "DistributedType.MULTI_CPU"
    assert report["wrapped"] == ["DistributedDataParallel", "DistributedDataParallel"]
    rank0, rank1 = report["after"]
    assert rank0 == rank1  # gradients were all-reduced for every agent
    assert all(after != before for after, before in zip(rank0, report["before"]))
    assert report["env_step"] == 8 * 4  # 8 items split over 2 ranks, each item scored on 4 joint actions
    assert set(report["eval"]) == {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
