"""Multi-turn coding with test feedback: MAGRPO trains a helper agent and a main agent (examples/code-feedback.py).

Agent 0 writes a helper function `aux`, agent 1 writes the problem's main function, which calls it. The joint
program runs the problem's tests in a sandboxed subprocess (comlrl_trl.tasks.sandbox); the reward is the
fraction of tests passed plus a small structure bonus. After each turn both agents see the failing tests and
each other's code, and revise (comlrl_trl.tasks.code_feedback). Evaluation metrics are printed for every turn
before and after training.

    python examples/code-feedback.py                        # tiny offline model, runs on a CPU
    python examples/code-feedback.py --model Qwen/Qwen2.5-Coder-0.5B-Instruct --max-new-tokens 256
"""

import argparse

from comlrl_trl.models.demo import default_model_path
from comlrl_trl.tasks import code_feedback as task
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="Model id or local path (default: the embedded SmolLM2 demo model if installed, else the tiny test model).",
    )
    parser.add_argument("--output-dir", default="./outputs/code-feedback")
    parser.add_argument("--num-turns", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1, help="Stop after this many optimiser steps (-1: epochs).")
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    return parser.parse_args()


def print_metrics(title: str, metrics: dict[str, float], num_turns: int) -> None:
    print(f"{title}:")
    for turn in range(1, num_turns + 1):
        values = {key.split("/")[-1]: value for key, value in metrics.items() if key.startswith(f"eval/turn_{turn}/")}
        print(f"  turn {turn}: " + ", ".join(f"{name}={value:.3f}" for name, value in sorted(values.items())))


def main() -> None:
    args = parse_args()
    model = args.model or default_model_path()
    eval_dataset = task.build_dataset("eval")
    config = MAGRPOConfig(
        output_dir=args.output_dir,
        num_agents=2,
        num_turns=args.num_turns,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        logging_steps=10,
        eval_interval=0,  # evaluate only before and after training, below
        eval_num_samples=len(eval_dataset),
        report_to="none",
    )
    trainer = MAGRPOTrainer(
        agent_model=model,
        num_agents=2,
        formatters=task.formatters(),
        reward_func=task.reward,
        external_transition=task.transition,
        train_dataset=task.build_dataset("train"),
        eval_dataset=eval_dataset,
        eval_logger=task.eval_logger,
        eval_aggregator=task.eval_aggregator,
        args=config,
    )
    print_metrics("Evaluation before training", trainer.evaluate(), args.num_turns)
    trainer.train()
    print_metrics("Evaluation after training", trainer.evaluate(), args.num_turns)
    trainer.save_model(f"{args.output_dir}/models")
    print(f"Saved the trained agents to {args.output_dir}/models/agent_0 and {args.output_dir}/models/agent_1")


if __name__ == "__main__":
    main()
