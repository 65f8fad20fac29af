"""IAC value heads with a hidden layer on the actors under ZeRO-3 (one process, CPU): the engine partitions them,
and saving/restoring must go through the full (gathered) tensors.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=3 torchrun --nproc_per_node 1 ...
"""

import json
import os
import sys

import deepspeed
import torch
from datasets import Dataset

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer


def reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def gathered_state(head) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        return {name: p.detach().cpu().clone() for name, p in head.named_parameters()}  # as saved: on the CPU


def main(output_dir: str) -> None:
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    args = IACConfig(
        output_dir=output_dir,
        use_separate_critic=False,
        value_head_hidden_dim=32,
        per_device_train_batch_size=2,
        max_new_tokens=6,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        eval_interval=0,
        bf16=False,
    )
    trainer = IACTrainer(agent_model=tiny_model_path("qwen2"), reward_func=reward, train_dataset=dataset, args=args)
    trainer.train()
    heads = [agent.model.value_head for agent in trainer.agent_trainers]
    partitioned = [all(hasattr(p, "ds_id") for p in head.parameters()) for head in heads]
    trained = [gathered_state(head) for head in heads]
    export = os.path.join(output_dir, "export")
    trainer.save_model(export)
    saved = [torch.load(os.path.join(export, f"agent_{i}", "value_head.pt")) for i in range(len(heads))]
    saved_ok = [all(torch.equal(s[name], t[name]) for name in t) and set(s) == set(t) for s, t in zip(saved, trained)]
    for head in heads:  # overwrite the heads, then restore them from the export
        params = list(head.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            for p in params:
                p.data.fill_(7.0)
    trainer.critic_set.load(export)
    restored = [gathered_state(head) for head in heads]
    restored_ok = [all(torch.equal(r[name], t[name]) for name in t) for r, t in zip(restored, trained)]
    print(
        "RESULT "
        + json.dumps(
            {
                "partitioned": partitioned,
                "saved": saved_ok,
                "restored": restored_ok,
                "shapes": {name: list(t.shape) for name, t in saved[0].items()},
                "nonzero": [float(t["net.2.weight"].abs().sum()) > 0 for t in trained],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
