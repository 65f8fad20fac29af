"""Learning per CPU second: the seed tutorial trained with comlrl_trl and with the peer (CoMLRL 1.4.3), evaluated alike.

    python benchmarks/learning.py                      # both systems at their defaults, seeds 0 1 2 (about 75 min)
    python benchmarks/learning.py --seeds 0 --systems ours
    python benchmarks/learning.py --row "on-policy=steps_per_generation=1"   # an extra row: ours with a default changed
    python benchmarks/learning.py --chat --tag chat    # the prompts under the chat template, for both systems
    python benchmarks/learning.py --systems ours --row "fp32=bf16=false" --forward-weights bf16   # a diagnostic

The run is the documentation's length-ratio tutorial on SmolLM2-135M-Instruct, fully fine-tuned, one torch thread:
ten prompts, `--epochs` 3, learning rate 5e-5, K=4 completions, 48 new tokens, written through each package's
documented API with its defaults for everything else (`learning_worker.py`). Training rewards are not comparable
across packages (each samples at its own temperature), so every team is scored by one protocol
(`learning_task.py`): the ten prompts as plain text (`--chat`: as the chat template's text, in training too), 4
samples at temperature 1 from a fixed seed plus a greedy completion, the mean of the two; after the last epoch also
ten held-out prompts. The untrained team is evaluated once. The x axis is CPU seconds of `train()` without the
evaluations.

Prints a table (reward after each epoch, mean and spread over seeds, CPU seconds, updates) and the ratios the
targets are stated in: final reward ours/peer and CPU seconds ours/peer. Writes
`benchmarks/results/learning-<date>.json` and a chart `benchmarks/results/learning.png` (mean and min-max band across
seeds against CPU seconds).
"""

import argparse
import datetime
import enum
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench import PEER_PYTHON, ensure_peer_venv
from weight_rounding import FORWARD_WEIGHTS


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def parse_row(text: str) -> tuple[str, dict]:
    """`LABEL=key=value,key=value` -> (LABEL, {key: value}); values are parsed as JSON where they parse."""
    label, _, assignments = text.partition("=")
    if not label or not assignments:
        raise argparse.ArgumentTypeError(f"--row takes LABEL=key=value[,key=value...], got {text!r}")
    overrides = {}
    for assignment in assignments.split(","):
        key, sep, value = assignment.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--row: {assignment!r} is not key=value")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return label, overrides


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


# The settings of ours that decide what a run learns; a cached run of ours is reused only where they are the same.
CONFIG_FIELDS = (
    "lr_scheduler_type",
    "weight_decay",
    "max_grad_norm",
    "loss_type",
    "epsilon",
    "beta",
    "num_iterations",
    "temperature",
    "logprob_temperature",
    "top_p",
    "top_k",
    "steps_per_generation",
    "per_device_train_batch_size",
    "scale_rewards",
    "advantage_mode",
)


def effective_config(overrides: dict) -> dict:
    """The `CONFIG_FIELDS` of the configuration a run of ours with `overrides` trains with (library defaults
    included), so that a cached run measured under other defaults is not taken for a current one."""
    from comlrl_trl.trainers.reinforce import MAGRPOConfig

    config = MAGRPOConfig(output_dir="/tmp/learning-config", report_to="none", **overrides)
    values = {name: getattr(config, name) for name in CONFIG_FIELDS}
    return {name: value.value if isinstance(value, enum.Enum) else value for name, value in values.items()}


