"""A team's `generate` call with each layer's projections packed as stacked products (the default) and one by one.

    python benchmarks/stacked_projections.py                 # SmolLM2-135M, N=2, K=4, 2 items per call, 48 tokens
    python benchmarks/stacked_projections.py --json out.json

Each run is one joint decoding call of a fully fine-tuned two-agent team at the tutorial's generation shape (two
updates' items per call: 8 rows per agent, 48 new tokens, bf16 on a CPU with bf16 units). Stacked: the default, a
decoder layer's q, k and v projections and its gate and up projections run as one packed product per agent
(`comlrl_trl/adapters/packed_linear.py`, `PackedLinears`); one by one: every layer packed and run alone, as before.
Both draw the same tokens (checked on every pair). Process CPU seconds, one thread, runs alternating between the two
(the first pair is a warm-up and left out); the table gives the median of each and the median of the per-pair ratio.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="alternating pairs of calls after the warm-up pair")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()

    import torch
    from datasets import Dataset

    from comlrl_trl.adapters import grpo
    from comlrl_trl.demo_model import demo_model_path
    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    torch.set_num_threads(1)
    prompts = [f"Task {i}: write a short note about topic number {i}." for i in range(2)]
    team = MAGRPOTrainer(
        agent_model=demo_model_path(),
        num_agents=2,
        reward_func=lambda completions_0, completions_1: [0.0] * len(completions_0),
        args=MAGRPOConfig(
            output_dir="/tmp/comlrl-trl-stacked", num_agents=2, max_new_tokens=args.tokens, report_to="none"
        ),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    generation = team.orchestrator.team_generation
    rows = [prompt for prompt in prompts for _ in range(4)]
    stacked_groups = grpo.shared_input_projections

    def run(mode: str, seed: int) -> tuple[float, list]:
        grpo.shared_input_projections = stacked_groups if mode == "stacked" else (lambda model: [])
        torch.manual_seed(seed)
        start = time.process_time()
        rollouts = generation([rows, rows])
        return time.process_time() - start, [rollout.completion_ids for rollout in rollouts]

    seconds = {"stacked": [], "one by one": []}
    for pair in range(args.pairs + 1):
        order = ("stacked", "one by one") if pair % 2 else ("one by one", "stacked")
        results = {mode: run(mode, seed=pair) for mode in order}
        if results["stacked"][1] != results["one by one"][1]:
            raise AssertionError(f"pair {pair}: the two ways drew different tokens")
        if pair:  # the first pair warms up
            for mode, (cpu, _) in results.items():
                seconds[mode].append(cpu)
    grpo.shared_input_projections = stacked_groups
    ratios = [s / o for s, o in zip(seconds["stacked"], seconds["one by one"])]
    result = {
        "tokens": args.tokens,
        "rows_per_agent": len(rows),
        "median_cpu_s": {mode: statistics.median(values) for mode, values in seconds.items()},
        "median_ratio_stacked_to_one_by_one": statistics.median(ratios),
        "cpu_s": seconds,
    }
    print("| team generate call (N=2, 8 rows each) | median CPU-s |")
    print("|---|---|")
    for mode, value in result["median_cpu_s"].items():
        print(f"| {mode} | {value:.3f} |")
    print(f"median per-pair ratio, stacked / one by one: {result['median_ratio_stacked_to_one_by_one']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
