"""Sandbox throughput: `run_python` calls per second and the code task's reward batch time; writes JSON.

    python benchmarks/sandbox.py                       # this sandbox, against benchmarks/results/sandbox-before.json
    git show c8e34eb:comlrl_trl/tasks/sandbox.py > /tmp/old_sandbox.py
    python benchmarks/sandbox.py --before-module /tmp/old_sandbox.py   # both, interleaved (robust to load drift)

Measures on this machine: sequential `run_python` calls (a 2-function program, 4 tests) per second, and the wall
time of one `code_feedback.reward` batch of 8 joint actions (distinct programs, so its cache does not help; the
task runs them in parallel threads). Medians over `--rounds` rounds; with `--before-module` (a standalone
`sandbox.py` file, e.g. the one before the isolation) the two implementations alternate in random order within
each round, and both results are written.
"""

import argparse
import importlib.util
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from comlrl_trl.tasks import code_feedback as task  # noqa: E402
from comlrl_trl.tasks.sandbox import run_python  # noqa: E402


RESULTS = ROOT / "benchmarks" / "results"
HELPER = "def aux(ch):\n    return ch.lower() in 'aeiou'\n"
MAIN = "def count_vowels(s):\n    return sum(1 for ch in s if aux(ch))  # {}\n"
TESTS = [
    'assert count_vowels("hello") == 2',
    'assert count_vowels("AEIOU xyz") == 5',
    'assert count_vowels("rhythm") == 0',
    'assert count_vowels("") == 0',
]
_unique = itertools.count()  # a fresh program text every time, so no cache helps


def one_round(run: Callable, calls: int) -> tuple[float, float]:
    """(seconds per `run_python` call, seconds for a reward batch of 8) with `run` as the sandbox."""
    start = time.perf_counter()
    for _ in range(calls):
        result = run(HELPER + MAIN.format(next(_unique)), TESTS)
        assert result.passed == 4, result
    per_call = (time.perf_counter() - start) / calls
    item = next(row for row in task.build_dataset("train") if row["entry_point"] == "count_vowels")
    mains = [MAIN.format(next(_unique)) for _ in range(8)]
    task.run_python = run  # code_feedback's reference, swapped for the round
    try:
        start = time.perf_counter()
        rewards = task.reward([HELPER] * 8, mains, batch_items=[item])
        batch = time.perf_counter() - start
    finally:
        task.run_python = run_python
    assert all(abs(value - task.MAX_REWARD) < 1e-9 for value in rewards), rewards
    return per_call, batch


def load_module_run(path: str) -> Callable:
    spec = importlib.util.spec_from_file_location("before_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-module", help="a standalone sandbox.py to measure as 'before', interleaved")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=4, help="run_python calls per round")
    args = parser.parse_args()
    runs = {"after": run_python}
    if args.before_module:
        runs["before"] = load_module_run(args.before_module)
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    for label in runs:  # warm-up (and the sandbox's one-time checks)
        one_round(runs[label], 1)
    for _ in range(args.rounds):
        for label in random.sample(list(runs), len(runs)):
            samples[label].append(one_round(runs[label], args.calls))
    rows = {}
    for label, pairs in samples.items():
        rows[label] = {
            "label": label,
            "calls_per_s": 1 / statistics.median(p[0] for p in pairs),
            "reward_batch8_s": statistics.median(p[1] for p in pairs),
            "rounds": args.rounds,
            "interleaved": len(runs) == 2,
            "cpus": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0],
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"sandbox-{label}.json").write_text(json.dumps(rows[label], indent=2) + "\n")
    if "before" not in rows and (RESULTS / "sandbox-before.json").is_file():
        rows["before"] = json.loads((RESULTS / "sandbox-before.json").read_text())
    print(f"{'sandbox':<8} {'run_python calls/s':>19} {'reward batch of 8 (s)':>22}")
    for label in ("before", "after"):
        if label in rows:
            print(f"{label:<8} {rows[label]['calls_per_s']:>19.1f} {rows[label]['reward_batch8_s']:>22.3f}")
    if "before" in rows:
        print(
            f"{'after/before':<8} {rows['after']['calls_per_s'] / rows['before']['calls_per_s']:>15.2f} "
            f"{rows['after']['reward_batch8_s'] / rows['before']['reward_batch8_s']:>22.2f}"
        )
    print(f"wrote {RESULTS}/sandbox-*.json")


if __name__ == "__main__":
    main()
