"""MADPO on two processes (gloo) where every candidate on rank 1 ties: rank 1 has no preference pair, yet it must
join every forward, gather and gradient all-reduce, and both ranks must end with the same weights.

Run with: torchrun --nproc_per_node 2 ... <output_dir>  (one process, e.g. under DeepSpeed, is plain MADPO)
"""

import json
import sys

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer


def reward(first, second):
    if dist.get_rank() == 1:
        return [0.0] * len(first)  # every candidate ties: no pair on this process
    return [float(len(b) - len(a)) for a, b in zip(first, second)]


def weights(model) -> list[float]:
    return [round(p.detach().double().sum().item(), 10) for p in model.parameters()]


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
        preference_pairs_per_sample=2,
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
