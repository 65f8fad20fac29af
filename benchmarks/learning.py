"""Learning per CPU second: the seed tutorial trained with comlrl_trl and with the peer (CoMLRL 1.4.3), evaluated alike.

    python benchmarks/learning.py                      # both systems at their defaults, seeds 0 1 2 (about 75 min)
    python benchmarks/learning.py --seeds 0 --systems ours
    python benchmarks/learning.py --row "on-policy=steps_per_generation=1"   # an extra row: ours with a default changed
    python benchmarks/learning.py --chat --tag chat    # the prompts under the chat template, for both systems
    python benchmarks/learning.py --systems ours --row "fp32=bf16=false" --forward-weights bf16   # a diagnostic
    python benchmarks/learning.py --budget --seeds 0 1 2 3 4 --jobs 2            # budget mode (below), ~2.5 h
    python benchmarks/learning.py --budget --lora --seeds 0 1 2 3 4 --jobs 2     # with the LoRA rows, ~4 h
    python benchmarks/learning.py --budget --model tiny --seeds 0 --epochs 1 --runs-dir /tmp/lb --tag smoke  # smoke

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

Budget mode (`--budget`): learning per CPU second at equal CPU time. The peer trains its `--epochs` (3) epochs,
evaluated after each as above; every row of ours then trains for the peer's CPU seconds of `train()` on the same seed
(evaluations excluded; as many epochs as that takes), evaluated by the same protocol at `--marks` evenly spaced
CPU-second marks (6: every sixth of the budget; the held-out prompts at the last). Rows: `ours bf16` (`bf16=True`)
and `ours fp32` (`bf16=False`), with `--lora` also both under LoRA (ours only: the peer has none; r 16, alpha 32, q and
v projections, `--lora-lr` 1e-3, the demo's adapters), and any `--row`. Evaluations restore the torch RNG, so that
they do not change what a run samples. Runs go `--jobs` at a time (one per core: 2 on a 2-core machine), each
peer's rows as soon as its budget is known, and are cached in `--runs-dir` (default `results/learning-budget-runs/`).
Prints per row the reward at every evaluation (mean ± half the min-max range over seeds) against CPU seconds and
the fraction of the peer's budget, the fraction of the peer's budget at which the mean curve of ours first reaches
the peer's final reward (linear between evaluations, from the untrained team at 0) and per seed against that seed's
peer, and the ratio ours/peer of the reward at the peer's whole budget. Writes
`benchmarks/results/learning-budget-<date>.json` and `learning-budget.png` (every row on one CPU-second axis, mean and
min-max band across seeds; the peer's points at its epoch ends). `--budget-cpu-s` fixes the budget instead of the
peer's (smoke tests; with `--systems ours` no peer runs); `--model tiny` trains the library's tiny test model.
"""

import argparse
import concurrent.futures
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

from bench import PEER_PYTHON, ensure_peer_venv, worker_env
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
    env = worker_env(system)
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


# ----- budget mode (`--budget`) -----

#: The demo's adapters (recipes/configs/length_ratio_smollm2.yaml).
LORA = {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]}


def budget_rows(args) -> list[tuple[str, dict, dict]]:
    """(label, MAGRPOConfig overrides, extra worker settings) of every row of ours in budget mode."""
    rows = [("ours bf16", {"bf16": True}, {}), ("ours fp32", {"bf16": False}, {})]
    if args.lora:
        lora = {"lora": LORA, "lr": args.lora_lr}
        rows += [("ours bf16 LoRA", {"bf16": True}, lora), ("ours fp32 LoRA", {"bf16": False}, lora)]
    rows += [(f"ours, {label}", overrides, {}) for label, overrides in args.row]
    return rows


