"""Two-process MAGRPO checkpoints: one staging directory shared by the ranks, a manifest with every rank's RNG
file, and a resume verified by both ranks (each hashes its share of the files), whose verdict on a damaged checkpoint reaches
both ranks."""

import json
import sys

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl import checkpoint
from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl_trl.utils import read_checkpoint_metadata


def reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def build(output_dir: str, epochs: int) -> MAGRPOTrainer:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=2,
        per_device_train_batch_size=2,
        max_new_tokens=4,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=epochs,
        eval_interval=0,
    )
    return MAGRPOTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config)


def main(root: str) -> None:
    build(f"{root}/out", 1).train(checkpoint_dir=f"{root}/ckpt")
    hashed = []
    sha256 = checkpoint._sha256
    checkpoint._sha256 = lambda path: hashed.append(path) or sha256(path)
    resumed = build(f"{root}/out", 2)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=f"{root}/ckpt")
    steps, counts = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(steps, resumed.state.global_step)
    dist.all_gather_object(counts, len(hashed))
    if dist.get_rank() == 0:  # damage checkpoint-1: the verdict of rank 0 must stop both ranks
        with open(f"{root}/ckpt/checkpoint-1/agent_1/model.safetensors", "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
    dist.barrier()
    try:
        build(f"{root}/out2", 2).train(resume_from_checkpoint=f"{root}/ckpt/checkpoint-1")
        error = None
    except ValueError as raised:
        error = str(raised)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if dist.get_rank() == 0:
        manifest = read_checkpoint_metadata(f"{root}/ckpt/checkpoint-2")["manifest"]
        report = {"steps": steps, "files": sorted(manifest), "hashed": counts, "errors": errors}
        print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
