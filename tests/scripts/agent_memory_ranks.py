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

Run with: [ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> [ACCELERATE_DEEPSPEED_CONFIG_FILE=...]]
          torchrun --nproc_per_node 2 ...
          <output_dir> <agents>
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from torch.optim.optimizer import register_optimizer_step_post_hook

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


DEBUG = os.environ.get("MEM_DEBUG")
MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")  # ZeRO-1/2 and ZeRO-3


def reward(*completions, batch_items):
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


def basic_optimizer(agent):
    """The torch optimiser under an agent's wrappers (Accelerate's, DeepSpeed's ZeRO optimiser)."""
    optimizer = agent.optimizer
    while not type(optimizer).__module__.startswith("torch.optim"):
        optimizer = optimizer.optimizer
    return optimizer


class Counter:
    def __init__(self):
        self.trainer = None
        self.peak = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
        self.steps = 0

    def count(self) -> dict[str, int]:
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

        agents = self.trainer.agent_trainers
        models = [agent.model for agent in agents]
        basics = [basic_optimizer(agent) for agent in agents]
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
        for agent in agents:  # DeepSpeed's ZeRO optimiser: its fp32 master partitions, gradient partitions, buckets
            zero = getattr(getattr(agent, "deepspeed", None), "optimizer", None)
            if zero is not None:
                for where, tensor in _tensors(zero):
                    add(tensor, "optimizer" if where.split(".")[1] in MASTERS else "grads", where)
        return {**sizes, "total": sum(sizes.values())}

    def hook(self, optimizer, args, kwargs):
        if self.trainer is None:
            return
        self.steps += 1
        counted = self.count()
        if counted["total"] > self.peak["total"]:
            self.peak = counted


def main(output_dir: str, agents: int) -> None:
    counter = Counter()
    register_optimizer_step_post_hook(counter.hook)
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_agents=agents,
        num_generations=2,
        per_device_train_batch_size=2,
        steps_per_generation=1,
        max_new_tokens=4,
        learning_rate=0.05,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=2,
        eval_interval=0,
        bf16=False,
    )
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config
    )
    counter.trainer = trainer
    trainer.train()
    after = counter.count()
    report = {
        "rank": dist.get_rank(),
        "peak": counter.peak,
        "after": after,
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
    main(sys.argv[1], int(sys.argv[2]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
