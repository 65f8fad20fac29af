"""How far each phase of a training update is from the machine's limit, for comlrl_trl, the peer and TRL.

    python benchmarks/roofline.py                          # ours (bf16 where the CPU has the units), the peer, TRL
    python benchmarks/roofline.py --fp32                   # also ours and TRL in fp32
    python benchmarks/roofline.py --systems ours --items 4 --json /tmp/roofline.json
    python benchmarks/roofline.py --model tiny --items 4   # a smoke test (the tiny test model, seconds)

First the machine, on one thread: the matmul peak in fp32 and in bf16 (the best GFLOP/s of large square
`torch.matmul`s) and the memory bandwidth (GB/s of `sum` over a 512 MiB tensor, which reads it once; a copy's
read-plus-write rate beside it). Then each system trains the seed tutorial's update (`learning_worker.py`: two agents
of SmolLM2-135M-Instruct, K=4, 48 new tokens, the ten tutorial prompts, learning rate 5e-5, each package's defaults
otherwise; TRL one agent with the settings ours resolve to, as in `workers.py`) for one epoch over `--items` prompts
in a fresh process, twice:

- timed: the process CPU seconds of each phase, after the first team update (AdamW's state allocation and oneDNN's
  first calls left out): generation (`generate`, and ours' team decoding loop), log-prob forward (every forward of
  the model outside generation: the loss forward and any scoring forward without gradients), backward
  (`torch.autograd.backward`), optimiser (gradient clipping, AdamW, zeroing) and the rest;
- counted: the same run again (same seed, so the same tokens) under a `TorchDispatchMode` that adds up, per phase,
  the FLOPs of every matrix product that reaches the dispatcher (torch's `flop_counter` formulas; oneDNN's packed
  linear and fbgemm's fp16 linear as 2 x rows x in x out), split by the products' precision, and the bytes of their
  operands (in generation: each decoding step reads every weight once).

A phase's achieved FLOP/s is its FLOPs over its CPU seconds; its compute fraction is the time its products would take
at the peak of their precision over the time it took. Generation's bandwidth fraction is the bytes of its products'
operands (each decoding step reads every weight) per second over the bandwidth; the optimiser's, the bytes of every
op's operands (AdamW reads parameters, gradients and two moments, with no matrix products). A phase's limit is the
nearer of the two (the roofline); the table names the phase furthest from it, and the phase that leaves the most
CPU seconds above it (its time times one minus its fraction). FLOPs are counted where the work runs (hardware FLOPs:
padding included), bytes as operands read (writes and cache reuse not modelled). One thread throughout. The
precision of a row is that of its products (ours and TRL: bf16 where the CPU has bf16 units, as their defaults
resolve; the peer fp32). `--json PATH` writes everything.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PHASES = ("generation", "log-prob forward", "backward", "optimiser", "other")


# ----- the machine -----


def matmul_peak(dtype_name: str, seconds: float) -> dict:
    """The best GFLOP/s of square matmuls of a few sizes in `dtype_name`, one thread."""
    import torch

    dtype = getattr(torch, dtype_name)
    best = {"gflop_s": 0.0, "n": None}
    for n in (1024, 2048, 4096):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.matmul(a, b)  # warm-up: oneDNN's kernel for this shape
        spent, rates = 0.0, []
        while spent < seconds / 3 or len(rates) < 2:
            start = time.perf_counter()
            torch.matmul(a, b)
            took = time.perf_counter() - start
            spent += took
            rates.append(2 * n**3 / took / 1e9)
        if max(rates) > best["gflop_s"]:
            best = {"gflop_s": max(rates), "n": n}
    return best


def memory_bandwidth(seconds: float) -> dict:
    """GB/s of reading a 512 MiB fp32 tensor once (`sum`) and of copying it (read and write), best of repeats."""
    import torch

    x = torch.rand(128 * 2**20)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    rates = {"read_gb_s": [], "copy_gb_s": []}
    spent = 0.0
    while spent < seconds or len(rates["copy_gb_s"]) < 3:
        start = time.perf_counter()
        x.sum()
        middle = time.perf_counter()
        y.copy_(x)
        end = time.perf_counter()
        spent += end - start
        rates["read_gb_s"].append(nbytes / (middle - start) / 1e9)
        rates["copy_gb_s"].append(2 * nbytes / (end - middle) / 1e9)
    return {key: max(values) for key, values in rates.items()}


def machine(seconds: float) -> dict:
    import torch

    torch.set_num_threads(1)
    return {
        "matmul_fp32": matmul_peak("float32", seconds),
        "matmul_bf16": matmul_peak("bfloat16", seconds),
        "bandwidth": memory_bandwidth(seconds),
    }


# ----- phases (in the worker) -----


class PhaseClock:
    """Exclusive CPU seconds per phase (a phase entered inside another is charged to the inner one), and a snapshot
    after the first team update, so that the window after it can be reported."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.stack = []
        self.snapshot = None

    def current(self) -> str:
        return self.stack[-1][0] if self.stack else "other"

    @contextmanager
    def phase(self, name):
        now = time.process_time()
        if self.stack:
            outer, since = self.stack[-1]
            self.seconds[outer] += now - since
        else:
            self.seconds["other"] += now - self.other_since
        self.stack.append((name, now))
        try:
            yield
        finally:
            done = time.process_time()
            inner, since = self.stack.pop()
            self.seconds[inner] += done - since
            if self.stack:
                self.stack[-1] = (self.stack[-1][0], done)
            else:
                self.other_since = done

    def start(self):
        self.other_since = time.process_time()

    def totals(self) -> dict:
        seconds = dict(self.seconds)
        if not self.stack:
            seconds["other"] = seconds.get("other", 0.0) + time.process_time() - self.other_since
            self.other_since = time.process_time()
        return seconds

    def take_snapshot(self):
        if self.snapshot is None:
            self.snapshot = self.totals()

    def wrap(self, owner, attribute, name, unless_in=()):
        original = getattr(owner, attribute)
        clock = self

        def timed(*args, **kwargs):
            if clock.current() in unless_in:
                return original(*args, **kwargs)
            with clock.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


