"""Three LoRA agents under DeepSpeed ZeRO-2 in one process (CPU): after every engine is prepared and has stepped, the
frozen base is one storage set, agent 0's, and only the adapters moved.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=2 torchrun --nproc_per_node 1 ...
"""

import json
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def reward(first, second, third, *, batch_items):
    return [len(c) / (1.0 + len(a) + len(b)) for a, b, c in zip(first, second, third)]


def frozen(model) -> dict:
    return {name: p for name, p in model.named_parameters() if not p.requires_grad}


def main(output_dir: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_agents=3,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=2,  # LoRA B starts at 0, so A moves from the second step on
        eval_interval=0,
        bf16=False,
        per_device_train_batch_size=2,
        steps_per_generation=1,
    )
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config, peft_config=peft
    )
    base_before = {name: p.detach().clone() for name, p in frozen(trainer.agents[0]).items()}
    adapters_before = [
        {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        for model in trainer.agents
    ]
    trainer.train()
    models = [agent.model_wrapped.module for agent in trainer.agent_trainers]
    storages = {}
    for model in models:
        for p in frozen(model).values():
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    first = frozen(models[0])
    shared = all(
        p.untyped_storage().data_ptr() == first[name].untyped_storage().data_ptr()
        for model in models[1:]
        for name, p in frozen(model).items()
    )
    moved = [
        all(not torch.equal(p, before[name]) for name, p in model.named_parameters() if p.requires_grad)
        for model, before in zip(models, adapters_before)
    ]
    base_moved = any(not torch.equal(first[name], value) for name, value in base_before.items())
    report = {
        "engines": [type(agent.model_wrapped).__name__ for agent in trainer.agent_trainers],
        "frozen_bytes": sum(storages.values()),
        "frozen_shared": shared,
        "adapters_moved": moved,
        "base_moved": base_moved,
    }
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
