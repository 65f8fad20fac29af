"""Two-agent MAGRPO under DeepSpeed in one process (CPU): one engine per agent, every agent trains.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=<2|3> torchrun --nproc_per_node 1 ...
Optional argument `lora` trains LoRA adapters.
"""

import json
import sys

from datasets import Dataset
from peft import LoraConfig

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def reward(first, second, *, batch_items):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def main(output_dir: str, lora: bool) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
        bf16=False,
        per_device_train_batch_size=2,
        steps_per_generation=1,  # one generation and one log (with its gradient norms) per step
    )
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if lora else None
    trainer = MAGRPOTrainer(
        agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=config, peft_config=peft
    )
    trainer.train()
    engines = [type(agent.model_wrapped).__name__ for agent in trainer.agent_trainers]
    engine_steps = [agent.model_wrapped.global_steps for agent in trainer.agent_trainers]
    losses = [
        [row[f"agent_{i}/grad_norm"] for row in trainer.state.log_history if f"agent_{i}/grad_norm" in row]
        for i in range(2)
    ]
    print(
        "RESULT "
        + json.dumps(
            {
                "engines": engines,
                "steps": trainer.state.global_step,
                "grad_norms": losses,
                "engine_steps": engine_steps,
                "env_step": trainer.env_step,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "lora")
