"""Every family on two processes under DeepSpeed ZeRO-2/3 (gloo, CPU), with uneven work per rank.

Each run must finish (every process joins the same forwards and collectives) and end with the same weights on
both ranks: rank 0 prints a SHA-256 of every trained module (agents with their value heads, critics), per rank,
before and after training (and rank 0's parameter sums), and each critic's own DeepSpeed engine (its type, and
under ZeRO-3 the parameter elements rank 0 holds against the full count). Uneven work: rank 1's rewards all tie
(MAGRPO/IAC/MAAC advantages of zero, MADPO and MARLHF pairs only on rank 0), MADPO selects every pair on rank 0 (3
no-grad chunks against rank 1's one), sampled completion lengths differ per rank, and `magrpo_multi_turn` expands
every item into a second turn. `magrpo_lora` trains LoRA adapters (peft); every run also reports a SHA-256 of each
module's frozen parameters, before and after, and each module's trainable parameter count.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> torchrun --nproc_per_node 2 ...
          <output_dir> <family> [full|resume]
families: magrpo magrpo_lora magrpo_multi_turn iac maac marlhf marlhf_iter madpo resume resume_maac (the last
two: 2 epochs, a checkpoint per epoch; `resume` resumes from checkpoint-1)
"""

import hashlib
import json
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.preference import (
    MADPOConfig,
    MADPOTrainer,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterTrainer,
    MARLHFTrainer,
)
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def rank_reward(first, second):
    """Rank 1: every joint action ties. Rank 0: distinct rewards (the candidate's index plus a length term)."""
    if dist.get_rank() == 1:
        return [0.0] * len(first)
    return [float(i) + len(b) / (1.0 + len(a)) for i, (a, b) in enumerate(zip(first, second))]


def magrpo_reward(first, second, *, batch_items):
    return rank_reward(first, second)


def transition(
    prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent, batch_item
):
    return [f"Turn {len(response_history_per_agent[0])}: agent {a}, revise." for a in range(num_agents)]


def fingerprint(module, frozen: bool = False) -> tuple[str, float]:
    """SHA-256 and sum of the module's parameters (`frozen`: of those without gradients only), gathered first under
    ZeRO-3 (a collective: every rank calls it). The sum serves comparisons with a tolerance (GPU runs, whose kernels
    are not bit-reproducible by default)."""
    params = [p for p in module.parameters() if not (frozen and p.requires_grad)]
    with deepspeed.zero.GatheredParameters(params):
        digest, total = hashlib.sha256(), 0.0
        for p in params:
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
            total += p.detach().double().sum().item()
        return digest.hexdigest(), total


