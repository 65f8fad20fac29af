"""Where the time of a MAGRPO run goes, per phase, in process CPU seconds.

    python benchmarks/profile_step.py --model tiny              # N=2, K=4, 16 new tokens, defaults, 8 items
    python benchmarks/profile_step.py --model smollm2 --items 4
    python benchmarks/profile_step.py --model tiny --set bf16=false --set per_device_train_batch_size=4
    python benchmarks/profile_step.py --model smollm2 --items 4 --tokens 64 --preamble 12   # prompts of ~160 tokens

Trains one epoch with the documented defaults (plus any `--set field=value`) on one thread and prints the CPU time
of every phase: generation (the agents' `generate` calls, tokenisation and decoding included), scoring (joint
reward, TRL's scoring and the advantages), forward/backward (every agent's loss and gradients), optimiser (clipping
and AdamW steps of every agent) and the rest (the Trainer loop, data loading, callbacks, logging). `--cprofile`
also prints the top functions by cumulative time.
"""

import argparse
import ast
import cProfile
import json
import os
import pstats
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = ("generation", "scoring", "forward/backward", "optimiser")


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (nanosecond clock for the process itself)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class PhaseClock:
    """Exclusive CPU time per phase: a phase entered inside another one is charged only to the inner phase."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.stack = []

    @contextmanager
    def phase(self, name):
        now = cpu_seconds()
        if self.stack:
            outer, since = self.stack[-1]
            self.seconds[outer] += now - since
        self.stack.append((name, now))
        try:
            yield
        finally:
            done = cpu_seconds()
            inner, since = self.stack.pop()
            self.seconds[inner] += done - since
            if self.stack:
                self.stack[-1] = (self.stack[-1][0], done)

    def wrap(self, owner, attribute, name):
        original = getattr(owner, attribute)
        clock = self

        def timed(*args, **kwargs):
            with clock.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


def instrument(clock: PhaseClock) -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import Trainer

    from comlrl_trl.adapters.grpo import AgentGRPOTrainer
    from comlrl_trl.generation.cpu import LeanCpuGeneration
    from comlrl_trl.orchestrator import JointRolloutOrchestrator

    clock.wrap(JointRolloutOrchestrator, "_score_agents", "scoring")
    clock.wrap(JointRolloutOrchestrator, "_score_and_expand", "scoring")
    clock.wrap(LeanCpuGeneration, "__call__", "generation")  # the team's joint loop, or each agent's call
    clock.wrap(AgentGRPOTrainer, "generate", "generation")
    clock.wrap(AgentGRPOTrainer, "forward_backward", "forward/backward")
    clock.wrap(AcceleratedOptimizer, "step", "optimiser")
    clock.wrap(Trainer, "_clip_grad_norm", "optimiser")


def reward(*agent_completions, **kwargs):
    """The benchmark's cheap joint reward: total characters modulo 7."""
    return [float(sum(len(text) for text in joint) % 7) for joint in zip(*agent_completions)]


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def profiler_steps(profiler):
    """A callback that steps the op profiler at the end of every update (its schedule counts updates)."""
    from transformers import TrainerCallback

    class ProfilerSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            profiler.step()

    return ProfilerSteps()


