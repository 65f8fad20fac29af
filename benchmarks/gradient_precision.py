"""How far bf16 autocast moves the tutorial's policy gradient, element by element.

    python benchmarks/gradient_precision.py                 # SmolLM2, the tutorial's first prompt, 4 completions
    python benchmarks/gradient_precision.py --json out.json

AdamW's first step moves every weight by the learning rate in the direction of its gradient's sign, however small
the gradient, so a precision that flips the sign of many small gradients would add noise that a cosine over the whole
gradient hides. This script samples K=4 completions of 48 tokens for one prompt (fp32, the tutorial's sampling: T 0.6,
top-p 0.6, top-k 50), computes the token-mean policy gradient with fixed advantages in fp32 and under bf16 autocast,
and prints, for each pair of gradients: the cosine, and the share of elements whose signs agree, for all elements and
for the halves below and above the median magnitude. For scale, the same fp32 gradient on every other completion
token (another batch of the same policy) is compared with the full one. Two advantage sets: group-normalised (summing
to zero, so the gradient is a small difference of large terms) and all positive.

    python benchmarks/gradient_precision.py --trainer       # the trainer's own loss path, three updates' batches

`--trainer` compares the gradients our trainer itself computes: two tutorial teams (two agents, the length-ratio
reward, two task items per on-policy update), one with `bf16=True` (the defaults' autocast path: packed shared
prompts, the CPU log-probability head) and one with `bf16=False`, the same weights. The bf16 team samples and scores
each update's batch; every agent's micro-batch then runs through both teams' `train_micro_batch`, and each pair of
gradients is compared as above.
"""

import argparse
import json
import sys
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Advantages of the K completions: a group-normalised set (summing to zero) and an all-positive one.
ADVANTAGES = {"group-normalised (sum 0)": [1.3, -0.2, -1.1, 0.0], "all positive": [1.0, 1.0, 1.0, 1.0]}
K = 4


def policy_gradient(model, sequences, prompt_length, advantages, token_mask, bf16, temperature=0.6):
    """The gradient of -mean_t(A * log pi_T(y_t)) over the masked completion tokens: every parameter's, flattened
    into one float64 vector."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(sequences).logits[:, prompt_length - 1 : -1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_length:, None]).squeeze(-1)
    loss = -(torch.tensor(advantages)[:, None] * logps * token_mask).sum() / token_mask.sum()
    loss.backward()
    return torch.cat([p.grad.detach().flatten().double() for p in model.parameters() if p.grad is not None])


def agreement(gradient, reference) -> dict:
    """Cosine and sign agreement of `gradient` with `reference`, overall and by the reference's magnitude."""
    nonzero = (gradient != 0) | (reference != 0)
    same = torch.sign(gradient[nonzero]) == torch.sign(reference[nonzero])
    magnitude = reference[nonzero].abs()
    small = magnitude <= magnitude.median()
    return {
        "cosine": torch.nn.functional.cosine_similarity(gradient, reference, dim=0).item(),
        "sign agreement": same.double().mean().item(),
        "sign agreement, smaller half": same[small].double().mean().item(),
        "sign agreement, larger half": same[~small].double().mean().item(),
    }


def trainer_gradients(tokens: int, updates: int) -> dict:
    """`--trainer`: per update and agent, the bf16 team's gradient of one micro-batch against the fp32 team's."""
    from functools import partial

    from datasets import Dataset
    from learning_task import TRAIN_PROMPTS, length_ratio_reward
    from learning_worker import load_team

    from comlrl_trl.models.demo import demo_model_path
    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl_trl.utils.reward_processor import RewardProcessors

    def team(bf16: bool):
        tokenizer, agents = load_team(demo_model_path())  # the learning runs' team: two fp32 agents
        config = MAGRPOConfig(
            output_dir="/tmp/comlrl-trl-gradient-precision",
            num_turns=1,
            num_generations=K,
            max_new_tokens=tokens,
            agent_learning_rate=5e-5,
            per_device_train_batch_size=2 * K,
            steps_per_generation=1,
            bf16=bf16,
            report_to="none",
        )
        return MAGRPOTrainer(
            agents=agents,
            reward_func=partial(length_ratio_reward, target_min=2, target_max=3),
            reward_processor=RewardProcessors.scale(factor=100.0),
            args=config,
            tokenizer=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": TRAIN_PROMPTS}),
        )

    teams = {"bf16": team(True), "fp32": team(False)}
    results = {}
    for update in range(updates):
        rows = [{"prompt": prompt} for prompt in TRAIN_PROMPTS[2 * update : 2 * update + 2] for _ in range(K)]
        rollout = teams["bf16"].orchestrator.rollout(rows, first_item_index=2 * update)
        for a, (batch, advantages) in enumerate(zip(rollout.agent_batches, rollout.agent_advantages)):
            gradients = {}
            for name, trainer in teams.items():
                agent = trainer.agent_trainers[a]
                agent.fill_micro_batches(dict(batch), advantages)
                agent.current_gradient_accumulation_steps = 1
                agent.model.zero_grad(set_to_none=True)
                agent.train_micro_batch(0, sync_gradients=True)
                gradients[name] = torch.cat(
                    [p.grad.flatten().double() for p in agent.model.parameters() if p.grad is not None]
                )
            results[f"trainer, update {update + 1}, agent {a}: bf16 against fp32"] = agreement(
                gradients["bf16"], gradients["fp32"]
            )
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--trainer", action="store_true", help="compare the trainer's own gradients (see above)")
    parser.add_argument("--updates", type=int, default=3, help="--trainer: updates' batches compared")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.trainer:
        report(trainer_gradients(args.tokens, args.updates), args, mode="trainer")
        return

    from learning_task import TRAIN_PROMPTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl_trl.models.demo import demo_model_path

    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = tokenizer(TRAIN_PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        sequences = model.generate(
            **prompt,
            do_sample=True,
            temperature=0.6,
            top_p=0.6,
            top_k=50,
            max_new_tokens=args.tokens,
            num_return_sequences=K,
            pad_token_id=tokenizer.eos_token_id,
        )
    prompt_length = prompt["input_ids"].shape[1]
    every_token = torch.ones(sequences[:, prompt_length:].shape)
    every_other_token = every_token.clone()
    every_other_token[:, ::2] = 0

    results = {}
    for name, advantages in ADVANTAGES.items():
        fp32 = policy_gradient(model, sequences, prompt_length, advantages, every_token, bf16=False)
        results[f"{name}: bf16 against fp32"] = agreement(
            policy_gradient(model, sequences, prompt_length, advantages, every_token, bf16=True), fp32
        )
        results[f"{name}: fp32 on every other token against fp32 on all"] = agreement(
            policy_gradient(model, sequences, prompt_length, advantages, every_other_token, bf16=False), fp32
        )

    report(results, args, mode="model")


def report(results: dict, args, mode: str) -> None:
    print(f"{'gradients compared':<70} {'cosine':>8} {'signs agree':>12} {'small half':>11} {'large half':>11}")
    for name, r in results.items():
        print(
            f"{name:<70} {r['cosine']:>8.4f} {r['sign agreement']:>12.4f} "
            f"{r['sign agreement, smaller half']:>11.4f} {r['sign agreement, larger half']:>11.4f}"
        )
    if args.json:
        summary = {"mode": mode, "k": K, "tokens": args.tokens, "results": results}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
