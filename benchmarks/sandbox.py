"""Sandbox throughput: `run_python` calls per second and the code task's reward batch time; writes JSON.

    python benchmarks/sandbox.py [--label after] [--baseline benchmarks/results/sandbox-before.json]

Measures, on this machine: sequential `run_python` calls (a 2-function program, 4 tests) per second, and the wall
time of one `code_feedback.reward` batch of 8 joint actions (distinct programs, so the cache does not help; the
task runs them in parallel threads). With `--baseline`, the table also shows the baseline run and the ratios.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from comlrl_trl.tasks import code_feedback as task  # noqa: E402
from comlrl_trl.tasks.sandbox import run_python  # noqa: E402


HELPER = "def aux(ch):\n    return ch.lower() in 'aeiou'\n"
MAIN = "def count_vowels(s):\n    return sum(1 for ch in s if aux(ch))  # {}\n"
TESTS = ['assert count_vowels("hello") == 2', 'assert count_vowels("AEIOU xyz") == 5',
         'assert count_vowels("rhythm") == 0', 'assert count_vowels("") == 0']


def calls_per_second(calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        result = run_python(HELPER + MAIN.format(i), TESTS)
        assert result.passed == 4, result
    return calls / (time.perf_counter() - start)


def reward_batch_seconds(batch: int, repeats: int) -> float:
    item = next(row for row in task.build_dataset("train") if row["entry_point"] == "count_vowels")
    times = []
    for r in range(repeats):
        mains = [MAIN.format(f"{r}-{i}") for i in range(batch)]
        start = time.perf_counter()
        rewards = task.reward([HELPER] * batch, mains, batch_items=[item])
        times.append(time.perf_counter() - start)
        assert all(abs(value - task.MAX_REWARD) < 1e-9 for value in rewards), rewards
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--baseline", default=str(ROOT / "benchmarks" / "results" / "sandbox-before.json"))
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    run_python(HELPER + MAIN, TESTS)  # warm-up (and the sandbox's one-time checks)
    row = {"label": args.label, "calls_per_s": calls_per_second(args.calls),
           "reward_batch8_s": reward_batch_seconds(8, args.repeats), "cpus": os.cpu_count(),
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    out = ROOT / "benchmarks" / "results" / f"sandbox-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2) + "\n")
    rows = [row]
    baseline = Path(args.baseline)
    if baseline.is_file() and baseline != out:
        rows.insert(0, json.loads(baseline.read_text()))
    print(f"{'run':<10} {'calls/s':>8} {'reward batch of 8 (s)':>22}")
    for r in rows:
        print(f"{r['label']:<10} {r['calls_per_s']:>8.1f} {r['reward_batch8_s']:>22.3f}")
    if len(rows) == 2:
        print(f"{'ratio':<10} {rows[1]['calls_per_s'] / rows[0]['calls_per_s']:>8.2f} "
              f"{rows[1]['reward_batch8_s'] / rows[0]['reward_batch8_s']:>22.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