def budget_summary(label: str, runs: list[dict], budgets: dict, initial: float) -> dict:
    """Mean and min-max over seeds of the reward at every evaluation of a row, against the mean CPU seconds and the
    mean fraction of each seed's budget (the untrained team at 0 first)."""
    count = min(len(run["points"]) for run in runs)
    points = [{"cpu_s_mean": 0.0, "fraction_mean": 0.0, "reward_mean": initial, "reward_min": initial}]
    points[0]["reward_max"] = initial
    for i in range(count):
        at = [run["points"][i] for run in runs]
        rewards = [p["reward"] for p in at]
        points.append(
            {
                "cpu_s_mean": statistics.mean(p["train_cpu_s"] for p in at),
                "fraction_mean": statistics.mean(p["train_cpu_s"] / budgets[run["seed"]] for p, run in zip(at, runs)),
                "epoch_mean": statistics.mean(p["epoch"] for p in at),
                "updates_mean": statistics.mean(p["updates"] for p in at),
                "reward_mean": statistics.mean(rewards),
                "reward_min": min(rewards),
                "reward_max": max(rewards),
            }
        )
    held_out = [run["points"][count - 1]["held_out"]["reward"] for run in runs if "held_out" in run["points"][-1]]
    return {
        "label": label,
        "seeds": [run["seed"] for run in runs],
        "points": points,
        "final_reward": points[-1]["reward_mean"],
        "final_held_out_reward": statistics.mean(held_out) if held_out else None,
        "cpu_s": points[-1]["cpu_s_mean"],
        "budget_reached": all(run["points"][-1].get("budget_reached", True) for run in runs),
    }


def first_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x at which the curve (linear between points) reaches `target`, or None."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (target - y0) / (y - y0) * (x - x0)
    return None


def budget_comparison(summary: dict, peer: dict, runs: list[dict], peer_runs: dict, initial: float) -> dict:
    """How a row of ours compares with the peer at equal CPU time: the fraction of the peer's budget at which the mean
    curve first reaches the peer's final mean reward (and per seed, against that seed's peer), and the ratios of the
    final rewards at the peer's whole budget."""
    points = summary["points"]
    fraction = first_reach(
        [p["fraction_mean"] for p in points], [p["reward_mean"] for p in points], peer["final_reward"]
    )
    per_seed = {}
    for run in runs:
        target = peer_runs[run["seed"]]["points"][-1]["reward"]
        budget = peer_runs[run["seed"]]["points"][-1]["train_cpu_s"]
        xs = [0.0] + [p["train_cpu_s"] / budget for p in run["points"]]
        per_seed[run["seed"]] = first_reach(xs, [initial] + [p["reward"] for p in run["points"]], target)
    held = summary["final_held_out_reward"], peer["final_held_out_reward"]
    return {
        "fraction of the peer's budget to reach its final reward (mean curves)": fraction,
        "CPU-s to reach the peer's final reward (mean curves)": None if fraction is None else fraction * peer["cpu_s"],
        "fraction to reach it, per seed (against that seed's peer)": per_seed,
        "reward ours/peer at the peer's whole budget": summary["final_reward"] / peer["final_reward"],
        "held-out reward ours/peer at the peer's whole budget": held[0] / held[1] if None not in held else None,
    }


