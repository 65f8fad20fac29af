"""Resume under DeepSpeed in one process (CPU): a run that saves a checkpoint per epoch, and a second run that resumes
from checkpoint-1, must end with the same weights for every agent (and, with `maac`, the critic and its head).

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> torchrun --nproc_per_node 1 ...
          <output_dir> full|resume [magrpo|maac|iac]
"""

import json
import os
import sys

import deepspeed
import torch
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def weights(module) -> list[float]:
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().double().sum().item() for p in params]


def main(output_dir: str, mode: str, algorithm: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    common = dict(
        output_dir=os.path.join(output_dir, "out"),
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=2,
        eval_interval=0,
        bf16=False,
        seed=1,
    )
    path = tiny_model_path("qwen2")
    if algorithm == "maac":
        trainer = MAACTrainer(
            agent_model=path,
            critic_model=path,
            reward_func=reward,
            train_dataset=dataset,
            args=MAACConfig(per_device_train_batch_size=2, **common),
        )
    elif algorithm == "iac":  # value heads with a hidden layer on the actors, inside their engines
        trainer = IACTrainer(
            agent_model=path,
            reward_func=reward,
            train_dataset=dataset,
            args=IACConfig(
                per_device_train_batch_size=2, use_separate_critic=False, value_head_hidden_dim=32, **common
            ),
        )
    else:
        trainer = MAGRPOTrainer(
            agent_model=path,
            reward_func=lambda a, b, *, batch_items: reward(a, b),
            train_dataset=dataset,
            args=MAGRPOConfig(num_generations=2, **common),
        )
    checkpoints = os.path.join(output_dir, "ckpt")
    resume = os.path.join(checkpoints, "checkpoint-1") if mode == "resume" else None
    trainer.train(resume_from_checkpoint=resume, checkpoint_dir=checkpoints)
    modules = [*trainer.agents, *getattr(trainer, "critics", [])]  # an actor's value head is one of its modules
    print(
        "RESULT "
        + json.dumps(
            {
                "weights": [weights(m) for m in modules],
                "steps": trainer.state.global_step,
                "engines": [type(a.model_wrapped).__name__ for a in trainer.agent_trainers],
            }
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "magrpo")
