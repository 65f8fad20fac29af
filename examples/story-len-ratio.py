"""Length-ratio training with MAGRPO: the CoMLRL docs tutorial "长度比训练" (examples/story-len-ratio.py).

Two agents get the same prompt and generate independently; the shared reward is highest when the second response
has 2-3 times as many characters as the first. It does not judge story quality or semantic cooperation.

    python examples/story-len-ratio.py                      # tiny offline model, runs on a CPU
    python examples/story-len-ratio.py --model Qwen/Qwen2.5-0.5B --wandb
"""

import argparse
import math
from functools import partial

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_trl.models.demo import default_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl_trl.utils.reward_processor import RewardProcessors


def proper_length_ratio_reward(completions1, completions2, target_min=2.0, target_max=3.0):
    """1.0 when len(second) / len(first) lies in [target_min, target_max], else exp(-distance to that range)."""
    rewards = []
    for c1, c2 in zip(completions1, completions2):
        len1, len2 = len(c1), len(c2)
        if len1 == 0:
            rewards.append(0.0)
            continue
        ratio = len2 / len1
        distance = max(target_min - ratio, ratio - target_max, 0.0)  # 0 inside [target_min, target_max]
        rewards.append(float(math.exp(-distance)))
    return rewards


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="Model id or local path (default: the embedded SmolLM2 demo model if installed, else the tiny test model).",
    )
    parser.add_argument("--output-dir", default="./outputs/story-len-ratio")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--wandb", action="store_true", help="Log to Weights & Biases (off by default).")
    parser.add_argument("--wandb-project", default="comlrl")
    parser.add_argument("--wandb-entity", default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    model_name = args.model or default_model_path()
    output_dir = args.output_dir

    train_dataset = Dataset.from_dict(
        {
            "prompt": [
                "Describe a city in the clouds:",
                "Invent a new holiday and explain it:",
                "Write a bedtime story for a dragon:",
                "Explain how teleportation might work:",
                "Tell a joke about dinosaurs:",
                "Describe a world without electricity:",
                "Create a superhero with a unique power:",
                "Write a scene where the moon talks:",
                "Invent a new type of fruit:",
                "Design a playground on Mars:",
            ]
        }
    )

    # One tokenizer; each agent is its own model instance.
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    agents = [AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)]

    config = MAGRPOConfig(
        output_dir=output_dir,
        num_train_epochs=args.epochs,
        agent_learning_rate=args.learning_rate,
        logging_steps=10,
        num_generations=args.num_generations,
        num_turns=1,
        max_new_tokens=args.max_new_tokens,
    )
    wandb_config = (
        {
            "project": args.wandb_project,
            "entity": args.wandb_entity,
            "name": "story-len-ratio",
            "tags": ["length-ratio", "magrpo"],
        }
        if args.wandb
        else None
    )  # None: W&B disabled

    configured_reward_func = partial(proper_length_ratio_reward, target_min=2, target_max=3)
    trainer = MAGRPOTrainer(
        agents=agents,
        reward_func=configured_reward_func,
        reward_processor=RewardProcessors.scale(factor=100.0),
        args=config,
        train_dataset=train_dataset,
        tokenizer=tokenizer,
        wandb_config=wandb_config,
    )

    trainer.train()
    trainer.save_model(f"{output_dir}/models")
    print(f"Saved the trained agents to {output_dir}/models/agent_0 and {output_dir}/models/agent_1")


if __name__ == "__main__":
    main()
