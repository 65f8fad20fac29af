"""Two processes hash and verify one checkpoint directory, each its share of the files, with a slowed hash (a sleep
per file on one thread, as a filesystem that reads slowly): the files each rank hashed, the wall time against rank 0
alone, a damaged file found by the rank that owns it, and a rank that raises while verifying."""

import json
import os
import sys
import threading
import time

import torch.distributed as dist
from accelerate import Accelerator
from transformers import TrainingArguments

from comlrl_trl import checkpoint


SLEEP = 0.25  # seconds per file
FILES = 12


def main(root: str) -> None:
    # The process group is set up as the trainers' configs set it up (TrainingArguments, with its ddp_timeout).
    args = TrainingArguments(output_dir=f"{root}/out", use_cpu=True, report_to="none", ddp_timeout=60)
    assert args.device.type == "cpu"
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    directory = f"{root}/checkpoint-1"
    if rank == 0:
        os.makedirs(f"{directory}/agent_0")
        for i in range(FILES):
            with open(f"{directory}/agent_0/file_{i:02d}.bin" if i % 2 == 0 else f"{directory}/f_{i:02d}", "wb") as f:
                f.write(bytes([i]) * 4096)
    accelerator.wait_for_everyone()

    hashed, failing = [], threading.Event()
    sha256 = checkpoint._sha256

    def slow_sha256(path: str) -> str:
        if failing.is_set():
            raise OSError(f"injected read error on rank {rank} ({os.path.basename(path)})")
        time.sleep(SLEEP)
        hashed.append(os.path.relpath(path, directory))
        return sha256(path)

    checkpoint._sha256 = slow_sha256
    checkpoint.HASH_THREADS = 1  # the sleep stands for reading: one reader per process

    start = time.perf_counter()
    manifest = checkpoint.build_manifest(directory, accelerator)
    shared_time = time.perf_counter() - start
    saved = sorted(hashed)
    hashed.clear()

    alone_time, alone = None, None
    if rank == 0:  # the old way: rank 0 hashes every file while rank 1 waits
        start = time.perf_counter()
        alone = checkpoint.build_manifest(directory)
        alone_time = time.perf_counter() - start
        checkpoint.write_metadata(directory, {"version": checkpoint.CHECKPOINT_VERSION, "run_id": "r"}, manifest)
    hashed.clear()
    accelerator.wait_for_everyone()

    checkpoint.verify_checkpoint(directory, accelerator)
    verified = sorted(hashed)

    # A file of rank 1's share is damaged: rank 1 finds it, both ranks raise the same error.
    accelerator.wait_for_everyone()
    if rank == 1:
        with open(os.path.join(directory, verified[0]), "r+b") as f:
            f.write(b"\xff")
    accelerator.wait_for_everyone()
    damaged = _error(lambda: checkpoint.verify_checkpoint(directory, accelerator))

    # Rank 1 raises while verifying: both ranks stop with its message, without waiting out a timeout.
    if rank == 1:
        failing.set()
    start = time.perf_counter()
    failed = _error(lambda: checkpoint.verify_checkpoint(directory, accelerator))
    failed_time = time.perf_counter() - start

    report = {
        "saved": saved,
        "verified": verified,
        "shared_time": shared_time,
        "alone_time": alone_time,
        "same_manifest": alone == manifest if rank == 0 else None,
        "damaged": damaged,
        "failed": failed,
        "failed_time": failed_time,
    }
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if rank == 0:
        print("RESULT " + json.dumps(reports))


def _error(function) -> str | None:
    try:
        function()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