def cached_run(runs_dir: Path, name: str, system: str, settings: dict, config: dict | None = None) -> dict:
    """A worker's result, reused from `runs_dir/name.json` when an earlier invocation wrote it (runs are long: a
    stopped benchmark resumes where it stopped). Delete the directory to measure everything again.

    `config` (ours: `effective_config`) is stored with the result; a cached result measured with other values
    (a library default changed since) raises instead of being reused."""
    path = runs_dir / f"{name}.json"
    if path.exists():
        result = json.loads(path.read_text())
        stored = result.get("config")
        if config is not None and stored != config:
            changed = sorted(k for k in config if (stored or {}).get(k) != config[k]) if stored else "unrecorded"
            raise ValueError(
                f"{path} was measured with other settings ({changed}: {stored} against {config} now); "
                "delete it (or rename it for the row it belongs to) to measure again."
            )
        print(f"  reusing {path}", flush=True)
        return result
    result = run_worker(system, settings)
    if config is not None:
        result["config"] = config
    runs_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def run_worker(system: str, settings: dict) -> dict:
    python = str(PEER_PYTHON) if system == "peer" else sys.executable
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": "" if system == "peer" else str(ROOT),
    }
    out = subprocess.run(
        [python, str(HERE / "learning_worker.py"), system, json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{system} run failed ({settings}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(label: str, runs: list[dict]) -> dict:
    """Mean and spread over seeds of the reward after each epoch and of the CPU seconds."""
    epochs = len(runs[0]["points"])
    per_epoch = []
    for e in range(epochs):
        rewards = [run["points"][e]["reward"] for run in runs]
        cpu = [run["points"][e]["train_cpu_s"] for run in runs]
        per_epoch.append(
            {
                "epoch": runs[0]["points"][e]["epoch"],
                "reward_mean": statistics.mean(rewards),
                "reward_min": min(rewards),
                "reward_max": max(rewards),
                "cpu_s_mean": statistics.mean(cpu),
            }
        )
    held_out = [run["points"][-1]["held_out"]["reward"] for run in runs if "held_out" in run["points"][-1]]
    return {
        "label": label,
        "seeds": [run["seed"] for run in runs],
        "updates": runs[0]["updates"],
        "per_epoch": per_epoch,
        "final_reward": per_epoch[-1]["reward_mean"],
        "final_held_out_reward": statistics.mean(held_out) if held_out else None,
        "cpu_s": per_epoch[-1]["cpu_s_mean"],
    }


def cpu_to_reach(summary: dict, target: float) -> float | None:
    """CPU seconds at which the mean curve first reaches `target` (linear between evaluations), or None."""
    previous = None
    for point in summary["per_epoch"]:
        if point["reward_mean"] >= target:
            if previous is None:
                return point["cpu_s_mean"]
            frac = (target - previous["reward_mean"]) / (point["reward_mean"] - previous["reward_mean"])
            return previous["cpu_s_mean"] + frac * (point["cpu_s_mean"] - previous["cpu_s_mean"])
        previous = point
    return None


def plot(rows: dict, initial: dict, path: Path, chat: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, data in rows.items():
        runs = data["runs"]
        xs = [0.0] + [
            statistics.mean(r["points"][e]["train_cpu_s"] for r in runs) for e in range(len(runs[0]["points"]))
        ]
        per_seed = [[initial["reward"]] + [p["reward"] for p in r["points"]] for r in runs]
        mean = [statistics.mean(v) for v in zip(*per_seed)]
        ax.plot(xs, mean, marker="o", label=f"{label} ({len(runs)} seeds)")
        ax.fill_between(xs, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)], alpha=0.2)
    ax.set_xlabel("CPU seconds of train() (one thread, evaluations excluded)")
    ax.set_ylabel("evaluated reward (T=1 samples and greedy)")
    ax.set_title("Length-ratio tutorial, SmolLM2-135M, full fine-tuning" + (", chat prompts" if chat else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--systems", nargs="+", default=["ours", "peer"], choices=["ours", "peer"])
    parser.add_argument(
        "--row", type=parse_row, action="append", default=[], help="LABEL=key=value,...: an extra row of ours"
    )
    parser.add_argument(
        "--row-seeds", type=int, nargs="+", default=None, help="seeds of the --row runs (default: --seeds)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--chat",
        action="store_true",
        help="prompts as the chat template's text of one user message (runs named *-chat)",
    )
    parser.add_argument(
        "--forward-weights",
        choices=["as-trained", *FORWARD_WEIGHTS],
        default="as-trained",
        help="bf16: the --row runs (which must set bf16=false) multiply by their fp32 weights rounded to bf16, "
        "everything else fp32 (weight_rounding.py); bf16-stochastic: rounded stochastically; bf16-relative: the "
        "initial weights' bf16 values moved by whole spacings (relative_bf16); their labels say so",
    )
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument(
        "--runs-dir", type=Path, default=RESULTS / "learning-runs", help="each run's result, reused when present"
    )
    args = parser.parse_args()
    rounded = args.forward_weights != "as-trained"
    if rounded and (not args.row or any(overrides.get("bf16") is not False for _, overrides in args.row)):
        parser.error(
            f"--forward-weights {args.forward_weights} applies to --row runs with bf16=false (under bf16 autocast "
            "the forward rounds its weights already)"
        )

    sys.path.insert(0, str(ROOT))
    from comlrl_trl.hardware import cpu_has_fast_bf16, cpu_model
    from comlrl_trl.models.demo import demo_model_path

    base = {"model": demo_model_path(), "epochs": args.epochs, "lr": 5e-5, "k": 4, "tokens": 48, "eval_samples": 4}
    base["chat"] = args.chat
    runs_suffix = "-chat" if args.chat else ""
    if "peer" in args.systems:
        ensure_peer_venv()
    row_seeds = args.seeds if args.row_seeds is None else args.row_seeds
    plan = [(system, system if system == "peer" else "ours (defaults)", {}, args.seeds) for system in args.systems]
    suffix = f", {FORWARD_WEIGHTS[args.forward_weights].label}" if rounded else ""
    plan += [("ours", f"ours, {label}{suffix}", overrides, row_seeds) for label, overrides in args.row]
    # Once per row, before any run: a row whose overrides MAGRPOConfig refuses fails here, not after hours of runs.
    configs = {
        label: effective_config(overrides) if system == "ours" else None for system, label, overrides, _ in plan
    }
    rounded_rows = {f"ours, {label}{suffix}" for label, _ in args.row} if rounded else set()
    for label in rounded_rows:  # so that a cached run without the rounding is not reused for it
        configs[label]["forward_weights"] = args.forward_weights

    print("evaluating the untrained team ...", flush=True)
    initial = cached_run(
        args.runs_dir, f"initial{runs_suffix}", "initial", dict(base, seed=0, output_dir="/tmp/learning-initial")
    )
    initial = initial["points"][0]
    rows = {}
    for seed in sorted(set(args.seeds) | set(row_seeds)):  # seeds outermost: a stopped run has every row of the first
        for system, label, overrides, seeds in plan:
            if seed not in seeds:
                continue
            settings = dict(base, seed=seed, output_dir=f"/tmp/learning-{system}-{seed}", overrides=overrides)
            if label in rounded_rows:
                settings["forward_weights"] = args.forward_weights
            print(f"{label}, seed {seed} ...", flush=True)
            run = cached_run(args.runs_dir, f"{slug(label)}{runs_suffix}-seed{seed}", system, settings, configs[label])
            run["seed"] = seed
            rows.setdefault(label, {"system": system, "overrides": overrides, "runs": []})["runs"].append(run)
            print(
                f"  reward {run['points'][-1]['reward']:.3f} after {run['points'][-1]['train_cpu_s']:.0f} CPU-s",
                flush=True,
            )

    summaries = {label: summarise(label, data["runs"]) for label, data in rows.items()}
    print(f"\nuntrained: reward {initial['reward']:.3f}, held-out {initial['held_out']['reward']:.3f}")
    header = f"{'row':<40} {'updates':>7} " + " ".join(f"{'ep' + str(e + 1):>13}" for e in range(args.epochs))
    print(header + f" {'held-out':>9} {'CPU-s':>7}")
    for label, s in summaries.items():
        cells = " ".join(
            f"{p['reward_mean']:.3f}±{(p['reward_max'] - p['reward_min']) / 2:.3f}" for p in s["per_epoch"]
        )
        held = f"{s['final_held_out_reward']:.3f}" if s["final_held_out_reward"] is not None else "-"
        print(f"{label:<40} {s['updates']:>7} {cells} {held:>9} {s['cpu_s']:>7.0f}")

    ratios = {}
    peer = summaries.get("peer")
    if peer:
        for label, s in summaries.items():
            if label == "peer":
                continue
            reach = cpu_to_reach(s, peer["final_reward"])
            ratios[label] = {
                "final reward ours/peer (target >= 1)": s["final_reward"] / peer["final_reward"],
                "CPU-s ours/peer (target <= 1/3)": s["cpu_s"] / peer["cpu_s"],
                "CPU-s to reach the peer's final reward, ours/peer": None if reach is None else reach / peer["cpu_s"],
            }
        print()
        for label, r in ratios.items():
            print(label + ": " + ", ".join(f"{k} = {'-' if v is None else f'{v:.2f}'}" for k, v in r.items()))

    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    out = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(),
            "bf16_units": cpu_has_fast_bf16(),  # whether ours trains in bf16 at defaults here
            "cpus": os.cpu_count(),
        },
        "settings": base,
        "initial": initial,
        "rows": rows,
        "summaries": summaries,
        "ratios": ratios,
    }
    json_path = RESULTS / f"learning-{stamp}.json"
    json_path.write_text(json.dumps(out, indent=1))
    plot(rows, initial, RESULTS / f"learning{('-' + args.tag) if args.tag else ''}.png", chat=args.chat)
    print(f"\nwrote {json_path} and the chart beside it")


if __name__ == "__main__":
    main()
