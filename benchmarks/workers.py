"""One benchmark measurement per process: `python workers.py {ours|peer|trl} JSON_SETTINGS` prints one JSON line.

Two kinds of runs:

- Defaults (`"defaults": true` in the settings): the code a user writes, each system's documented defaults with
  only N, K, the completion limit (`tokens`), one epoch and one turn set; nothing forced, the first step included.
  For `trl`, `GRPOTrainer` gets the settings comlrl_trl's defaults resolve to (batch size, precision, gradient
  checkpointing, learning rate), so that the N=1 comparison is like for like.
- Tuned: every system trains with the same completion length (forced to exactly `tokens` new tokens, so that no
  system wins by stopping early), task items per optimiser step (`items_per_step`) and fp32.

Every system trains the same model on the same prompts and reward with the same torch threads. Only `train()` is
measured; loading is not. The metric is joint samples per CPU second (process CPU time, children included), which a
shared machine disturbs far less than wall time; wall-time numbers are reported too.
The `peer` worker runs in the peer's own virtual environment (comlrl 1.4.3) and imports nothing from this repo.
"""

import json
import os
import resource
import sys
import time


def prompts(count):
    return [f"Task {i}: write a short note about topic number {i}." for i in range(count)]


def reward(*agent_completions, **kwargs):
    """A cheap joint reward with variance inside every group: total characters modulo 7."""
    return [float(sum(len(text) for text in joint) % 7) for joint in zip(*agent_completions)]


