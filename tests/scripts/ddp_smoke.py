"""Two-agent MAGRPO under torchrun: every rank trains, and the agents' weights stay identical across ranks."""

import json
import sys

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


SCORED = []  # the task items this rank scored
EVALUATED = []  # (item, reward) of this rank's evaluation calls, in order


def reward(first, second, *, batch_items):
    rewards = [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]
    SCORED.append(batch_items[0]["idx"])
    EVALUATED.append((batch_items[0]["idx"], rewards[0]))
    return rewards


def main(output_dir: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(8)], "idx": list(range(8))})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=4,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
    )
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"),
        reward_func=reward,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(3)),
        args=config,
    )
    before = [sum(p.sum().item() for p in model.parameters()) for model in trainer.agents]
    trainer.train()
    scored = [None] * dist.get_world_size()
    dist.all_gather_object(scored, SCORED)
    after = [sum(p.detach().double().sum().item() for p in model.parameters()) for model in trainer.agents]
    EVALUATED.clear()
    metrics = trainer.evaluate(num_eval_samples=3)  # 3 items on 2 ranks: rank 1 repeats item 2 to keep in step
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, after)
    evaluated = [None] * dist.get_world_size()
    dist.all_gather_object(evaluated, list(EVALUATED))
    if dist.get_rank() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "world": dist.get_world_size(),
                    "before": before,
                    "after": gathered,
                    "env_step": trainer.env_step,
                    "eval": metrics,
                    "scored": scored,
                    "evaluated": evaluated,
                    "wrapped": [type(a.model_wrapped).__name__ for a in trainer.agent_trainers],
                    "dist": str(trainer.accelerator.distributed_type),
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
