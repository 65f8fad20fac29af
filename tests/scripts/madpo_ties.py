"""MADPO on two processes (gloo) where every candidate on rank 1 ties: rank 1 has no preference pair, yet it must
join every forward, gather and gradient all-reduce, and both ranks must end with the same weights.

Run with: torchrun --nproc_per_node 2 ... <output_dir> [reward_gap|all]  (one process, e.g. under DeepSpeed, is plain
MADPO). With `all`, rank 0 has 6 pairs per item (3 no-grad chunks of 4 rows) against rank 1's placeholder (1 chunk).
"""

import json
import sys

import deepspeed
import torch.distributed as dist
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer


SELECTION = sys.argv[2] if len(sys.argv) > 2 else "reward_gap"


def reward(first, second):
    if dist.get_rank() == 1:
        return [0.0] * len(first)  # every candidate ties: no pair on this process
    if SELECTION == "all":  # distinct rewards: every one of the C(4, 2) = 6 pairs of each item, 3 chunks of 4 rows
        return [float(i) for i in range(len(first))]
    return [float(len(b) - len(a)) for a, b in zip(first, second)]


def weights(model) -> list[float]:
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):  # ZeRO-3 partitions: the full tensors (no-op otherwise)
        return [round(p.detach().double().sum().item(), 10) for p in params]


def main(output_dir: str) -> None:
    items = Dataset.from_dict({"prompt": [f"Item {i}: tell me" for i in range(4)]})
    config = MADPOConfig(
        output_dir=output_dir,
        num_agents=2,
        preference_num_candidates=4,
        per_device_train_batch_size=4,
        max_new_tokens=8,
        learning_rate=0.05,
        logging_steps=1,
        report_to="none",
        gradient_checkpointing=False,
        num_train_epochs=1,
        eval_interval=0,
        bf16=False,
        pair_selection=SELECTION,
        preference_pairs_per_sample=None if SELECTION == "all" else 2,
    )
    trainer = MADPOTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=items, args=config)
    start = [weights(agent) for agent in trainer.agents]
    trainer.train()
    rank = [weights(agent) for agent in trainer.agents]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank)
    losses = [row["agent_0/dpo/loss"] for row in trainer.state.log_history if "agent_0/dpo/loss" in row]
    if dist.get_rank() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "same": all(g == gathered[0] for g in gathered),
                    "moved": gathered[0] != start,
                    "steps": trainer.state.global_step,
                    "losses": losses,
                    "pairs": [r["preference/pairs"] for r in trainer.state.log_history if "preference/pairs" in r],
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
