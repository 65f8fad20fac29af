"""Speed and memory of comlrl_trl MAGRPO, IAC and MAAC against the peer (CoMLRL 1.4.3), and MAGRPO against TRL GRPO.

    python benchmarks/bench.py                    # everything (about 30 minutes on 2 CPU cores)
    python benchmarks/bench.py --defaults         # only the rows at documented defaults (about 10 minutes)
    python benchmarks/bench.py --quick            # the tiny model only
    python benchmarks/bench.py --gpu              # on a GPU machine: a random-weight 0.5B-size model, bf16

Each measurement is a fresh process (`benchmarks/workers.py`) that trains for one epoch and reports its CPU time
and wall time (generation included, loading excluded) and its own peak RSS; the table shows medians over `--repeats`
runs. Rows at defaults (the code a user writes, first step included) are measured in joint samples per CPU second;
tuned rows (same forced lengths and items per step for every system, fp32, first step left out) in joint samples
per wall second. The peer runs in its own virtual environment (`benchmarks/.peer-venv`, created on first use with the same
torch build). Results go to `benchmarks/results/bench-<date>.json` and a chart `benchmarks/results/bench.png`.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_VENV = HERE / ".peer-venv"
PEER_PYTHON = PEER_VENV / "bin" / "python"
TORCH = "torch==2.13.0"


def ensure_peer_venv() -> None:
    """Create the peer's virtual environment once: the same CPU torch first, then comlrl==1.4.3."""
    if (
        PEER_PYTHON.exists()
        and subprocess.run([str(PEER_PYTHON), "-c", "import comlrl"], capture_output=True).returncode == 0
    ):
        return
    print("creating the peer's virtual environment (comlrl==1.4.3), about a minute ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    pip = [str(PEER_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [TORCH], check=True)
    subprocess.run(pip + [TORCH, "comlrl==1.4.3"], check=True)


def worker_env(system: str, threads: int = 1) -> dict:
    """The environment of a benchmark worker process: offline, `threads` torch threads, and this checkout's package on
    the path for ours and TRL (none for the peer, whose venv holds comlrl)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": "" if system == "peer" else str(ROOT),
    }


def measure(system: str, settings: dict, repeats: int) -> dict:
    """Median of `repeats` fresh-process runs of one system."""
    python = str(PEER_PYTHON) if system == "peer" else sys.executable
    env = worker_env(system, threads=settings["threads"])
    runs = []
    for _ in range(repeats):
        result = subprocess.run(
            [python, str(HERE / "workers.py"), system, json.dumps(settings)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        line = next((out for out in result.stdout.splitlines() if out.startswith("RESULT ")), None)
        if result.returncode != 0 or line is None:
            raise RuntimeError(f"{system} failed ({settings}):\n{result.stderr[-3000:]}")
        runs.append(json.loads(line[len("RESULT ") :]))
    keys = (
        "joint_samples_per_s",
        "seconds_per_step",
        "peak_rss_mb",
        "seconds",
        "joint_samples_per_cpu_s",
        "cpu_seconds",
    )
    return {key: statistics.median(run[key] for run in runs) for key in keys if key in runs[0]} | {"runs": runs}


def model_paths(include_demo: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    from comlrl_trl.testing import tiny_model_path

    paths = {"tiny": tiny_model_path("qwen2")}
    if include_demo:
        from comlrl_trl.models.demo import demo_model_path

        paths["smollm2"] = demo_model_path()
    return paths


def plan_defaults(paths: dict) -> list[tuple[str, str, dict]]:
    """The rows at documented defaults: N=2, K=4, 16 new tokens, one epoch, one thread, nothing else set."""
    base = dict(threads=1, lora=False, output_dir="/tmp/comlrl-trl-bench", defaults=True, tokens=16, k=4)
    rows = []
    for model, items in (("tiny", 8), ("smollm2", 4)):
        if model not in paths:
            continue
        settings = dict(base, model=paths[model], items=items)
        rows += [
            (f"{model} N=2 K=4 defaults", "ours", dict(settings, agents=2)),
            (f"{model} N=2 K=4 defaults", "peer", dict(settings, agents=2)),
            (f"{model} N=1 K=4 defaults", "ours", dict(settings, agents=1)),
            (f"{model} N=1 K=4 defaults", "trl", dict(settings, agents=1)),
        ]
        if model == "smollm2":
            rows.append((f"{model} N=2 K=4 defaults lora", "ours", dict(settings, agents=2, lora=True)))
            # An extra row, labelled: a longer run, where the one-time cost (the first touch of every agent's
            # gradients and AdamW state, most of the four-item row's system time) weighs less.
            for system in ("ours", "peer"):
                rows.append((f"{model} N=2 K=4 defaults 12 items", system, dict(settings, agents=2, items=12)))
    return rows


def marginal_cpu_s_per_item(short: dict, long: dict) -> float:
    """CPU seconds per task item between two runs of the same system that differ only in their item count: the cost
    of one more update once the one-time costs are paid."""
    return (long["cpu_seconds"] - short["cpu_seconds"]) / (long["settings"]["items"] - short["settings"]["items"])


def one_time_cpu_s(short: dict, long: dict) -> float:
    """The CPU seconds of a run that do not grow with its items (the first touch of gradients and AdamW state, ...):
    the short run less its items at the marginal rate between the two runs."""
    return short["cpu_seconds"] - short["settings"]["items"] * marginal_cpu_s_per_item(short, long)


def plan(paths: dict, quick: bool) -> list[tuple[str, str, dict]]:
    """(label, system, settings) of every tuned measurement (labels end in "tuned")."""
    base = dict(threads=1, lora=False, output_dir="/tmp/comlrl-trl-bench", items_per_step=2)
    rows = []
    tiny = dict(base, model=paths["tiny"], tokens=16, items=16)
    for system in ("ours", "peer"):  # the headline comparison, then the scaling sweep
        for agents in (1, 2, 4):
            for k in (2, 4, 8):
                rows.append((f"tiny N={agents} K={k}", system, dict(tiny, agents=agents, k=k)))
    rows.append(("tiny N=1 K=4", "trl", dict(tiny, agents=1, k=4)))
    actor_critic = dict(tiny, agents=2, k=1, items=32, items_per_step=8)  # a step: 8 items, one response each
    for algorithm in ("iac", "maac"):
        for system in ("ours", "peer"):
            rows.append((f"tiny {algorithm.upper()} N=2", system, dict(actor_critic, algorithm=algorithm)))
    if not quick and "smollm2" in paths:
        smol = dict(base, model=paths["smollm2"], tokens=16, items=6)
        rows += [
            ("smollm2 N=2 K=4 full", "ours", dict(smol, agents=2, k=4)),
            ("smollm2 N=2 K=4 full", "peer", dict(smol, agents=2, k=4)),
            ("smollm2 N=2 K=4 lora", "ours", dict(smol, agents=2, k=4, lora=True)),
            ("smollm2 N=1 K=4 full", "ours", dict(smol, agents=1, k=4)),
            ("smollm2 N=1 K=4 full", "trl", dict(smol, agents=1, k=4)),
            ("smollm2 IAC N=2", "ours", dict(smol, agents=2, k=1, items=16, items_per_step=4, algorithm="iac")),
            ("smollm2 IAC N=2", "peer", dict(smol, agents=2, k=1, items=16, items_per_step=4, algorithm="iac")),
        ]
    return rows


def summarize_defaults(by: dict) -> dict:
    """Ratios for the targets at defaults: joint samples per CPU second vs the peer and TRL, memory vs the peer; with
    the 12-item SmolLM2 rows also each system's one-time CPU seconds and the four-item ratio they allow at most."""
    out = {}
    for model, target in (("smollm2", 3), ("tiny", 2)):
        ours, peer = by.get((f"{model} N=2 K=4 defaults", "ours")), by.get((f"{model} N=2 K=4 defaults", "peer"))
        if ours and peer:
            out[f"{model} defaults: samples per CPU-s ours/peer (N=2, K=4; target >= {target})"] = (
                ours["joint_samples_per_cpu_s"] / peer["joint_samples_per_cpu_s"]
            )
        one, trl = by.get((f"{model} N=1 K=4 defaults", "ours")), by.get((f"{model} N=1 K=4 defaults", "trl"))
        if one and trl:
            out[f"{model} defaults: samples per CPU-s ours/TRL (N=1; target >= 1)"] = (
                one["joint_samples_per_cpu_s"] / trl["joint_samples_per_cpu_s"]
            )
    lora, peer = by.get(("smollm2 N=2 K=4 defaults lora", "ours")), by.get(("smollm2 N=2 K=4 defaults", "peer"))
    if lora and peer:
        out["smollm2 defaults: peak RSS ours LoRA / peer (N=2; target <= 0.5)"] = (
            lora["peak_rss_mb"] / peer["peak_rss_mb"]
        )
    runs = {
        (items, system): by.get((f"smollm2 N=2 K=4 defaults{suffix}", system))
        for items, suffix in ((4, ""), (12, " 12 items"))
        for system in ("ours", "peer")
    }
    if all(runs.values()):
        out["smollm2 defaults, 12 items (extra row): samples per CPU-s ours/peer"] = (
            runs[12, "ours"]["joint_samples_per_cpu_s"] / runs[12, "peer"]["joint_samples_per_cpu_s"]
        )
        out["smollm2 defaults, items 5-12 (extra row): CPU-s per item peer/ours"] = marginal_cpu_s_per_item(
            runs[4, "peer"], runs[12, "peer"]
        ) / marginal_cpu_s_per_item(runs[4, "ours"], runs[12, "ours"])
        fixed = {system: one_time_cpu_s(runs[4, system], runs[12, system]) for system in ("ours", "peer")}
        out["smollm2 defaults (extra row): one-time CPU-s, ours"] = fixed["ours"]
        out["smollm2 defaults (extra row): one-time CPU-s, peer"] = fixed["peer"]
        out["smollm2 defaults (extra row): four-item ratio if our items cost nothing"] = (
            runs[4, "peer"]["cpu_seconds"] / fixed["ours"]
        )
    return out


def summarize(results: list[dict]) -> dict:
    """Ratios for the targets: throughput vs the peer, memory vs the peer, overhead vs TRL, scaling in N."""
    by = {(r["label"].removesuffix(" tuned"), r["system"]): r for r in results}
    out = summarize_defaults(by)
    for model in ("tiny", "smollm2"):
        ours, peer = (
            by.get((f"{model} N=2 K=4 full", "ours")) or by.get((f"{model} N=2 K=4", "ours")),
            by.get((f"{model} N=2 K=4 full", "peer")) or by.get((f"{model} N=2 K=4", "peer")),
        )
        if ours and peer:
            out[f"{model}: throughput ours/peer (N=2, K=4; target >= 3)"] = (
                ours["joint_samples_per_s"] / peer["joint_samples_per_s"]
            )
        one, trl = (
            by.get((f"{model} N=1 K=4 full", "ours")) or by.get((f"{model} N=1 K=4", "ours")),
            by.get((f"{model} N=1 K=4 full", "trl")) or by.get((f"{model} N=1 K=4", "trl")),
        )
        if one and trl:
            out[f"{model}: time per step ours/TRL (N=1; target <= 1.15)"] = (
                one["seconds_per_step"] / trl["seconds_per_step"]
            )
    lora, peer = by.get(("smollm2 N=2 K=4 lora", "ours")), by.get(("smollm2 N=2 K=4 full", "peer"))
    if lora and peer:
        out["smollm2: peak RSS ours LoRA / peer (N=2; target <= 0.5)"] = lora["peak_rss_mb"] / peer["peak_rss_mb"]
    for label in ("tiny IAC N=2", "tiny MAAC N=2", "smollm2 IAC N=2"):
        ours, peer = by.get((label, "ours")), by.get((label, "peer"))
        if ours and peer:
            out[f"{label.replace(' N=2', '')}: throughput ours/peer (N=2, G=1)"] = (
                ours["joint_samples_per_s"] / peer["joint_samples_per_s"]
            )
    for system in ("ours", "peer"):
        steps = [by.get((f"tiny N={n} K=4", system)) for n in (1, 2, 4)]
        if all(steps):
            out[f"tiny: time per step N=4 / N=1, {system} (linear would be 4)"] = (
                steps[2]["seconds_per_step"] / steps[0]["seconds_per_step"]
            )
    return out


def print_table(results: list[dict], ratios: dict) -> None:
    header = f"{'setting':<30} {'system':<6} {'samples/CPU-s':>14} {'samples/s':>10} {'s/step':>8} {'peak RSS MB':>12}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        per_cpu = f"{r['joint_samples_per_cpu_s']:>14.3f}" if "joint_samples_per_cpu_s" in r else f"{'-':>14}"
        print(
            f"{r['label']:<30} {r['system']:<6} {per_cpu} {r['joint_samples_per_s']:>10.2f} "
            f"{r['seconds_per_step']:>8.3f} {r['peak_rss_mb']:>12.0f}"
        )
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")


def chart(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for system, marker in (("ours", "o"), ("peer", "s")):
        for n, style in ((1, ":"), (2, "-"), (4, "--")):
            points = [
                (r["settings"]["k"], r["seconds_per_step"])
                for r in results
                if r["system"] == system and r["label"].startswith(f"tiny N={n} ") and r["label"].endswith(" tuned")
            ]
            if points:
                ks, seconds = zip(*sorted(points))
                left.plot(ks, seconds, marker=marker, linestyle=style, label=f"{system} N={n}")
    left.set(
        xlabel="K generations per agent",
        ylabel="seconds per optimiser step",
        title="tiny model: cost vs N, K",
        xscale="log",
        yscale="log",
    )
    left.set_xticks([2, 4, 8], labels=["2", "4", "8"])
    left.legend(fontsize=7)
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    by = {
        (r["label"].removesuffix(" tuned"), r["system"]): r["joint_samples_per_s"]
        for r in results
        if r["label"].endswith(" tuned")
    }
    bars = [
        (f"tiny N={n} K=4", by.get((f"tiny N={n} K=4", "ours")), by.get((f"tiny N={n} K=4", "peer")))
        for n in (1, 2, 4)
    ]
    bars += [
        ("smollm2 N=2 K=4 full", by.get(("smollm2 N=2 K=4 full", "ours")), by.get(("smollm2 N=2 K=4 full", "peer"))),
        (
            "smollm2 N=2 K=4 LoRA\n(peer: full)",
            by.get(("smollm2 N=2 K=4 lora", "ours")),
            by.get(("smollm2 N=2 K=4 full", "peer")),
        ),
    ]
    bars += [
        (label, by.get((label, "ours")), by.get((label, "peer")))
        for label in ("tiny IAC N=2", "tiny MAAC N=2", "smollm2 IAC N=2")
    ]
    bars = [(label, ours / peer) for label, ours, peer in bars if ours and peer]
    right.barh([label for label, _ in bars], [ratio for _, ratio in bars], color="tab:blue")
    right.axvline(1.0, color="gray", linewidth=1)
    right.axvline(3.0, color="tab:red", linestyle="--", linewidth=1, label="target 3x")
    right.set(xlabel="throughput ours / peer (joint samples per second)", title="speed-up over CoMLRL 1.4.3")
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    parser.add_argument("--defaults", action="store_true", help="only the rows at documented defaults")
    parser.add_argument("--repeats", type=int, default=5, help="runs per tiny-model measurement (median)")
    parser.add_argument("--demo-repeats", type=int, default=1, help="runs per SmolLM2 measurement (long, stable)")
    parser.add_argument("--gpu", action="store_true", help="run the GPU variant (benchmarks/gpu.py)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    parser.add_argument("--replot", type=Path, default=None, help="redraw the chart and table of a results JSON")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        print_table(saved["results"], saved["ratios"])
        chart(saved["results"], args.replot.parent / "bench.png")
        return
    if args.gpu:
        os.execv(sys.executable, [sys.executable, str(HERE / "gpu.py")])

    ensure_peer_venv()
    paths = model_paths(include_demo=not args.quick)
    rows = plan_defaults(paths)
    if not args.defaults:
        rows += [(f"{label} tuned", system, settings) for label, system, settings in plan(paths, args.quick)]
    results = []
    for label, system, settings in rows:
        repeats = args.repeats if label.startswith("tiny") else args.demo_repeats
        print(f"measuring {label:<30} {system:<5} ...", end=" ", flush=True)
        result = measure(system, settings, repeats)
        speed = (
            f"{result['joint_samples_per_cpu_s']:.3f} joint samples/CPU-s"
            if settings.get("defaults")
            else f"{result['joint_samples_per_s']:.2f} joint samples/s"
        )
        print(f"{speed}, {result['peak_rss_mb']:.0f} MB", flush=True)
        results.append({"label": label, "system": system, "settings": settings, **result})
    ratios = summarize(results)
    print_table(results, ratios)
    from comlrl_trl.integrations.machine import cpu_model
    from comlrl_trl.precision import cpu_has_fast_bf16

    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat()
    json_path = args.json or out_dir / f"bench-{'defaults-' if args.defaults else ''}{stamp}.json"
    json_path.write_text(
        json.dumps(
            {
                "date": stamp,
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "cpu": cpu_model(),
                "bf16_units": cpu_has_fast_bf16(),  # whether ours trains SmolLM2 in bf16 at defaults here
                "ratios": ratios,
                "results": results,
            },
            indent=2,
        )
    )
    if args.defaults:
        print(f"\nresults: {json_path}")
        return
    chart(results, out_dir / "bench.png")
    print(f"\nresults: {json_path}\nchart: {out_dir / 'bench.png'}")


if __name__ == "__main__":
    main()
