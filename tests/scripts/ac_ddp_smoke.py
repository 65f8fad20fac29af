"""IAC (heads on the actors, separate critics) and MAAC under torchrun: actors and critics stay in sync."""

import json
import sys

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer


def reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def checksum(module) -> float:
    return sum(p.detach().double().sum().item() for p in module.parameters())


def run(name: str, output_dir: str) -> dict:
    path = tiny_model_path("qwen2")
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(8)]})
    common = dict(
        output_dir=f"{output_dir}/{name}",
        per_device_train_batch_size=2,
        max_new_tokens=6,
        learning_rate=0.05,
        critic_learning_rate=0.01,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
    )
    if name == "iac-shared":
        trainer = IACTrainer(
            agent_model=path,
            reward_func=reward,
            train_dataset=dataset,
            args=IACConfig(use_separate_critic=False, **common),
        )
    elif name == "iac-separate":
        trainer = IACTrainer(
            agent_model=path,
            critic_model=path,
            reward_func=reward,
            train_dataset=dataset,
            args=IACConfig(critic_type="q", **common),
        )
    else:
        trainer = MAACTrainer(
            agent_model=path, critic_model=path, reward_func=reward, train_dataset=dataset, args=MAACConfig(**common)
        )
    modules = trainer.agents + trainer.critics
    before = [checksum(m) for m in modules]
    trainer.train()
    after = [checksum(m) for m in modules]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, after)
    return {"before": before, "after": gathered, "env_step": trainer.env_step, "steps": trainer.state.global_step}


def main(output_dir: str) -> None:
    report = {name: run(name, output_dir) for name in ("iac-shared", "iac-separate", "maac")}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"world": dist.get_world_size(), **report}))


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