def instrument(clock: PhaseClock, model_class, system: str) -> None:
    """The phases of every system alike: `generate`, the model's forward outside it, autograd's backward, the
    optimiser; ours' team decoding loop and TRL's log-probability forward by name."""
    import torch
    from transformers.generation.utils import GenerationMixin

    clock.wrap(GenerationMixin, "generate", "generation")
    clock.wrap(model_class, "forward", "log-prob forward", unless_in=("generation",))
    clock.wrap(torch.autograd, "backward", "backward")
    for optimizer in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        clock.wrap(optimizer, "step", "optimiser")
    clock.wrap(torch.optim.Optimizer, "zero_grad", "optimiser")
    clock.wrap(torch.nn.Module, "zero_grad", "optimiser")
    clock.wrap(torch.nn.utils, "clip_grad_norm_", "optimiser")
    if system != "peer":
        from transformers import Trainer
        from trl import GRPOTrainer

        clock.wrap(Trainer, "_clip_grad_norm", "optimiser")
        clock.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", "log-prob forward")
    if system == "ours":
        from comlrl_trl.adapters.grpo import AgentGRPOTrainer
        from comlrl_trl.generation.cpu import LeanCpuGeneration

        clock.wrap(LeanCpuGeneration, "__call__", "generation")
        clock.wrap(AgentGRPOTrainer, "generate", "generation")