def budget_plot(rows: dict, summaries: dict, initial: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, data in rows.items():
        runs = data["runs"]
        count = len(summaries[label]["points"]) - 1
        xs = [0.0] + [statistics.mean(r["points"][i]["train_cpu_s"] for r in runs) for i in range(count)]
        per_seed = [[initial] + [r["points"][i]["reward"] for i in range(count)] for r in runs]
        mean = [statistics.mean(v) for v in zip(*per_seed)]
        marker, style = ("s", "--") if data["system"] == "peer" else ("o", "-")
        line = ax.plot(xs, mean, marker=marker, linestyle=style, label=f"{label} ({len(runs)} seeds)")[0]
        ax.fill_between(
            xs, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)], alpha=0.15, color=line.get_color()
        )
    if "peer" in summaries:
        peer = summaries["peer"]
        ax.axvline(peer["cpu_s"], color="gray", linewidth=1, linestyle=":", label="the peer's budget")
        ax.axhline(peer["final_reward"], color="gray", linewidth=1, linestyle="-.", label="the peer's final reward")
    ax.set_xlabel("CPU seconds of train() (one thread, evaluations excluded)")
    ax.set_ylabel("evaluated reward (T=1 samples and greedy)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def budget_main(args, parser) -> None:
    """`--budget`: the peer for its epochs, every row of ours for the peer's CPU seconds of the same seed."""
    if args.forward_weights != "as-trained":
        parser.error("--budget does not round forward weights")
    if "peer" not in args.systems and args.budget_cpu_s is None:
        parser.error("--budget without the peer needs --budget-cpu-s")
    runs_dir = args.runs_dir or RESULTS / "learning-budget-runs"
    sys.path.insert(0, str(ROOT))
    from comlrl_trl.integrations.machine import cpu_model
    from comlrl_trl.precision import cpu_has_fast_bf16

    if args.model == "tiny":
        from comlrl_trl.testing import tiny_model_path

        model = tiny_model_path("qwen2")
    else:
        from comlrl_trl.models.demo import demo_model_path

        model = demo_model_path()
    base = {"model": model, "epochs": args.epochs, "lr": 5e-5, "k": 4, "tokens": 48, "eval_samples": 4}
    base.update(chat=args.chat, keep_rng=True)
    runs_suffix = ("-chat" if args.chat else "") + ("-tiny" if args.model == "tiny" else "")
    with_peer = "peer" in args.systems
    if with_peer:
        ensure_peer_venv()
    rows_of_ours = budget_rows(args) if "ours" in args.systems else []
    configs = {}
    for label, overrides, extra in rows_of_ours:  # a row MAGRPOConfig refuses fails here, before any run
        configs[label] = effective_config(overrides) | {"lora": extra.get("lora"), "lr": extra.get("lr", base["lr"])}
    peer_config = {"epochs": args.epochs, "model": args.model, "chat": args.chat, "keep_rng": True}

    def ours_job(seed: int, budget_cpu_s: float, label: str, overrides: dict, extra: dict) -> tuple:
        marks = [budget_cpu_s * (i + 1) / args.marks for i in range(args.marks)]
        settings = dict(base, seed=seed, overrides=overrides, budget_cpu_s=budget_cpu_s, marks=marks, **extra)
        settings.update(max_epochs=args.max_epochs, output_dir=f"/tmp/learning-budget-{slug(label)}-{seed}")
        config = dict(configs[label], budget_cpu_s=budget_cpu_s, marks=args.marks, max_epochs=args.max_epochs)
        print(f"{label}, seed {seed}: {budget_cpu_s:.0f} CPU-s ...", flush=True)
        return (
            label,
            seed,
            cached_run(runs_dir, f"budget-{slug(label)}{runs_suffix}-seed{seed}", "ours", settings, config),
        )

    def peer_job(seed: int) -> tuple:
        settings = dict(base, seed=seed, output_dir=f"/tmp/learning-budget-peer-{seed}")
        print(f"peer, seed {seed} ...", flush=True)
        return (
            "peer",
            seed,
            cached_run(runs_dir, f"budget-peer{runs_suffix}-seed{seed}", "peer", settings, peer_config),
        )

    def initial_job() -> tuple:
        settings = dict(base, seed=0, output_dir="/tmp/learning-initial")
        return "initial", 0, cached_run(runs_dir, f"initial{runs_suffix}", "initial", settings, peer_config)

    print(f"budget mode: {len(args.seeds)} seeds, {args.jobs} runs at a time", flush=True)
    results: dict[str, dict[int, dict]] = {}
    budgets: dict[int, float] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pending = {pool.submit(initial_job)}
        for seed in args.seeds:
            if with_peer:
                pending.add(pool.submit(peer_job, seed))
            else:
                budgets[seed] = args.budget_cpu_s
                pending |= {pool.submit(ours_job, seed, args.budget_cpu_s, *row) for row in rows_of_ours}
        while pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                label, seed, run = future.result()
                run["seed"] = seed
                results.setdefault(label, {})[seed] = run
                last = run["points"][-1]
                print(
                    f"  {label}, seed {seed}: reward {last['reward']:.3f} at {last['train_cpu_s']:.0f} CPU-s",
                    flush=True,
                )
                if label == "peer":
                    budgets[seed] = args.budget_cpu_s or last["train_cpu_s"]
                    pending |= {pool.submit(ours_job, seed, budgets[seed], *row) for row in rows_of_ours}

    initial = results.pop("initial")[0]["points"][0]
    order = (["peer"] if with_peer else []) + [label for label, _, _ in rows_of_ours]
    rows = {
        label: {
            "system": "peer" if label == "peer" else "ours",
            "runs": [results[label][seed] for seed in args.seeds],
        }
        for label in order
    }
    summaries = {
        label: budget_summary(label, data["runs"], budgets, initial["reward"]) for label, data in rows.items()
    }
    comparisons = {}
    if with_peer:
        peer_runs = results["peer"]
        for label in order[1:]:
            comparisons[label] = budget_comparison(
                summaries[label], summaries["peer"], rows[label]["runs"], peer_runs, initial["reward"]
            )

    print(f"\nuntrained: reward {initial['reward']:.3f}, held-out {initial['held_out']['reward']:.3f}")
    print(f"budgets (CPU-s of train(), per seed): {', '.join(f'{s}: {b:.0f}' for s, b in budgets.items())}")
    print(f"{'row':<24} {'point':>6} {'CPU-s':>7} {'budget':>7} {'epoch':>6} {'reward (± half-range)':>22}")
    for label, s in summaries.items():
        for i, p in enumerate(s["points"][1:], start=1):
            where = f"ep{i}" if label == "peer" else f"m{i}"
            print(
                f"{label:<24} {where:>6} {p['cpu_s_mean']:>7.0f} {p['fraction_mean']:>7.2f} {p['epoch_mean']:>6.2f} "
                f"{p['reward_mean']:>14.3f}±{(p['reward_max'] - p['reward_min']) / 2:.3f}"
            )
        held = "-" if s["final_held_out_reward"] is None else f"{s['final_held_out_reward']:.3f}"
        print(f"{'':<24} held-out at the end: {held}" + ("" if s["budget_reached"] else " (budget not reached)"))
    for label, c in comparisons.items():
        print(f"\n{label}:")
        for key, value in c.items():
            if isinstance(value, dict):
                value = ", ".join(f"{seed}: {'-' if v is None else f'{v:.2f}'}" for seed, v in value.items())
            elif value is not None:
                value = f"{value:.3f}"
            print(f"  {key}: {'- (not reached)' if value is None else value}")

    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    out = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(),
            "bf16_units": cpu_has_fast_bf16(),
            "cpus": os.cpu_count(),
        },
        "settings": dict(base, model=args.model, marks=args.marks, jobs=args.jobs, lora=LORA, lora_lr=args.lora_lr),
        "budgets": budgets,
        "initial": initial,
        "rows": rows,
        "summaries": summaries,
        "comparisons": comparisons,
    }
    json_path = RESULTS / f"learning-budget-{stamp}.json"
    json_path.write_text(json.dumps(out, indent=1))
    chart = RESULTS / f"learning-budget{('-' + args.tag) if args.tag else ''}.png"
    model_name = "SmolLM2-135M" if args.model == "demo" else "tiny test model"
    title = f"Length-ratio tutorial, {model_name}: the peer's {args.epochs} epochs against ours in its CPU time"
    budget_plot(rows, summaries, initial["reward"], chart, title + (", chat prompts" if args.chat else ""))
    print(f"\nwrote {json_path} and {chart}")


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
        "--runs-dir",
        type=Path,
        default=None,
        help="each run's result, reused when present (default results/learning-runs, with --budget "
        "results/learning-budget-runs)",
    )
    budget = parser.add_argument_group("budget mode")
    budget.add_argument("--budget", action="store_true", help="ours trains for the peer's CPU seconds (above)")
    budget.add_argument("--marks", type=int, default=6, help="evaluations of ours, evenly spaced in CPU seconds")
    budget.add_argument("--lora", action="store_true", help="also the LoRA rows of ours (bf16 and fp32)")
    budget.add_argument("--lora-lr", type=float, default=1e-3, help="the LoRA rows' learning rate (the demo's)")
    budget.add_argument(
        "--budget-cpu-s", type=float, default=None, help="a fixed budget instead of the peer's (smoke tests)"
    )
    budget.add_argument("--max-epochs", type=int, default=50, help="ours stops here if the budget lasts longer")
    budget.add_argument("--jobs", type=int, default=2, help="runs at a time (one per core)")
    budget.add_argument("--model", choices=["demo", "tiny"], default="demo", help="tiny: the library's test model")
    args = parser.parse_args()
    if args.budget:
        budget_main(args, parser)
        return
    if args.runs_dir is None:
        args.runs_dir = RESULTS / "learning-runs"
    rounded = args.forward_weights != "as-trained"
    if rounded and (not args.row or any(overrides.get("bf16") is not False for _, overrides in args.row)):
        parser.error(
            f"--forward-weights {args.forward_weights} applies to --row runs with bf16=false (under bf16 autocast "
            "the forward rounds its weights already)"
        )

    sys.path.insert(0, str(ROOT))
    from comlrl_trl.integrations.machine import cpu_model
    from comlrl_trl.models.demo import demo_model_path
    from comlrl_trl.precision import cpu_has_fast_bf16

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
