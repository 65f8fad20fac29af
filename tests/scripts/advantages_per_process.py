"""MAGRPO under torchrun: each rank's advantages must come from the rewards of its own task items.

With `advantage_mode="raw"` and no normalisation, a completion's advantage is its joint return, which is the
reward the reward function gave it on that rank (align mode, one turn). Every item gets distinct rewards, so a
rank that took another rank's slice of the gathered advantages is caught.
"""

import json
import sys

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


REWARDS = []  # the rewards this rank's reward function returned, in call order


def reward(first, second, *, batch_items):
    base = 10.0 * batch_items[0]["idx"]
    values = [base + k for k in range(len(first))]  # item i: 10i, 10i+1, ...
    REWARDS.extend(values)
    return values


def main(output_dir: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)], "idx": list(range(4))})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=2,
        max_new_tokens=4,
        learning_rate=0.05,
        advantage_mode="raw",
        advantage_normalization=False,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=1,
        eval_interval=0,
    )
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config
    )
    for model in trainer.agents:
        model.train()
    rank = dist.get_rank()
    rows = [dict(dataset[i]) for i in (rank, rank + 2) for _ in range(2)]  # this rank's two items, K=2 copies
    rollout = trainer.orchestrator.rollout(rows)
    advantages = [agent_advantages.tolist() for agent_advantages in rollout.agent_advantages]
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {"rewards": list(REWARDS), "advantages": advantages})
    if rank == 0:
        print("RESULT " + json.dumps({"world": dist.get_world_size(), "ranks": everything}))


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
