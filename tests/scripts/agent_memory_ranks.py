"""Bytes of parameters, gradients and optimiser state each process holds for N fully fine-tuned agents (MAGRPO,
fp32) on two processes (gloo, CPU): under DDP, or under DeepSpeed ZeRO-2 / ZeRO-3 (set by the environment).

Counted, not assumed: every distinct storage (`untyped_storage().data_ptr()`, counted once, under the first of these
that reaches it) behind
- params: the agents' parameters (under ZeRO-3 a parameter's own tensor, empty outside its forward unless ZeRO keeps
  it whole as a small "persistent" one, and its partition `ds_tensor`; under ZeRO-2 views of one flat buffer per
  agent);
- optimizer: the torch optimiser's parameters and AdamW's two moments, and under DeepSpeed the ZeRO optimiser's fp32
  master partitions (a copy, in fp32 too);
- grads: the parameters' `.grad`, and under DeepSpeed every other tensor the ZeRO optimiser holds (gradient
  partitions, reduce buckets).
The count runs after every optimiser step (torch's global step post-hook: the gradients are still there and the
moments exist), over all agents, on every process; each reports its peak and the count after training. The
DeepSpeed config comes from ACCELERATE_DEEPSPEED_CONFIG_FILE where the test sets one.

With `iac` (argv[3]) the team is IAC with a separate critic per agent (each with its own AdamW, under DeepSpeed in an
engine of its own), and the critics are counted the same way, apart (`critic_peak`, `critic_after`: their own peak).

Run with: [ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> [ACCELERATE_DEEPSPEED_CONFIG_FILE=...]]
          torchrun --nproc_per_node 2 ...
          <output_dir> <agents> [magrpo|iac]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from torch.optim.optimizer import register_optimizer_step_post_hook

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


DEBUG = os.environ.get("MEM_DEBUG")
MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")  # ZeRO-1/2 and ZeRO-3


def reward(*completions, batch_items):
    return [float(len(text)) / 10 for text in completions[-1]]


def critic_reward(*completions):
    return [float(len(text)) / 10 for text in completions[-1]]


def _tensors(obj, depth: int = 2, path=""):
    """The tensors an object holds in its attributes, lists, tuples and dicts, `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield path + ".grad", obj.grad
        return
    if depth < 0:
        return
    if isinstance(obj, dict):
        values = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        values = [(str(i), v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
        values = [
            (k, v) for k, v in vars(obj).items() if k not in ("optimizer", "params_in_partition", "bit16_groups")
        ]
    else:
        return
    for key, value in values:
        yield from _tensors(value, depth - 1, f"{path}.{key}")


def basic_optimizer(optimizer):
    """The torch optimiser under its wrappers (Accelerate's, DeepSpeed's ZeRO optimiser)."""
    while not type(optimizer).__module__.startswith("torch.optim"):
        optimizer = optimizer.optimizer
    return optimizer


def agent_group(trainer):
    """`(models, torch optimisers, ZeRO optimisers)` of the agents."""
    agents = trainer.agent_trainers
    zeros = [getattr(getattr(agent, "deepspeed", None), "optimizer", None) for agent in agents]
    return [agent.model for agent in agents], [basic_optimizer(agent.optimizer) for agent in agents], zeros


def critic_group(trainer):
    """`(models, torch optimisers, ZeRO optimisers)` of the critics with optimisers of their own (none: empty)."""
    critics = getattr(trainer, "critic_set", None)
    if critics is None or not critics.critics:
        return [], [], []
    if critics.engines:
        engines = critics.engines
        return (
            [e.module for e in engines],
            [basic_optimizer(e.optimizer) for e in engines],
            [e.optimizer for e in engines],
        )
    return list(critics.critics), list(critics.optimizers), []


def count_group(models, basics, zeros) -> dict[str, int]:
    seen: set[int] = set()
    sizes = {"params": 0, "grads": 0, "optimizer": 0}

    def add(tensor, kind, where=""):
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        sizes[kind] += storage.nbytes()
        if DEBUG:
            print("DBG", dist.get_rank(), kind, where, tuple(tensor.shape), storage.nbytes(), flush=True)

    masters = [p for optimizer in basics for group in optimizer.param_groups for p in group["params"]]
    for model in models:
        for p in model.parameters():
            add(p, "params", "param")
            add(getattr(p, "ds_tensor", None), "params", "ds_tensor")
    for optimizer in basics:
        for p in masters:
            add(p, "optimizer", "master")
        for state in optimizer.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                add(state.get(name), "optimizer", name)
    for p in [p for model in models for p in model.parameters()] + masters:
        add(p.grad, "grads", "grad")
    for zero in zeros:  # DeepSpeed's ZeRO optimiser: its fp32 master partitions, gradient partitions, buckets
        if zero is not None:
            for where, tensor in _tensors(zero):
                add(tensor, "optimizer" if where.split(".")[1] in MASTERS else "grads", where)
    return {**sizes, "total": sum(sizes.values())}


class Counter:
    def __init__(self):
        self.trainer = None
        self.peak = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
        self.critic_peak = dict(self.peak)
        self.steps = 0

    def hook(self, optimizer, args, kwargs):
        if self.trainer is None:
            return
        self.steps += 1
        counted, critics = count_group(*agent_group(self.trainer)), count_group(*critic_group(self.trainer))
        if counted["total"] > self.peak["total"]:
            self.peak = counted
        if critics["total"] > self.critic_peak["total"]:
            self.critic_peak = critics


def main(output_dir: str, agents: int, family: str = "magrpo") -> None:
    counter = Counter()
    register_optimizer_step_post_hook(counter.hook)
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    common = dict(
        output_dir=output_dir,
        num_agents=agents,
        per_device_train_batch_size=2,
        max_new_tokens=4,
        learning_rate=0.05,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=2,
        eval_interval=0,
        bf16=False,
    )
    path = tiny_model_path("qwen2")
    if family == "iac":
        config = IACConfig(use_separate_critic=True, **common)
        trainer = IACTrainer(
            agent_model=path, critic_model=path, reward_func=critic_reward, train_dataset=dataset, args=config
        )
    else:
        config = MAGRPOConfig(num_generations=2, steps_per_generation=1, **common)
        trainer = MAGRPOTrainer(agent_model=path, reward_func=reward, train_dataset=dataset, args=config)
    counter.trainer = trainer
    trainer.train()
    report = {
        "rank": dist.get_rank(),
        "peak": counter.peak,
        "after": count_group(*agent_group(trainer)),
        "critic_peak": counter.critic_peak,
        "critic_after": count_group(*critic_group(trainer)),
        "critic_numel": [
            sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters()) for m in critic_group(trainer)[0]
        ],
        "hooks": counter.steps,
        "engines": [type(agent.model_wrapped).__name__ for agent in trainer.agent_trainers],
        "numel": [
            sum(getattr(p, "ds_numel", p.numel()) for p in agent.model.parameters())
            for agent in trainer.agent_trainers
        ],
    }
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"world": dist.get_world_size(), "ranks": reports}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
