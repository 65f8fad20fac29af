"""MARLHF (and MARLHFIter with `iter`) under DeepSpeed in one process (CPU): the reward-model stage trains beside
the agents' engines, and repeated train() calls keep agent 0's engine. Records, for each reward model, its scores of
fixed texts right after training (through its training engine) and once the stage is over (through what MARLHF
scores with), and whether its training engine's optimiser is still alive then.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> torchrun --nproc_per_node 1 ...
"""

import gc
import json
import sys
import weakref

import torch
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.preference import (
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterTrainer,
    MARLHFTrainer,
    marlhf_trainer,
)


def reward(first, second):
    return [float(len(b) // 8 - len(a) // 8) for a, b in zip(first, second)]


def live_optimizer_state() -> list[int]:
    """Live torch optimisers holding state, and the number of state tensors they hold (DeepSpeed's ZeRO optimisers
    keep theirs in a wrapped torch optimiser)."""
    gc.collect()
    # Accelerate's and DeepSpeed's wrappers share the state of the torch optimiser they wrap: count states once.
    states = {id(o.state): o.state for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer) and o.state}
    tensors = sum(torch.is_tensor(v) for state in states.values() for param in state.values() for v in param.values())
    return [len(states), tensors]


TEXTS = ["Item 0: say something. A: yes B: no", "Item 1: say something. A: a longer answer B: ok"]


class RecordingRewardTrainer(marlhf_trainer.JointRewardTrainer):
    """Records the reward model's engine (its own, configured from the reward config's batch size), its scores of
    `TEXTS` right after training, and a weak reference to the engine's optimiser."""

    engines: list = []
    scores: list = []
    optimizers: list = []

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        engine = self.model_wrapped
        self.engines.append([type(engine).__name__, engine.train_micro_batch_size_per_gpu()])
        self.scores.append(marlhf_trainer.RewardModelScorer(self.model, self.processing_class, 64).score(TEXTS))
        self.optimizers.append(weakref.ref(engine.optimizer))
        return output


def main(output_dir: str, iterative: bool) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})
    common = dict(
        output_dir=output_dir,
        num_agents=2,
        num_generations=2,
        per_device_train_batch_size=2,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
        bf16=False,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_learning_rate=1e-3,
        reward_num_train_epochs=1,
        reward_train_batch_size=3,
        # TRL's full-distribution sampling, as in tests/test_marlhf_trainer.py: at T 0.6 / top-p 0.6 the tiny model,
        # after iteration 1's updates at this learning rate, can sample one answer per item (no pair in iteration 2).
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    marlhf_trainer.JointRewardTrainer = RecordingRewardTrainer
    if iterative:
        trainer = MARLHFIterTrainer(
            agent_model=tiny_model_path("qwen2"),
            reward_func=reward,
            train_dataset=dataset,
            args=MARLHFIterConfig(num_iterations=2, **common),
        )
    else:
        trainer = MARLHFTrainer(
            agent_model=tiny_model_path("qwen2"),
            reward_func=reward,
            train_dataset=dataset,
            args=MARLHFConfig(**common),
        )
    memory, scoring, optimizers = [], [], []
    rl_stage = trainer._rl_stage
    reward_stage = trainer._train_reward_model

    def recording_reward_stage(*args, **kwargs):
        output = reward_stage(*args, **kwargs)
        scoring.append(trainer.learned_reward.scorer.score(TEXTS))
        gc.collect()
        optimizers.append(RecordingRewardTrainer.optimizers[-1]() is not None)
        return output

    trainer._train_reward_model = recording_reward_stage

    def recording_stage(*args, **kwargs):
        output = rl_stage(*args, **kwargs)
        memory.append(live_optimizer_state())
        return output

    trainer._rl_stage = recording_stage
    trainer.train()
    rl = trainer.rl_trainer
    print(
        "RESULT "
        + json.dumps(
            {
                "engines": [type(agent.model_wrapped).__name__ for agent in rl.agent_trainers],
                "engine_steps": [agent.model_wrapped.global_steps for agent in rl.agent_trainers],
                "reward_model": type(trainer.reward_model).__name__,
                "memory": memory,
                "reward_engines": RecordingRewardTrainer.engines,
                "trained_scores": RecordingRewardTrainer.scores,
                "scores": scoring,
                "training_optimizer_alive": optimizers,
                "reward_loss": [
                    r["reward_model/train_loss"] for r in trainer.log_history if "reward_model/train_loss" in r
                ],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "iter")
