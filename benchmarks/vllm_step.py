"""MAGRPO time per step with and without vLLM: two SmolLM2-135M agents, the same settings, one thread.

    make bench-vllm                                          # in .venv-vllm (make install-vllm)
    .venv-vllm/bin/python benchmarks/vllm_step.py --items 16 --tokens 32

Runs `benchmarks/profile_step.py` (one epoch at the documented defaults, K=4) twice in fresh processes, with
`use_vllm=False` (transformers `generate`) and `use_vllm=True` (the team's vLLM engines), plus `--lora` variants with
`--lora`. Engine start-up happens at construction and is not timed; the first generation (vLLM's warm-up) is. Prints a
table of CPU seconds per phase and wall seconds per step, and writes `benchmarks/results/vllm-step-<date>.json`.

With vLLM, TRL's importance-sampling correction (`vllm_importance_sampling_correction=True`, the default) needs the
trainer's log-probabilities of every completion. TRL computes them in one extra forward pass per generation (counted
under "scoring"); on-policy, as at the defaults, the team trainers take them from the loss's forward instead
(docs/vllm.md). `vllm-step-2026-12-01.json` was measured before that change, with the extra forward.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent


def run(items: int, tokens: int, vllm: bool, lora: bool, extra: list[str]) -> dict:
    command = [
        sys.executable,
        str(HERE / "profile_step.py"),
        "--model",
        "smollm2",
        "--items",
        str(items),
        "--tokens",
        str(tokens),
        "--set",
        f"use_vllm={str(vllm).lower()}",
        *extra,
    ]
    if lora:
        command += ["--lora", "--set", "vllm_lora_mode=merged"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(output.strip().splitlines()[-1])
    return {
        "generation": "vllm" if vllm else "transformers",
        "training": "lora (merged engines)" if lora else "full",
        **result,
        "wall_seconds_per_step": result["wall_seconds"] / max(result["steps"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--lora", action="store_true", help="also the LoRA agents' rows")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a MAGRPOConfig field")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    extra = [item for setting in args.set for item in ("--set", setting)]
    rows = [
        run(args.items, args.tokens, vllm, lora, extra)
        for lora in ([False, True] if args.lora else [False])
        for vllm in (False, True)
    ]
    print(
        f"{'generation':<13}{'training':<22}{'steps':>6}{'wall s/step':>13}{'generation':>12}{'scoring':>9}"
        f"{'fwd/bwd':>9}{'optim':>7}"
    )
    for row in rows:
        phases = row["phases"]
        print(
            f"{row['generation']:<13}{row['training']:<22}{row['steps']:>6}{row['wall_seconds_per_step']:>13.1f}"
            f"{phases['generation']:>12.1f}{phases['scoring']:>9.1f}{phases['forward/backward']:>9.1f}"
            f"{phases['optimiser']:>7.1f}"
        )
    for training in sorted({row["training"] for row in rows}):
        plain, vllm = (
            next(r for r in rows if r["training"] == training and r["generation"] == g)
            for g in ("transformers", "vllm")
        )
        print(
            f"{training}: step time with vLLM / without = "
            f"{vllm['wall_seconds_per_step'] / plain['wall_seconds_per_step']:.2f}, generation CPU seconds "
            f"{vllm['phases']['generation'] / plain['phases']['generation']:.2f}"
        )
    path = args.json or HERE / "results" / f"vllm-step-{datetime.date.today()}.json"
    settings = {
        "items": args.items,
        "tokens": args.tokens,
        "set": args.set,
        "cpu": platform.processor() or platform.machine(),
    }
    path.write_text(json.dumps({"settings": settings, "results": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