def usage_per_update():
    """A callback that prints each update's CPU seconds, system seconds and minor page faults."""
    from transformers import TrainerCallback

    class UsagePerUpdate(TrainerCallback):
        def __init__(self):
            self.last = self.usage()

        @staticmethod
        def usage():
            own = resource.getrusage(resource.RUSAGE_SELF)
            return time.process_time(), own.ru_stime, own.ru_minflt

        def on_step_end(self, args, state, control, **kwargs):
            now = self.usage()
            cpu, system, faults = (a - b for a, b in zip(now, self.last))
            self.last = now
            print(
                f"update {state.global_step}: {cpu:.2f} CPU-s, {system:.2f} system, {faults} page faults", flush=True
            )

    return UsagePerUpdate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16, help="max_new_tokens")
    parser.add_argument(
        "--preamble", type=int, default=0, metavar="N", help="start every prompt with the same N-sentence preamble"
    )
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a MAGRPOConfig field")
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="print the top N functions (by cumulative time; PROFILE_SORT=tottime: own time; PROFILE_CALLERS=REGEX: "
        "also who calls the functions matching REGEX)",
    )
    parser.add_argument("--ops", type=int, default=0, metavar="N", help="print the top N torch ops by self CPU time")
    parser.add_argument(
        "--ops-skip", type=int, default=0, metavar="K", help="leave the first K updates out of the op profile"
    )
    parser.add_argument("--per-update", action="store_true", help="print every update's CPU, system time and faults")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    torch.set_num_threads(1)
    if args.model == "tiny":
        from comlrl_trl.testing import tiny_model_path

        model = tiny_model_path("qwen2")
    else:
        from comlrl_trl.models.demo import demo_model_path

        model = demo_model_path()
    overrides = dict(item.split("=", 1) for item in args.set)
    config = MAGRPOConfig(
        output_dir="/tmp/comlrl-trl-profile",
        num_agents=args.agents,
        num_generations=4,
        max_new_tokens=args.tokens,
        num_train_epochs=1,
        report_to="none",
        disable_tqdm=True,
        **{key: parse_value(value) for key, value in overrides.items()},
    )
    preamble = "".join(f"Rule {j}: keep the note about topic {j} friendly. " for j in range(args.preamble))
    prompts = [f"{preamble}Task {i}: write a short note about topic number {i}." for i in range(args.items)]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(
        agent_model=model,
        num_agents=args.agents,
        reward_func=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=lora if args.lora else None,
    )
    clock = PhaseClock()
    instrument(clock)
    profiler = cProfile.Profile() if args.cprofile else None
    ops = (
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            record_shapes=bool(os.environ.get("PROFILE_SHAPES")),
            # updates after the first K (`--ops-skip`): the profiler steps at the end of every update
            schedule=torch.profiler.schedule(skip_first=args.ops_skip, wait=0, warmup=0, active=args.items + 1),
        )
        if args.ops
        else nullcontext()
    )
    if args.ops:
        trainer.add_callback(profiler_steps(ops))
    if args.per_update:
        trainer.add_callback(usage_per_update())
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    start, wall = cpu_seconds(), time.perf_counter()
    if profiler:
        profiler.enable()
    with ops:
        trainer.train()
    if profiler:
        profiler.disable()
    total, wall = cpu_seconds() - start, time.perf_counter() - wall
    usage = resource.getrusage(resource.RUSAGE_SELF)
    phases = {name: clock.seconds[name] for name in PHASES}
    phases["other"] = total - sum(phases.values())
    samples = args.items * 4
    print(
        json.dumps(
            {
                "model": args.model,
                "items": args.items,
                "bf16": config.bf16,
                "per_device_train_batch_size": config.per_device_train_batch_size,
                "gradient_checkpointing": config.gradient_checkpointing,
                "steps": trainer.state.global_step,
                "cpu_seconds": round(total, 3),
                "wall_seconds": round(wall, 3),
                "system_seconds": round(usage.ru_stime - usage_before.ru_stime, 3),
                "minor_page_faults": usage.ru_minflt - usage_before.ru_minflt,
                "joint_samples_per_cpu_s": round(samples / total, 3),
                "phases": {name: round(value, 3) for name, value in phases.items()},
            }
        )
    )
    if profiler:
        stats = pstats.Stats(profiler).sort_stats(os.environ.get("PROFILE_SORT", "cumulative"))
        stats.print_stats(args.cprofile)
        if os.environ.get("PROFILE_CALLERS"):
            stats.print_callers(os.environ["PROFILE_CALLERS"])
    if args.ops:
        shapes = bool(os.environ.get("PROFILE_SHAPES"))
        print(ops.key_averages(group_by_input_shape=shapes).table(sort_by="self_cpu_time_total", row_limit=args.ops))
        if os.environ.get("PROFILE_TRACE"):
            ops.export_chrome_trace(os.environ["PROFILE_TRACE"])


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main()