def counting_mode(clock: PhaseClock):
    """A dispatch mode that adds up, per phase, the FLOPs of matrix products by precision and their operands' bytes
    (in the optimiser phase the operands of every op: AdamW has no matrix products and is bound by memory)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    linear_like = set()
    for namespace, name in (("mkldnn", "_linear_pointwise"), ("quantized", "linear_dynamic_fp16")):
        try:
            linear_like.add(getattr(getattr(torch.ops, namespace), name))
        except (AttributeError, RuntimeError):
            pass
    # Composite ops that reach the mode undecomposed under inference mode (the peer generates in it).
    composite_products = {torch.ops.aten.linear, torch.ops.aten.matmul}
    extra_attention = set()
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ):
        if hasattr(torch.ops.aten, name):
            extra_attention.add(getattr(torch.ops.aten, name))

    def nbytes(value) -> int:
        if isinstance(value, (list, tuple)):
            return sum(nbytes(v) for v in value)
        try:
            return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        except (RuntimeError, NotImplementedError):
            return 0

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.flops = defaultdict(lambda: defaultdict(int))  # phase -> precision -> FLOPs
            self.bytes = defaultdict(int)
            self.snapshot = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            flops, operands = 0, args
            if packet in flop_registry:
                flops = flop_registry[packet](*args, **kwargs, out_val=out)
            elif packet in composite_products:  # reached as a whole (e.g. under inference mode)
                x, w = args[0], args[1]
                inner = x.shape[-1]
                flops = 2 * out.numel() * inner
                if packet is torch.ops.aten.linear:
                    operands = (x, w)
            elif packet is torch.ops.aten.scaled_dot_product_attention:  # (batch, heads, rows, d): two products
                q, k = args[0], args[1]
                flops = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[-2] * q.shape[-1]
            elif packet in linear_like:
                x, first = args[0], out[0] if isinstance(out, (tuple, list)) else out
                flops = 2 * x.numel() * first.shape[-1]
                operands = (x,)
                self.bytes[clock.current()] += x.shape[-1] * first.shape[-1] * 2  # the bf16 or fp16 weight
            elif packet in extra_attention:  # (batch, heads, rows, d): two products forward, four backward
                backward = "backward" in str(packet)
                q, k = (args[1], args[2]) if backward else (args[0], args[1])
                flops = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] * (2 if backward else 1)
            phase = clock.current()
            if flops:
                tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
                precision = "bf16" if any(t.dtype == torch.bfloat16 for t in tensors) else "fp32"
                if "fp16" in str(packet):
                    precision = "fp32"  # fbgemm's fp16 weights multiply in fp32
                self.flops[phase][precision] += int(flops)
                if phase != "optimiser":
                    self.bytes[phase] += sum(nbytes(a) for a in operands)
            if phase == "optimiser":
                self.bytes[phase] += nbytes(args) + nbytes(list(kwargs.values()))
            return out

        def take_snapshot(self):
            if self.snapshot is None:
                self.snapshot = (
                    {phase: dict(by) for phase, by in self.flops.items()},
                    dict(self.bytes),
                )

    return Counter()


# ----- the workers: one system, timed or counted -----


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dataset(items: int):
    from datasets import Dataset
    from learning_task import TRAIN_PROMPTS

    return Dataset.from_dict({"prompt": [TRAIN_PROMPTS[i % len(TRAIN_PROMPTS)] for i in range(items)]})


def snapshot_callback(take):
    from transformers import TrainerCallback

    class FirstUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                take()

    return FirstUpdate()


def build_ours(s, take):
    from learning_task import length_ratio_reward

    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl_trl.utils.reward_processor import RewardProcessors

    config = MAGRPOConfig(
        output_dir="/tmp/roofline-ours",
        num_train_epochs=1,
        agent_learning_rate=5e-5,
        num_generations=s["k"],
        num_turns=1,
        max_new_tokens=s["tokens"],
        seed=0,
        report_to="none",
        disable_tqdm=True,
        logging_steps=10**6,
        **s["overrides"],
    )
    trainer = MAGRPOTrainer(
        agent_model=s["model"],
        num_agents=2,
        reward_func=partial(length_ratio_reward, target_min=2, target_max=3),
        reward_processor=RewardProcessors.scale(factor=100.0),
        args=config,
        train_dataset=dataset(s["items"]),
        callbacks=[snapshot_callback(take)],
    )
    return trainer.train, {"bf16": trainer.args.bf16}


def build_trl(s, take):
    from trl import GRPOConfig, GRPOTrainer

    from comlrl_trl.precision import cpu_bf16_pays_off
    from comlrl_trl.trainers.reinforce import MAGRPOConfig

    ours = MAGRPOConfig(
        output_dir="/tmp/roofline-trl",
        num_agents=1,
        num_turns=1,
        num_train_epochs=1,
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
        **s["overrides"],
    )
    same = (
        "per_device_train_batch_size",
        "num_generations",
        "max_completion_length",
        "bf16",
        "gradient_checkpointing",
        "use_cpu",
        "shuffle_dataset",
        "save_strategy",
        "top_k",
        "temperature",
        "top_p",
        "steps_per_generation",
    )
    settings = {key: getattr(ours, key) for key in same}
    if ours.bf16 is None:
        settings["bf16"] = not ours.use_cpu or cpu_bf16_pays_off([s["model"]])
    config = GRPOConfig(
        output_dir="/tmp/roofline-trl",
        num_train_epochs=1,
        learning_rate=5e-5,
        logging_steps=10**6,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **settings,
    )

    def reward(completions, **kwargs):
        return [float(len(text) % 7) for text in completions]

    trainer = GRPOTrainer(
        model=s["model"],
        reward_funcs=reward,
        train_dataset=dataset(s["items"]),
        args=config,
        callbacks=[snapshot_callback(take)],
    )
    return trainer.train, {"bf16": bool(config.bf16)}


def build_peer(s, take):
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl.utils.reward_processor import RewardProcessors
    from learning_task import length_ratio_reward

    seed_everything(0)
    config = MAGRPOConfig(
        num_agents=2,
        num_turns=1,
        num_train_epochs=1,
        agent_learning_rate=5e-5,
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
        logging_steps=10**6,
    )
    trainer = MAGRPOTrainer(
        agent_model=s["model"],
        num_agents=2,
        reward_func=partial(length_ratio_reward, target_min=2, target_max=3),
        reward_processor=RewardProcessors.scale(factor=100.0),
        args=config,
        train_dataset=dataset(s["items"]),
    )
    optimizer = trainer.optimizers[-1]  # agents update in turn: a team update ends with the last one's
    original_step = optimizer.step

    def step_then_snapshot(*args, **kwargs):
        result = original_step(*args, **kwargs)
        take()
        return result

    optimizer.step = step_then_snapshot
    return trainer.train, {"bf16": False}


def worker(system: str, s: dict) -> dict:
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "disabled")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(s["model"]))]
    clock = PhaseClock()
    instrument(clock, model_class, system)
    counter = counting_mode(clock) if s["count"] else None

    def take():
        clock.take_snapshot()
        if counter is not None:
            counter.take_snapshot()

    train, info = {"ours": build_ours, "trl": build_trl, "peer": build_peer}[system](s, take)
    clock.start()
    if counter is not None:
        with counter:
            train()
    else:
        train()
    end = clock.totals()
    if clock.snapshot is None:
        raise RuntimeError("no team update finished: give more --items")
    result = dict(info, system=system)
    if counter is None:
        result["cpu_s"] = {p: end.get(p, 0.0) - clock.snapshot.get(p, 0.0) for p in PHASES}
        result["first_update_cpu_s"] = {p: clock.snapshot.get(p, 0.0) for p in PHASES}
    else:
        flops_before, bytes_before = counter.snapshot
        result["flops"] = {
            p: {
                precision: n - flops_before.get(p, {}).get(precision, 0)
                for precision, n in counter.flops.get(p, {}).items()
            }
            for p in PHASES
        }
        result["bytes"] = {p: counter.bytes.get(p, 0) - bytes_before.get(p, 0) for p in PHASES}
    return result


# ----- the report (main process) -----


def run_worker(system: str, settings: dict) -> dict:
    from bench import PEER_PYTHON, worker_env

    python = str(PEER_PYTHON) if system == "peer" else sys.executable
    env = worker_env(system)
    out = subprocess.run(
        [python, str(Path(__file__).resolve()), "--worker", system, json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
    )
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{system} failed ({settings}):\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def analyse(timed: dict, counted: dict, peaks: dict) -> dict:
    """Per phase: CPU-s, FLOPs, achieved GFLOP/s, compute and (generation) bandwidth fractions; the phase furthest from
    its limit and the phase with the most CPU-s above it."""
    peak = {"bf16": peaks["matmul_bf16"]["gflop_s"] * 1e9, "fp32": peaks["matmul_fp32"]["gflop_s"] * 1e9}
    bandwidth = peaks["bandwidth"]["read_gb_s"] * 1e9
    phases = {}
    for p in PHASES:
        seconds = timed["cpu_s"][p]
        flops = counted["flops"][p]
        total = sum(flops.values())
        at_peak = sum(n / peak.get(precision, peak["fp32"]) for precision, n in flops.items())
        row = {
            "cpu_s": seconds,
            "flops": total,
            "flops_by_precision": flops,
            "gflop_s": total / seconds / 1e9 if seconds else None,
            "compute_fraction": at_peak / seconds if seconds else None,
            "bytes": counted["bytes"][p],
        }
        if p in ("generation", "optimiser"):
            row["gb_s"] = counted["bytes"][p] / seconds / 1e9 if seconds else None
            row["bandwidth_fraction"] = counted["bytes"][p] / bandwidth / seconds if seconds else None
        fractions = [f for f in (row["compute_fraction"], row.get("bandwidth_fraction")) if f is not None]
        row["limit_fraction"] = max(fractions) if fractions else None
        row["cpu_s_above_limit"] = seconds * (1 - row["limit_fraction"]) if row["limit_fraction"] is not None else None
        phases[p] = row
    measured = {p: r for p, r in phases.items() if p != "other" and r["cpu_s"] > 0 and r["limit_fraction"]}
    whole_seconds = sum(r["cpu_s"] for r in phases.values())
    whole_at_limit = sum(r["cpu_s"] * r["limit_fraction"] for r in phases.values() if r["limit_fraction"])
    return {
        "bf16": timed["bf16"],
        "phases": phases,
        "whole": {"cpu_s": whole_seconds, "limit_fraction": whole_at_limit / whole_seconds if whole_seconds else None},
        "furthest_from_limit": min(measured, key=lambda p: measured[p]["limit_fraction"]) if measured else None,
        "most_cpu_s_above_limit": max(measured, key=lambda p: measured[p]["cpu_s_above_limit"]) if measured else None,
    }


def print_report(peaks: dict, systems: dict) -> None:
    bw = peaks["bandwidth"]
    print(
        f"machine, one thread: matmul fp32 {peaks['matmul_fp32']['gflop_s']:.0f} GFLOP/s (n={peaks['matmul_fp32']['n']}), "
        f"bf16 {peaks['matmul_bf16']['gflop_s']:.0f} GFLOP/s (n={peaks['matmul_bf16']['n']}); "
        f"memory read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s"
    )
    header = f"{'system [precision]':<24} {'phase':<17} {'CPU-s':>7} {'GFLOP':>8} {'GFLOP/s':>8} {'of peak':>8} {'GB/s':>6} {'of BW':>6}"
    print("\n" + header + "\n" + "-" * len(header))
    for label, a in systems.items():
        for p, r in a["phases"].items():
            gflop_s = "-" if r["gflop_s"] is None else f"{r['gflop_s']:.1f}"
            frac = "-" if r["compute_fraction"] is None else f"{r['compute_fraction']:.1%}"
            gb_s = f"{r['gb_s']:.1f}" if r.get("gb_s") is not None else "-"
            bw_frac = f"{r['bandwidth_fraction']:.1%}" if r.get("bandwidth_fraction") is not None else "-"
            print(
                f"{label:<24} {p:<17} {r['cpu_s']:>7.2f} {r['flops'] / 1e9:>8.1f} {gflop_s:>8} {frac:>8} "
                f"{gb_s:>6} {bw_frac:>6}"
            )
        whole = a["whole"]
        print(
            f"{label:<24} {'whole update':<17} {whole['cpu_s']:>7.2f} "
            f"{'':>8} {'':>8} {'' if whole['limit_fraction'] is None else format(whole['limit_fraction'], '.1%'):>8}"
        )
        print(
            f"{'':<24} furthest from its limit: {a['furthest_from_limit']}; most CPU-s above its limit: "
            f"{a['most_cpu_s_above_limit']}\n"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=["ours", "peer", "trl"], choices=["ours", "peer", "trl"])
    parser.add_argument("--fp32", action="store_true", help="also ours and TRL with bf16=False")
    parser.add_argument("--items", type=int, default=6, help="prompts of the one epoch (the first update is left out)")
    parser.add_argument("--model", choices=["demo", "tiny"], default="demo")
    parser.add_argument("--peak-seconds", type=float, default=3.0, help="time for each machine measurement")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("SYSTEM", "SETTINGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(HERE))
        print("RESULT " + json.dumps(worker(args.worker[0], json.loads(args.worker[1]))), flush=True)
        return

    sys.path.insert(0, str(ROOT))
    from bench import ensure_peer_venv

    from comlrl_trl.integrations.machine import cpu_model
    from comlrl_trl.precision import cpu_has_fast_bf16

    if args.model == "tiny":
        from comlrl_trl.testing import tiny_model_path

        model = tiny_model_path("qwen2")
    else:
        from comlrl_trl.models.demo import demo_model_path

        model = demo_model_path()
    if "peer" in args.systems:
        ensure_peer_venv()
    print("measuring the machine (one thread) ...", flush=True)
    peaks = machine(args.peak_seconds)
    base = {"model": model, "k": 4, "tokens": 48, "items": args.items, "overrides": {}}
    plan = [(system, system, {}) for system in args.systems]
    if args.fp32:
        plan += [(f"{system}, bf16=False", system, {"bf16": False}) for system in args.systems if system != "peer"]
    systems, raw = {}, {}
    for label, system, overrides in plan:
        print(f"{label}: timed run, counted run ...", flush=True)
        settings = dict(base, overrides=overrides)
        timed = run_worker(system, dict(settings, count=False))
        counted = run_worker(system, dict(settings, count=True))
        forward = counted["flops"]["log-prob forward"]
        label = f"{label} [{'bf16' if forward.get('bf16', 0) > forward.get('fp32', 0) else 'fp32'}]"
        raw[label] = {"timed": timed, "counted": counted}
        systems[label] = analyse(timed, counted, peaks)
    print()
    print_report(peaks, systems)
    out = {
        "cpu": cpu_model(),
        "bf16_units": cpu_has_fast_bf16(),
        "settings": dict(base, model=args.model),
        "machine": peaks,
        "systems": systems,
        "raw": raw,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main()
