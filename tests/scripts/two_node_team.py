"""A tiny team of any family on "2 nodes x 2 ranks" (two torchrun launchers on one machine, gloo), each launcher in
its own working directory, with a shared directory standing in for the shared filesystem.

Every rank prints `RESULT {json}` with its rank, node, `should_save`, the checkpoint files it hashed and what it
found, so the test reads each launcher's ranks from its stdout.

Modes (argv[2]):
- `save`: one epoch (2 steps), a checkpoint per epoch in `<shared>/ckpt`;
- `resume`: two epochs, resumed from the latest checkpoint in `<shared>/ckpt`;
- `each_node_save` / `each_node_resume`: the same with `save_on_each_node=True` and `checkpoint_dir="ckpt"`, relative
  to each launcher's working directory (node-local storage: each node writes and reads its own copy);
- `fail`: rank 3's reward function raises in the second step, with `ddp_timeout=20`;
- `stall`: rank 3's reward function sleeps 300 s in the second step (no error), with `ddp_timeout=10`.

Family (argv[3], default `magrpo`): `magrpo`, `iac` (a separate critic per agent, each with its own optimiser),
`maac`, `madpo` or `marlhf` (one iteration: pairs, reward model, RL stage), all fully fine-tuned in fp32.
"""

import json
import os
import sys
import time

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl import checkpoint
from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


CALLS = {"n": 0}


def reward(first, second):
    CALLS["n"] += 1
    rank = dist.get_rank()
    if CALLS["n"] == 2 and rank == 3 and MODE == "fail":
        raise RuntimeError("injected failure on rank 3 in its second reward call")
    if CALLS["n"] == 2 and rank == 3 and MODE == "stall":
        time.sleep(300)
    return [float(i) + len(b) / (1.0 + len(a)) for i, (a, b) in enumerate(zip(first, second))]


def magrpo_reward(first, second, *, batch_items):
    return reward(first, second)


MODE = ""


def build(family: str, shared: str, mode: str):
    """The family's trainer: 8 items, one or (resuming) two epochs."""
    common = dict(
        output_dir=os.path.join(shared, f"out-{mode}"),
        per_device_train_batch_size=2,
        max_new_tokens=4,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=2 if mode.endswith("resume") else 1,
        eval_interval=0,
        bf16=False,
        save_on_each_node=mode.startswith("each_node"),
        ddp_timeout={"fail": 20, "stall": 10}.get(mode, 120),
    )
    team = dict(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=DATASET)
    if family == "magrpo":
        config = MAGRPOConfig(num_generations=2, steps_per_generation=1, **common)
        return MAGRPOTrainer(**team | {"reward_func": magrpo_reward}, args=config)
    if family == "iac":
        config = IACConfig(use_separate_critic=True, **common)
        return IACTrainer(critic_model=tiny_model_path("qwen2"), **team, args=config)
    if family == "maac":
        return MAACTrainer(critic_model=tiny_model_path("qwen2"), **team, args=MAACConfig(**common))
    preference = dict(
        num_agents=2, preference_num_candidates=4, pair_selection="all", preference_pairs_per_sample=None
    )
    if family == "madpo":
        common["per_device_train_batch_size"] = 4  # a micro-step holds whole items' candidates
        return MADPOTrainer(**team, args=MADPOConfig(**preference, **common))
    if family == "marlhf":
        config = MARLHFConfig(
            num_generations=2,
            reward_learning_rate=1e-3,
            reward_num_train_epochs=1,
            reward_train_batch_size=2,
            **preference,
            **common,
        )
        return MARLHFTrainer(**team, args=config)
    raise ValueError(f"unknown family {family!r}")


DATASET = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(8)]})


def main(shared: str, mode: str, family: str = "magrpo") -> None:
    global MODE
    MODE = mode
    each_node = mode.startswith("each_node")
    trainer = build(family, shared, mode)
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
        "step": getattr(trainer, "rl_trainer", trainer).state.global_step,  # MARLHF: its RL stage's
        "hashed": hashed,
        "reward_calls": CALLS["n"],
        "checkpoints": sorted(os.listdir(root)) if os.path.isdir(root) else [],
        "seconds": time.time() - start,
        "error": error,
    }
    os.write(1, ("RESULT " + json.dumps(report) + "\n").encode())  # one write: the node's ranks share its stdout


if __name__ == "__main__":
    main(*sys.argv[1:])
    if dist.is_initialized():
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
