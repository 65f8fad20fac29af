"""The critic weights each process holds while IAC (two separate critics) and MAAC (one joint critic, also with
LoRA) are built under ZeRO-3 on two processes (gloo, CPU), in bf16; then one training step of each.

Every `from_pretrained` that runs while the critics are built is measured right after it returns, and every critic
right after its value head is attached: the bytes of critic weights this process holds (a ZeRO-3 partitioned
parameter holds its partition in `ds_tensor` and an empty tensor; any other parameter its whole tensor), summed over
every critic loaded so far and still alive, against the full bytes of those critics. Each rank prints its peak.

Run with: ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=3 torchrun --nproc_per_node 2 ... <output_dir>
"""

import json
import sys
import weakref

import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from comlrl_trl.testing import tiny_model_path
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.value_models import CausalLMWithValueHead


def reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def held_and_full(model) -> tuple[int, int, int]:
    """(bytes this process holds, bytes of the whole model, parameter tensors) of `model`'s parameters."""
    held = full = tensors = 0
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p
        held += local.numel() * local.element_size()
        full += (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) * p.element_size()
        tensors += 1
    return held, full, tensors


class Meter:
    """Measures the critic models alive while a trainer's `_build_critics` runs."""

    def __init__(self):
        self.active = False
        self.alive: list[weakref.ref] = []
        self.peak = {"held": 0, "full": 0, "tensors": 0}
        self.dtypes: set[str] = set()
        self.loads = 0

    def track(self, model) -> None:
        if self.active:
            self.alive.append(weakref.ref(model))
            self.measure()

    def measure(self) -> None:
        models = [ref() for ref in self.alive if ref() is not None]
        models = [m for m in models if not any(m is not o and _contains(o, m) for o in models)]  # count each once
        held, full, tensors = (sum(values) for values in zip(*(held_and_full(m) for m in models)))
        if held > self.peak["held"]:
            self.peak = {"held": held, "full": full, "tensors": tensors}
        self.dtypes |= {str(p.dtype) for m in models for p in m.parameters()}


def _contains(outer, inner) -> bool:
    return any(module is inner for module in outer.modules())


METER = Meter()


def install() -> None:
    original_load = AutoModelForCausalLM.from_pretrained.__func__
    original_head = CausalLMWithValueHead.__init__

    def from_pretrained(cls, *args, **kwargs):
        model = original_load(cls, *args, **kwargs)
        if METER.active:
            METER.loads += 1
        METER.track(model)
        return model

    def with_head(self, *args, **kwargs):
        original_head(self, *args, **kwargs)
        METER.track(self)

    def measured(build):
        def measured_build(self, *args, **kwargs):
            METER.active = True
            try:
                return build(self, *args, **kwargs)
            finally:
                METER.active = False

        return measured_build

    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)
    CausalLMWithValueHead.__init__ = with_head
    for trainer_cls in (IACTrainer, MAACTrainer):
        trainer_cls._build_critics = measured(trainer_cls._build_critics)


def main(output_dir: str) -> None:
    install()
    dataset = Dataset.from_dict({"prompt": [f"Item {i}: tell me something" for i in range(4)]})
    common = dict(
        per_device_train_batch_size=2,
        max_new_tokens=4,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=1,
        eval_interval=0,
        bf16=True,
    )
    path = tiny_model_path("qwen2")
    runs = {}
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    for name, trainer_cls, config, critic_lora in (
        ("iac", IACTrainer, IACConfig(output_dir=f"{output_dir}/iac", use_separate_critic=True, **common), None),
        ("maac", MAACTrainer, MAACConfig(output_dir=f"{output_dir}/maac", **common), None),
        ("maac_lora", MAACTrainer, MAACConfig(output_dir=f"{output_dir}/maac-lora", **common), lora),
    ):
        METER.__init__()
        trainer = trainer_cls(
            agent_model=path,
            critic_model=path,
            reward_func=reward,
            train_dataset=dataset,
            args=config,
            critic_peft_config=critic_lora,
        )
        built = [held_and_full(critic) for critic in trainer.critics]
        trainer.train()
        runs[name] = {
            "peak": METER.peak,
            "loads": METER.loads,
            "dtypes": sorted(METER.dtypes),
            "built": built,
            "steps": trainer.state.global_step,
        }
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, runs)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"world": dist.get_world_size(), "ranks": reports}))


if __name__ == "__main__":
    main(sys.argv[1])