class StepClock:
    """Timestamps of the optimiser steps, so that the first step (optimizer state allocation, warm-up) can be
    left out of the steady-state numbers for every system alike."""

    def __init__(self):
        self.times = []

    def tick(self):
        self.times.append(time.perf_counter())

    def after_each_step(self, optimizer):
        """Tick after every `optimizer.step()` (the peer's loops have no callbacks)."""
        original_step = optimizer.step

        def timed_step(*args, **kwargs):
            result = original_step(*args, **kwargs)
            self.tick()
            return result

        optimizer.step = timed_step

    def steady(self, start, end, total_steps):
        """Seconds and steps after the first optimiser step (all of the run when it has a single step)."""
        if total_steps < 2 or not self.times:
            return end - start, total_steps
        return end - self.times[0], total_steps - 1


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_seconds():
    """CPU seconds of this process (all threads) and its finished children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def dataset(s):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompts(s["items"])})


def lora_config(s):
    from peft import LoraConfig

    return (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if s["lora"]
        else None
    )


def run_ours_defaults(s):
    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(
        output_dir=s["output_dir"],
        num_agents=s["agents"],
        num_turns=1,
        num_train_epochs=1,
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
    )
    trainer = MAGRPOTrainer(
        agent_model=s["model"],
        num_agents=s["agents"],
        reward_func=reward,
        train_dataset=dataset(s),
        args=config,
        peft_config=lora_config(s),
    )
    return trainer.train, lambda: trainer.state.global_step


def run_trl_defaults(s):
    """TRL's GRPOTrainer with the settings comlrl_trl's defaults resolve to for one agent."""
    from trl import GRPOConfig, GRPOTrainer

    from comlrl_trl.precision import cpu_bf16_pays_off
    from comlrl_trl.trainers.reinforce import MAGRPOConfig

    assert s["agents"] == 1, "plain TRL trains one policy"
    ours = MAGRPOConfig(
        output_dir=s["output_dir"],
        num_agents=1,
        num_turns=1,
        num_train_epochs=1,
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
    )
    same = (
        "per_device_train_batch_size",
        "num_generations",
        "max_completion_length",
        "learning_rate",
        "bf16",
        "gradient_checkpointing",
        "use_cpu",
        "shuffle_dataset",
        "save_strategy",
        "logging_steps",
        "top_k",
        "logging_nan_inf_filter",
    )
    settings = {key: getattr(ours, key) for key in same}
    if ours.use_cpu and not cpu_bf16_pays_off([s["model"]]):
        settings["bf16"] = False  # as MAGRPOTrainer resolves the default for a model this small
    config = GRPOConfig(output_dir=s["output_dir"], num_train_epochs=1, **settings)

    def trl_reward(completions, **kwargs):
        return reward(completions)

    trainer = GRPOTrainer(
        model=s["model"], reward_funcs=trl_reward, train_dataset=dataset(s), args=config, peft_config=lora_config(s)
    )
    return trainer.train, lambda: trainer.state.global_step


def run_peer_defaults(s):
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    assert not s["lora"], "the peer has no LoRA support"
    config = MAGRPOConfig(
        num_agents=s["agents"], num_turns=1, num_train_epochs=1, num_generations=s["k"], max_new_tokens=s["tokens"]
    )
    trainer = MAGRPOTrainer(
        agent_model=s["model"], num_agents=s["agents"], reward_func=reward, train_dataset=dataset(s), args=config
    )
    steps = []
    optimizer = trainer.optimizers[-1]  # agents update in turn: a team step ends with the last one's
    original_step = optimizer.step

    def counted_step(*args, **kwargs):
        steps.append(1)
        return original_step(*args, **kwargs)

    optimizer.step = counted_step
    return trainer.train, lambda: len(steps)


DEFAULT_RUNNERS = {"ours": run_ours_defaults, "peer": run_peer_defaults, "trl": run_trl_defaults}


def measure_defaults(system, s):
    """One epoch at defaults, the first step included: joint samples per CPU second of `train()`."""
    train, steps = DEFAULT_RUNNERS[system](s)
    cpu, wall = cpu_seconds(), time.perf_counter()
    train()
    cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    samples = s["items"] * s["k"]  # aligned joint actions scored in the epoch
    return {
        "cpu_seconds": cpu,
        "seconds": wall,
        "steps": steps(),
        "joint_samples_per_cpu_s": samples / cpu,
        "joint_samples_per_s": samples / wall,
        "seconds_per_step": wall / max(steps(), 1),
        "peak_rss_mb": peak_rss_mb(),
    }


def run_ours(s):
    from datasets import Dataset
    from peft import LoraConfig

    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(
        output_dir=s["output_dir"],
        num_agents=s["agents"],
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
        per_device_train_batch_size=s["k"] * s["items_per_step"],
        generation_kwargs={"min_new_tokens": s["tokens"]},
        learning_rate=1e-5,
        num_train_epochs=1,
        logging_steps=10**9,
        eval_interval=0,
        report_to="none",
        gradient_checkpointing=False,
        disable_tqdm=True,
        bf16=False,
        seed=0,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    clock = StepClock()
    trainer = MAGRPOTrainer(
        agent_model=s["model"],
        num_agents=s["agents"],
        reward_func=reward,
        train_dataset=Dataset.from_dict({"prompt": prompts(s["items"])}),
        args=config,
        peft_config=lora if s["lora"] else None,
        callbacks=[_ClockCallback(clock)],
    )
    start = time.perf_counter()
    trainer.train()
    return start, time.perf_counter(), trainer.state.global_step, clock


def run_trl(s):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    assert s["agents"] == 1, "plain TRL trains one policy"
    config = GRPOConfig(
        output_dir=s["output_dir"],
        num_generations=s["k"],
        per_device_train_batch_size=s["k"] * s["items_per_step"],
        max_completion_length=s["tokens"],
        generation_kwargs={"min_new_tokens": s["tokens"]},
        learning_rate=1e-5,
        num_train_epochs=1,
        logging_steps=10**9,
        report_to="none",
        gradient_checkpointing=False,
        disable_tqdm=True,
        shuffle_dataset=False,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def trl_reward(completions, **kwargs):
        return reward(completions)

    clock = StepClock()
    trainer = GRPOTrainer(
        model=s["model"],
        reward_funcs=trl_reward,
        train_dataset=Dataset.from_dict({"prompt": prompts(s["items"])}),
        args=config,
        peft_config=lora if s["lora"] else None,
        callbacks=[_ClockCallback(clock)],
    )
    start = time.perf_counter()
    trainer.train()
    return start, time.perf_counter(), trainer.state.global_step, clock


def run_peer(s):
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from datasets import Dataset

    assert not s["lora"], "the peer has no LoRA support"
    config = MAGRPOConfig(
        num_agents=s["agents"],
        num_turns=1,
        num_train_epochs=1,
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
        agent_learning_rate=1e-5,
        rollout_buffer_size=s["items_per_step"],
        train_batch_size=s["items_per_step"],
        eval_interval=0,
        logging_steps=10**9,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        agent_devices="cpu",
    )
    trainer = MAGRPOTrainer(
        agent_model=s["model"],
        num_agents=s["agents"],
        reward_func=reward,
        train_dataset=Dataset.from_dict({"prompt": prompts(s["items"])}),
        args=config,
    )
    clock = StepClock()
    clock.after_each_step(trainer.optimizers[-1])  # agents update in turn: a team step ends with the last one's
    start = time.perf_counter()
    trainer.train(min_new_tokens=s["tokens"])  # extra keywords go to generate()
    return start, time.perf_counter(), len(clock.times), clock


def run_ours_ac(s):
    from datasets import Dataset

    from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

    config_cls, trainer_cls = (IACConfig, IACTrainer) if s["algorithm"] == "iac" else (MAACConfig, MAACTrainer)
    config = config_cls(
        output_dir=s["output_dir"],
        num_agents=s["agents"],
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
        per_device_train_batch_size=s["k"] * s["items_per_step"],
        generation_kwargs={"min_new_tokens": s["tokens"]},
        learning_rate=1e-5,
        critic_learning_rate=1e-5,
        num_train_epochs=1,
        logging_steps=10**9,
        eval_interval=0,
        report_to="none",
        gradient_checkpointing=False,
        disable_tqdm=True,
        bf16=False,
        seed=0,
    )
    clock = StepClock()
    trainer = trainer_cls(
        agent_model=s["model"],
        critic_model=s["model"],
        reward_func=reward,
        train_dataset=Dataset.from_dict({"prompt": prompts(s["items"])}),
        args=config,
        callbacks=[_ClockCallback(clock)],
    )
    start = time.perf_counter()
    trainer.train()
    return start, time.perf_counter(), trainer.state.global_step, clock


def run_peer_ac(s):
    from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.generation.utils import GenerationMixin

    generate = GenerationMixin.generate

    def fixed_length_generate(self, *args, **kwargs):  # the peer's AC trainers take no generation keywords
        kwargs.setdefault("min_new_tokens", s["tokens"])
        return generate(self, *args, **kwargs)

    GenerationMixin.generate = fixed_length_generate
    config_cls, trainer_cls = (IACConfig, IACTrainer) if s["algorithm"] == "iac" else (MAACConfig, MAACTrainer)
    config = config_cls(
        num_agents=s["agents"],
        num_turns=1,
        num_train_epochs=1,
        num_generations=s["k"],
        max_new_tokens=s["tokens"],
        agent_learning_rate=1e-5,
        critic_learning_rate=1e-5,
        rollout_buffer_size=s["items_per_step"] * s["k"],
        train_batch_size=s["items_per_step"] * s["k"],
        eval_interval=0,
        logging_steps=10**9,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
    )
    trainer = trainer_cls(
        agent_model=s["model"],
        critic_model=s["model"],
        reward_func=reward,
        tokenizer=AutoTokenizer.from_pretrained(s["model"]),
        train_dataset=Dataset.from_dict({"prompt": prompts(s["items"])}),
        args=config,
    )
    clock = StepClock()
    clock.after_each_step(trainer.agent_optimizers[-1])  # agents update in turn: a step ends with the last one's
    start = time.perf_counter()
    trainer.train()
    return start, time.perf_counter(), len(clock.times), clock


def _ClockCallback(clock):
    from transformers import TrainerCallback

    class ClockCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return ClockCallback()


RUNNERS = {
    ("ours", False): run_ours,
    ("peer", False): run_peer,
    ("trl", False): run_trl,
    ("ours", True): run_ours_ac,
    ("peer", True): run_peer_ac,
}


def main():
    system, settings = sys.argv[1], json.loads(sys.argv[2])
    import torch

    torch.set_num_threads(settings["threads"])
    if settings.get("defaults"):
        print("RESULT " + json.dumps(measure_defaults(system, settings)))
        return
    start, end, steps, clock = RUNNERS[system, "algorithm" in settings](settings)
    steady_seconds, steady_steps = clock.steady(start, end, steps)
    joint_per_step = settings["items_per_step"] * settings["k"]  # aligned joint actions scored per step
    print(
        "RESULT "
        + json.dumps(
            {
                "seconds": end - start,
                "steps": steps,
                "steady_seconds": steady_seconds,
                "joint_samples_per_s": joint_per_step * steady_steps / steady_seconds,
                "seconds_per_step": steady_seconds / steady_steps,
                "peak_rss_mb": peak_rss_mb(),
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main()
