"""Two processes hash a checkpoint directory with `ddp_timeout=3`; rank 1's hash of one file stalls for 12 s (a hung
read, no error): rank 0 stops at the gather of the digests after the timeout, not after the stall. Each rank prints
its own RESULT line and leaves with os._exit (the process group is broken)."""

import json
import os
import sys
import time

from accelerate import Accelerator
from transformers import TrainingArguments

from comlrl_trl import checkpoint


def main(root: str) -> None:
    # As the team configs set up the processes on a CPU-only machine (use_cpu), where transformers does not pass
    # ddp_timeout to the process group; the trainers apply it at train() (apply_ddp_timeout).
    args = TrainingArguments(output_dir=f"{root}/out", use_cpu=True, report_to="none", ddp_timeout=3)
    assert args.device.type == "cpu"
    accelerator = Accelerator(cpu=True)
    checkpoint.apply_ddp_timeout(args.ddp_timeout)
    rank = accelerator.process_index
    directory = f"{root}/checkpoint-1"
    if rank == 0:
        os.makedirs(directory)
        for i in range(4):
            with open(f"{directory}/f_{i}", "wb") as f:
                f.write(bytes([i]) * 4096)
    accelerator.wait_for_everyone()
    sha256 = checkpoint._sha256

    def stalling_sha256(path: str) -> str:
        if rank == 1:
            time.sleep(12)
        return sha256(path)

    checkpoint._sha256 = stalling_sha256
    start = time.perf_counter()
    try:
        checkpoint.build_manifest(directory, accelerator)
        error = None
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
    print("RESULT " + json.dumps({"rank": rank, "error": error, "seconds": time.perf_counter() - start}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
