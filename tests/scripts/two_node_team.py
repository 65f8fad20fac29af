"""A tiny MAGRPO team on "2 nodes x 2 ranks" (two torchrun launchers on one machine, gloo), each launcher in its own
working directory, with a shared directory standing in for the shared filesystem.

Every rank prints `RESULT {json}` with its rank, node, `should_save`, the checkpoint files it hashed and what it
found, so the test reads each launcher's ranks from its stdout.

Modes (argv[2]):
- `save`: one epoch (2 steps), a checkpoint per epoch in `<shared>/ckpt`;
- `resume`: two epochs, resumed from the latest checkpoint in `<shared>/ckpt`;
- `each_node_save` / `each_node_resume`: the same with `save_on_each_node=True` and `checkpoint_dir="ckpt"`, relative
  to each launcher's working directory (node-local storage: each node writes and reads its own copy);
- `fail`: rank 3's reward function raises in the second step, with `ddp_timeout=20`;
- `stall`: rank 3's reward function sleeps 300 s in the second step (no error), with `ddp_timeout=10`.
"""

import json
import os
import sys
import time

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl import checkpoint
from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


CALLS = {"n": 0}


def reward(first, second, *, batch_items):
    CALLS["n"] += 1
    rank = dist.get_rank()
    if CALLS["n"] == 2 and rank == 3 and MODE == "fail":
        raise RuntimeError("injected failure on rank 3 in its second reward call")
    if CALLS["n"] == 2 and rank == 3 and MODE == "stall":
        time.sleep(300)
    return [float(i) + len(b) / (1.0 + len(a)) for i, (a, b) in enumerate(zip(first, second))]


MODE = ""


def main(shared: str, mode: str) -> None:
    global MODE
    MODE = mode
    each_node = mode.startswith("each_node")
    epochs = 2 if mode.endswith("resume") else 1
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(8)]})
    config = MAGRPOConfig(
        output_dir=os.path.join(shared, f"out-{mode}"),
        num_generations=2,
        per_device_train_batch_size=2,
        steps_per_generation=1,
        max_new_tokens=4,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=epochs,
        eval_interval=0,
        bf16=False,
        save_on_each_node=each_node,
        ddp_timeout={"fail": 20, "stall": 10}.get(mode, 120),
    )
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config
    )
    hashed = []
    sha256 = checkpoint._sha256
    checkpoint._sha256 = lambda path: hashed.append(os.path.relpath(path, os.getcwd())) or sha256(path)
    root = "ckpt" if each_node else os.path.join(shared, f"ckpt-{mode}" if mode in ("fail", "stall") else "ckpt")
    resume = mode.endswith("resume")
    start = time.time()
    error = None
    try:
        trainer.train(resume_from_checkpoint=True if resume else None, checkpoint_dir=root)
    except ValueError as raised:  # a refused resume
        error = str(raised)
    report = {
        "rank": dist.get_rank(),
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world": dist.get_world_size(),
        "should_save": trainer.args.should_save,
        "step": trainer.state.global_step,
        "hashed": hashed,
        "checkpoints": sorted(os.listdir(root)) if os.path.isdir(root) else [],
        "seconds": time.time() - start,
        "error": error,
    }
    os.write(1, ("RESULT " + json.dumps(report) + "\n").encode())  # one write: the node's ranks share its stdout


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if dist.is_initialized():
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
