"""MARLHF on two processes (gloo DDP): the reward model's metrics score every gathered preference pair once across
the ranks, each rank its share, instead of all pairs on every rank. Rank 0 prints how many texts each rank scored
for the metrics, the number of pairs, the logged metrics of both ranks, and the metrics recomputed from scores of
all texts on one rank."""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.preference import MARLHFConfig, MARLHFTrainer
from comlrl_trl.trainers.preference.reward_model import RewardModelScorer


def reward(first, second):
    return [float(i) + len(b) / (1.0 + len(a)) for i, (a, b) in enumerate(zip(first, second))]


def main(root: str) -> None:
    items = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(6)]})
    config = MARLHFConfig(
        output_dir=f"{root}/out",
        num_agents=2,
        num_generations=2,
        per_device_train_batch_size=2,
        preference_num_candidates=3,
        pair_selection="all",
        preference_pairs_per_sample=None,
        reward_learning_rate=1e-3,
        reward_num_train_epochs=1,
        reward_train_batch_size=2,
        max_new_tokens=4,
        learning_rate=0.05,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        max_steps=1,
        eval_interval=0,
        bf16=False,
        seed=1,
    )
    trainer = MARLHFTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=items, args=config)
    counted, in_metrics = [], [False]
    score = RewardModelScorer.score

    def counting_score(self, texts):
        if in_metrics[0]:
            counted.append(len(texts))
        return score(self, texts)

    metrics = trainer._reward_model_metrics

    def counting_metrics(pairs):
        in_metrics[0] = True
        try:
            return metrics(pairs)
        finally:
            in_metrics[0] = False

    RewardModelScorer.score = counting_score
    trainer._reward_model_metrics = counting_metrics
    trainer.train()
    logged = next(entry for entry in trainer.log_history if "reward_model/accuracy" in entry)
    pairs = trainer.preference_pairs
    scorer = trainer.learned_reward.scorer
    chosen = torch.tensor(score(scorer, [trainer.joint_formatter(p.prompts, p.chosen) for p in pairs]))
    rejected = torch.tensor(score(scorer, [trainer.joint_formatter(p.prompts, p.rejected) for p in pairs]))
    alone = {
        "reward_model/accuracy": (chosen > rejected).float().mean().item(),
        "reward_model/margin": (chosen - rejected).mean().item(),
        "reward_model/loss": F.softplus(-(chosen - rejected)).mean().item(),
    }
    report = {
        "texts": sum(counted),
        "pairs": len(pairs),
        "logged": {key: logged[key] for key in alone},
        "alone": alone,
    }
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
