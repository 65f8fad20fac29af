"""Train 3 epochs with a checkpoint per epoch; optionally die with SIGKILL mid-run (for the crash tests).

Usage: checkpoint_run.py CHECKPOINT_DIR OUTPUT_JSON [--kill-while-saving N | --kill-before-epoch N] [--resume]
"""

import argparse
import json
import os
import signal

import torch
from datasets import Dataset
from transformers import TrainerCallback

import comlrl_trl.checkpoint
from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def reward(first, second, *, batch_items):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


class KillBeforeEpoch(TrainerCallback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_begin(self, args, state, control, **kwargs):
        if round(state.epoch) == self.epoch - 1 and state.global_step > 0:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_json")
    parser.add_argument("--kill-while-saving", type=int)
    parser.add_argument("--kill-before-epoch", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    if args.kill_while_saving is not None:  # die after the staging directory is written, before it is committed
        real_commit = comlrl_trl.checkpoint.commit

        def dying_commit(staging, final):
            if final.endswith(f"checkpoint-{args.kill_while_saving}"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_commit(staging, final)

        comlrl_trl.checkpoint.commit = dying_commit  # save_staged looks it up in its own module

    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=os.path.join(args.checkpoint_dir, "out"),
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=3,
        eval_interval=0,
        seed=1,
    )
    callbacks = [KillBeforeEpoch(args.kill_before_epoch)] if args.kill_before_epoch else None
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"),
        reward_func=reward,
        train_dataset=dataset,
        args=config,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None, checkpoint_dir=args.checkpoint_dir)
    sums = [[p.detach().double().sum().item() for p in model.parameters()] for model in trainer.agents]
    rewards = [row["turn_1/reward_mean"] for row in trainer.state.log_history if "turn_1/reward_mean" in row]
    with open(args.output_json, "w") as f:
        json.dump({"params": sums, "rewards": rewards, "env_step": trainer.env_step}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
