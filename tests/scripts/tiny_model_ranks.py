"""Two ranks build the same tiny model into an empty cache after a ZeRO-3 trainer config exists (as the torchrun
scripts do): both must get a complete directory (transformers saves only on rank 0 of a process group, and under
ZeRO-3's loading hooks it saved a partitioned model without weights or config).

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=3 COMLRL_TRL_CACHE=<empty dir> \\
          torchrun --nproc_per_node 2 ... <output_dir>
"""

import json
import os
import sys

import torch.distributed as dist
from transformers import AutoModelForCausalLM

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig


def main(output_dir: str) -> None:
    MAGRPOConfig(output_dir=output_dir, num_generations=2, per_device_train_batch_size=2, bf16=False)
    path = tiny_model_path("qwen2", seed=7)  # a seed no test builds: this process group builds it
    files = sorted(name for name in os.listdir(path) if not name.startswith("."))
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [files, parameters])
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": gathered}))
    dist.destroy_process_group()  # before Python's shutdown, which can abort with Gloo's threads still busy


if __name__ == "__main__":
    main(sys.argv[1])
