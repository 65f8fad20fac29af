"""Two-process MAGRPO with LoRA agents generating through one vLLM server (`vllm_mode="server"`).

Arguments: output_dir, the server's URL, the base model path the server serves. Every rank generates its own rows
through the server; rank 0 alone writes and loads each agent's new adapter, the other waits for it. After training,
rank 0 writes an empty adapter directory, so the server refuses the load: the failure must reach both ranks.
"""

import hashlib
import json
import os
import sys
import time

import requests
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig

from comlrl_trl.generation import TeamVLLMServer, vllm_server
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


GENERATED = []  # (agent, completions) of this rank, in call order
LOADS = []  # adapter names this rank loaded into the server


def reward(first, second):
    return [float(sum(map(ord, a + b)) % 7) for a, b in zip(first, second)]


def main(output_dir: str, url: str, model_path: str) -> None:
    generate, load = TeamVLLMServer.generate, TeamVLLMServer._request

    def recording_generate(self, agent_index, prompt_ids):
        completions, logprobs = generate(self, agent_index, prompt_ids)
        GENERATED.append((agent_index, completions))
        return completions, logprobs

    def recording_request(self, method, path, **kwargs):
        if path == "/v1/load_lora_adapter":
            LOADS.append(kwargs["json"]["lora_name"])
        return load(self, method, path, **kwargs)

    TeamVLLMServer.generate, TeamVLLMServer._request = recording_generate, recording_request
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    config = MAGRPOConfig(
        output_dir=output_dir,
        num_generations=4,
        max_new_tokens=6,
        learning_rate=0.1,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=2,
        per_device_train_batch_size=4,
        bf16=False,
        seed=0,
        use_vllm=True,
        steps_per_generation=1,  # one generation per step
        top_p=1.0,  # untruncated sampling: the importance-sampling correction is on
        top_k=0,
        vllm_mode="server",
        vllm_server_base_url=url,
    )
    trainer = MAGRPOTrainer(
        agent_model=model_path,
        reward_func=reward,
        train_dataset=dataset,
        args=config,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    digests = [
        hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters() if p.requires_grad)).hexdigest()
        for m in trainer.agents
    ]
    headers = {"Authorization": f"Bearer {os.environ['VLLM_API_KEY']}"}  # the server's key, as the trainer sends it
    served = sorted(m["id"] for m in requests.get(f"{url}/v1/models", headers=headers).json()["data"] if m["parent"])
    dist.barrier()  # both ranks have read what the server serves before rank 0 unloads for the failing load
    vllm_server._write_adapter = lambda model, path: os.makedirs(path)  # no files: the server refuses the load
    start = time.monotonic()
    try:
        trainer.generation_engines.sync(0, trainer.agents[0])
        failure = None
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
    failure_seconds = time.monotonic() - start
    mine = {"digests": digests, "generated": GENERATED, "loads": LOADS, "served": served}
    mine.update(failure=failure, failure_seconds=failure_seconds)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    trainer.generation_engines.close()
    dist.barrier()
    answer = requests.get(f"{url}/v1/models", headers=headers).json()
    served_after_close = [m["id"] for m in answer["data"] if m["parent"]]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": everyone, "served_after_close": served_after_close}))
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads stopped before exit (left running, a rank aborted at teardown)


if __name__ == "__main__":
    main(*sys.argv[1:4])
