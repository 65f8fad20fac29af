"""Two-process MAGRPO with two fully fine-tuned agents generating through vLLM in colocate mode.

Arguments: output_dir, the model path (a tiny Qwen2 that vLLM's CPU attention can run). Every process builds its own
engine (vLLM's `external_launcher`) and generates its own rows, each agent's weights loaded before it generates.
"""

import hashlib
import json
import sys

import torch.distributed as dist
from datasets import Dataset

from comlrl_trl.generation import TeamVLLM
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


GENERATED = []  # (agent, completions) of this rank, in call order
RATIOS = [f"agent_{a}/sampling/importance_sampling_ratio/mean" for a in range(2)]  # TRL's logged mean ratios


def reward(first, second):
    return [float(sum(map(ord, a + b)) % 7) for a, b in zip(first, second)]


def main(output_dir: str, model_path: str) -> None:
    generate = TeamVLLM.generate

    def recording_generate(self, agent_index, prompt_ids):
        completions, logprobs = generate(self, agent_index, prompt_ids)
        GENERATED.append((agent_index, completions))
        return completions, logprobs

    TeamVLLM.generate = recording_generate
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.01,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=2,
        per_device_train_batch_size=2,
        bf16=False,
        seed=0,
        use_vllm=True,
        steps_per_generation=1,  # one generation per step
        top_p=1.0,  # untruncated sampling: the importance-sampling correction is on
        top_k=0,
    )
    trainer = MAGRPOTrainer(agent_model=model_path, reward_func=reward, train_dataset=dataset, args=config)
    engine = trainer.generation_engines
    before = [_digest(model) for model in trainer.agents]
    trainer.train()
    mine = {
        "before": before,
        "after": [_digest(model) for model in trainer.agents],
        "generated": GENERATED,
        "weight_groups": engine.weight_groups,
        "weight_loads": engine.weight_loads,
        "ratios": [log[key] for log in trainer.state.log_history for key in RATIOS if key in log],
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    engine.close()
    dist.barrier()  # torch's process group outlives the engine
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": everyone}))


def _digest(model) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    if dist.is_initialized():  # before Python's shutdown, which can abort (SIGABRT) with Gloo's threads busy
        dist.barrier()  # every rank done with its collectives before any tears Gloo down
        dist.destroy_process_group()
