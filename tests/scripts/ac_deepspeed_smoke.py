"""IAC with heads on the actors, and MAAC (its critic in a DeepSpeed engine of its own), under DeepSpeed in one
process (CPU): heads and critics train.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> torchrun --nproc_per_node 1 ...
"""

import json
import sys

import deepspeed
from datasets import Dataset
from peft import LoraConfig

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer


BF16 = len(sys.argv) > 2 and sys.argv[2] == "bf16"


def reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def head_weights(trainer) -> list[float]:
    heads = [critic.value_head for critic in trainer.critics] or [model.value_head for model in trainer.agents]
    weights = []
    for head in heads:
        params = list(head.parameters())
        with deepspeed.zero.GatheredParameters(params):
            weights.append(sum(p.detach().abs().sum().item() for p in params))
    return weights


def main(output_dir: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    common = dict(
        per_device_train_batch_size=2,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
        bf16=BF16,  # bf16: DeepSpeed keeps ZeRO-Init weights in bf16
    )
    path = tiny_model_path("qwen2")
    iac = IACTrainer(
        agent_model=path,
        reward_func=reward,
        train_dataset=dataset,
        args=IACConfig(output_dir=f"{output_dir}/iac", use_separate_critic=False, **common),
    )
    iac.train()
    maac = MAACTrainer(
        agent_model=path,
        critic_model=path,
        reward_func=reward,
        train_dataset=dataset,
        args=MAACConfig(output_dir=f"{output_dir}/maac", **common),
    )
    maac.train()
    lora_iac = None
    if BF16:  # LoRA adapters and heads beside the bf16 partitioned base: the usual ZeRO-3 setup on GPUs
        lora_iac = IACTrainer(
            agent_model=path,
            reward_func=reward,
            train_dataset=dataset,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
            args=IACConfig(output_dir=f"{output_dir}/iac-lora", use_separate_critic=False, **common),
        )
        lora_iac.train()
    print(
        "RESULT "
        + json.dumps(
            {
                "engines": [
                    type(agent.model_wrapped).__name__ for trainer in (iac, maac) for agent in trainer.agent_trainers
                ],
                "steps": [iac.state.global_step, maac.state.global_step],
                "critic_engines": [type(engine).__name__ for engine in maac.critic_set.engines],
                "heads": head_weights(iac) + head_weights(maac),  # zero at initialisation
                "lora_heads": head_weights(lora_iac) if lora_iac else [],
                "lora_steps": lora_iac.state.global_step if lora_iac else 0,
                "value_losses": [
                    len([r for r in t.state.log_history if key in r])
                    for t, key in ((iac, "agent_1/value_loss"), (maac, "critic/value_loss"))
                ],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
