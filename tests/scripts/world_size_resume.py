"""Save a MAGRPO checkpoint with one number of processes (`save`), then resume it with another (`resume`): the
resume is refused at its start with both numbers (under DeepSpeed the ZeRO shards could not load)."""

import json
import sys

import torch.distributed as dist
from checkpoint_ddp import reward
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def build(output_dir: str, epochs: int) -> MAGRPOTrainer:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=2,
        per_device_train_batch_size=2,
        max_new_tokens=4,
        learning_rate=0.05,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=epochs,
        eval_interval=0,
        bf16=False,  # DeepSpeed's CPU config has bf16 off
    )
    return MAGRPOTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config)


def main(root: str, mode: str) -> None:
    trainer = build(f"{root}/out-{mode}", 2 if mode == "resume" else 1)
    try:
        if mode == "save":
            trainer.train(checkpoint_dir=f"{root}/ckpt")
        else:
            trainer.train(resume_from_checkpoint=True, checkpoint_dir=f"{root}/ckpt")
        error = None
    except ValueError as raised:
        error = str(raised)
    if trainer.accelerator.is_main_process:
        report = {"world": trainer.accelerator.num_processes, "step": trainer.state.global_step, "error": error}
        print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if dist.is_initialized():
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
