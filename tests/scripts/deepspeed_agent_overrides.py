"""Per-agent optimiser settings under DeepSpeed (one process, CPU): agent 0 at lr 0 stays, agent 1 learns.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=2 torchrun --nproc_per_node 1 ...
"""

import json
import sys

import torch
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def reward(first, second, *, batch_items):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def main(output_dir: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=2,
        max_new_tokens=6,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
        bf16=False,
        agent_overrides=[
            {"learning_rate": 0.0, "lr_scheduler_type": "linear"},
            {"learning_rate": 0.05, "lr_scheduler_type": "constant"},
        ],
    )
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config
    )
    before = [{n: p.detach().clone() for n, p in agent.model.named_parameters()} for agent in trainer.agent_trainers]
    trainer.train()
    changed = [
        sum(not torch.equal(before[i][n], p) for n, p in agent.model.named_parameters())
        for i, agent in enumerate(trainer.agent_trainers)
    ]
    print(
        "RESULT "
        + json.dumps(
            {
                "engines": [type(agent.model_wrapped).__name__ for agent in trainer.agent_trainers],
                "changed": changed,
                "parameters": [len(b) for b in before],
                "lrs": [agent.optimizer.param_groups[0]["lr"] for agent in trainer.agent_trainers],
                "end_factors": [
                    agent.lr_scheduler.lr_lambdas[0](trainer.state.max_steps) for agent in trainer.agent_trainers
                ],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