def build(family: str, output_dir: str):
    items = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(8)]})
    common = dict(
        output_dir=os.path.join(output_dir, "out"),
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
        bf16=False,
        seed=1,
    )
    path = tiny_model_path("qwen2")
    if family in ("magrpo", "magrpo_lora", "magrpo_multi_turn", "resume"):
        turns = dict(num_turns=2, external_transition=transition) if family == "magrpo_multi_turn" else {}
        transition_arg = turns.pop("external_transition", None)
        if family == "resume":
            common["num_train_epochs"] = 2
        config = MAGRPOConfig(num_generations=2, per_device_train_batch_size=4, **turns, **common)
        return MAGRPOTrainer(
            agent_model=path,
            reward_func=magrpo_reward,
            train_dataset=items,
            external_transition=transition_arg,
            args=config,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            if family == "magrpo_lora"
            else None,
        )
    if family == "iac":  # a separate critic per agent, each with its own optimiser
        return IACTrainer(
            agent_model=path,
            critic_model=path,
            reward_func=rank_reward,
            train_dataset=items,
            args=IACConfig(per_device_train_batch_size=2, use_separate_critic=True, **common),
        )
    if family in ("maac", "resume_maac"):
        if family == "resume_maac":
            common["num_train_epochs"] = 2
        return MAACTrainer(
            agent_model=path,
            critic_model=path,
            reward_func=rank_reward,
            train_dataset=items,
            args=MAACConfig(per_device_train_batch_size=2, **common),
        )
    if family == "madpo":  # rank 0: all C(4, 2) = 6 pairs per item; rank 1: ties only
        return MADPOTrainer(
            agent_model=path,
            reward_func=rank_reward,
            train_dataset=items,
            args=MADPOConfig(
                num_agents=2,
                preference_num_candidates=4,
                per_device_train_batch_size=4,
                pair_selection="all",
                preference_pairs_per_sample=None,
                **common,
            ),
        )
    preference = dict(
        num_agents=2,
        num_generations=2,
        per_device_train_batch_size=2,
        preference_num_candidates=4,
        pair_selection="all",
        preference_pairs_per_sample=None,
        reward_learning_rate=1e-3,
        reward_num_train_epochs=1,
        reward_train_batch_size=2,
        **common,
    )
    if family == "marlhf":
        return MARLHFTrainer(
            agent_model=path, reward_func=rank_reward, train_dataset=items, args=MARLHFConfig(**preference)
        )
    if family == "marlhf_iter":
        return MARLHFIterTrainer(
            agent_model=path,
            reward_func=rank_reward,
            train_dataset=items,
            args=MARLHFIterConfig(num_iterations=2, **preference),
        )
    raise ValueError(f"unknown family {family!r}")


def critic_engines(trainer) -> list[dict]:
    """Each critic with an optimiser of its own: its engine's type, whether ZeRO-3 partitions every parameter
    (`ds_id`), and the elements this rank holds against the full count (a ZeRO-3 rank holds about half)."""
    critic_set = getattr(trainer, "critic_set", None)
    report = []
    for engine in getattr(critic_set, "engines", []):
        params = list(engine.module.parameters())
        report.append(
            {
                "engine": type(engine).__name__,
                "partitioned": all(hasattr(p, "ds_id") for p in params),
                "local": sum(p.ds_tensor.numel() if hasattr(p, "ds_id") else p.numel() for p in params),
                "full": sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in params),
            }
        )
    return report


def modules(trainer) -> list:
    rl = getattr(trainer, "rl_trainer", trainer)  # MARLHF: the agents of its RL stage
    return [*rl.agents, *getattr(rl, "critics", [])]  # an actor's value head is one of its modules


def main(output_dir: str, family: str, mode: str = "full") -> None:
    trainer = build(family, output_dir)
    before = [fingerprint(m)[0] for m in modules(trainer)]
    frozen_before = [fingerprint(m, frozen=True)[0] for m in modules(trainer)]
    start = time.perf_counter()
    if family.startswith("resume"):
        checkpoints = os.path.join(output_dir, "ckpt")
        resume = os.path.join(checkpoints, "checkpoint-1") if mode == "resume" else None
        trainer.train(resume_from_checkpoint=resume, checkpoint_dir=checkpoints)
    else:
        trainer.train()
    seconds = time.perf_counter() - start
    after = [fingerprint(m) for m in modules(trainer)]
    frozen_after = [fingerprint(m, frozen=True)[0] for m in modules(trainer)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [digest for digest, _ in after])
    rl = getattr(trainer, "rl_trainer", trainer)
    if dist.get_rank() == 0:
        report = {
            "world": dist.get_world_size(),
            "before": before,
            "after": gathered,
            "sums": [total for _, total in after],
            "frozen": {"before": frozen_before, "after": frozen_after},
            "trainable": [
                sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in m.parameters() if p.requires_grad)
                for m in modules(trainer)
            ],
            "steps": rl.state.global_step,
            "engines": [type(agent.model_wrapped).__name__ for agent in rl.agent_trainers],
            "critic_engines": critic_engines(rl),
            "pairs": [r["preference/pairs"] for r in rl.state.log_history if "preference/pairs" in r],
            "train_seconds": round(seconds, 1),
        }
        print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
