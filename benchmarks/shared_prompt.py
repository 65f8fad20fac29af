"""The loss forward and backward of one micro-batch, with its shared prompts packed (the default) and without.

    python benchmarks/shared_prompt.py                      # SmolLM2-135M, 4 rows, the shapes below
    python benchmarks/shared_prompt.py --json out.json

Each row times an agent's `logps_and_entropies` plus the backward of the log-probabilities' sum (what
TRL's loss does per micro-batch) on 4 rows of random tokens: `distinct` prompts of `prompt` tokens (rows alternate
between them), completions of `completion` tokens. Packed: the default (`comlrl_trl/adapters/shared_prompt.py`);
unpacked: every row through the model as TRL runs it. Process CPU seconds, one thread, median of `--repeats`
alternating runs after one warm-up of each.
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

# (prompt tokens, completion tokens, distinct prompts among the 4 rows)
SHAPES = [(14, 16, 2), (14, 48, 2), (150, 64, 1), (150, 64, 2), (400, 128, 1)]


def micro_batch(vocabulary: int, prompt: int, completion: int, distinct: int, rows: int = 4):
    import torch

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocabulary, (prompt,), generator=generator) for _ in range(distinct)]
    ids = torch.stack([prompts[r % distinct] for r in range(rows)])
    ids = torch.cat([ids, torch.randint(3, vocabulary, (rows, completion), generator=generator)], dim=1)
    return ids, torch.ones_like(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    import torch
    from datasets import Dataset

    from comlrl_trl.adapters import shared_prompt
    from comlrl_trl.models.demo import demo_model_path
    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    torch.set_num_threads(1)
    team = MAGRPOTrainer(
        agent_model=demo_model_path(),
        num_agents=1,
        reward_func=lambda completions: [0.0] * len(completions),
        args=MAGRPOConfig(output_dir="/tmp/comlrl-trl-shared-prompt", num_agents=1, report_to="none"),
        train_dataset=Dataset.from_dict({"prompt": ["unused"]}),
    )
    agent = team.agent_trainers[0]
    model = agent.model
    default = shared_prompt.MIN_SAVED_WORK

    def step(ids, mask, completion, packed: bool) -> float:
        shared_prompt.MIN_SAVED_WORK = default if packed else float("inf")
        model.zero_grad(set_to_none=False)
        start = time.process_time()
        logps, _, _ = agent.logps_and_entropies(model, ids, mask, completion, compute_entropy=True)
        logps.sum().backward()
        return time.process_time() - start

    rows = []
    print(f"{'prompt':>6} {'completion':>10} {'distinct':>8} {'unpacked s':>10} {'packed s':>8} {'speed-up':>8}")
    for prompt, completion, distinct in SHAPES:
        ids, mask = micro_batch(model.config.vocab_size, prompt, completion, distinct)
        step(ids, mask, completion, True), step(ids, mask, completion, False)  # warm-up
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for packed in (False, True):
                times[packed].append(step(ids, mask, completion, packed))
        unpacked, packed = statistics.median(times[False]), statistics.median(times[True])
        row = dict(prompt=prompt, completion=completion, distinct=distinct, unpacked_s=unpacked, packed_s=packed)
        rows.append(row | {"speed_up": unpacked / packed})
        print(
            f"{prompt:>6} {completion:>10} {distinct:>8} {unpacked:>10.2f} {packed:>8.2f} {unpacked / packed:>7.2f}x"
        )
    shared_prompt.MIN_SAVED_WORK = default
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "threads": 1, "model": "SmolLM2-135M"}, indent=2))


if __name__ == "__main__":
    main()
