"""One agent's TRL GRPO trainer, with the seams a joint-rollout orchestrator needs.

TRL's `GRPOTrainer._generate_and_score_completions` generates, scores, computes old/reference log-probs and
advantages, and logs. A multi-agent rollout must generate for *all* agents before any reward exists, so the
orchestrator runs each agent's real `_generate` first, computes joint rewards, then lets TRL score every agent
with the rollout and rewards handed in through `inject()`. Everything else (padding, masks after EOS, reference
KL with adapters disabled for LoRA, the clipped loss, metrics) stays TRL's own code.
"""

from contextlib import contextmanager

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from trl import GRPOTrainer

from ..prompt_length import PromptTruncationMixin


def joint_reward(prompts=None, completions=None, **kwargs):
    """Placeholder reward function of every agent trainer: rewards are joint and injected, never computed here.

    Its name labels TRL's per-agent reward metrics (`rewards/joint_reward/mean`).
    """
    raise RuntimeError("joint_reward is computed by the joint-rollout orchestrator and must never be called.")


# Hooks DeepSpeedEngine registers on its module that `engine.destroy()` (DeepSpeed 0.19) leaves in place.
_ENGINE_MODULE_HOOKS = ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check")


def release_accelerator(accelerator) -> None:
    """Free everything `accelerator` prepared (wrapped model, optimiser state, DeepSpeed engine) between trainings.

    `Accelerator.free_memory()` destroys a DeepSpeed engine, but DeepSpeed's `destroy()` leaves the engine's forward
    hooks on the module, and ZeRO-3 leaves a reference to its optimiser on every parameter: both keep the engine and
    its optimiser state alive as long as the model lives. They are removed first.
    """
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        for name in _ENGINE_MODULE_HOOKS:
            handle = getattr(wrapped.engine, name, None)
            if handle is not None:
                handle.remove()
                setattr(wrapped.engine, name, None)
        for param in wrapped.engine.module.parameters():
            if hasattr(param, "_z3_optimizer"):  # ZeRO-3's back-reference from every parameter to its optimiser
                del param._z3_optimizer
    accelerator.free_memory()


class AgentGRPOTrainer(PromptTruncationMixin, GRPOTrainer):
    """A `GRPOTrainer` for one agent of a team: generation, scoring and loss are TRL's; rewards come from outside."""

    # True for agents after the first: their Accelerator is not the first one of the process.
    _is_follower: bool = False
    _injected_rollout: tuple | None = None
    _injected_rewards: torch.Tensor | None = None

    def inject(self, rollout: tuple, rewards: torch.Tensor) -> None:
        """Hand in the next `_generate` output and the gathered `(B_global, 1)` rewards for the next scoring."""
        self._injected_rollout = rollout
        self._injected_rewards = rewards

    def _generate(self, prompts: list):
        rollout = self._injected_rollout
        if rollout is None:
            # Under the training precision: TRL runs the loss under bf16 autocast but generates in the weights' dtype,
            # which leaves bf16 matrix products (2-3x faster for generation on a bf16 CPU or GPU) unused.
            with self.accelerator.autocast(), _frozen_weights_cast_once(self.model, self.accelerator.device.type):
                return super()._generate(prompts)
        self._injected_rollout = None
        return rollout

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = self._injected_rewards
        if rewards is None:
            raise RuntimeError("Agent trainers score only joint rewards injected by the orchestrator.")
        self._injected_rewards = None
        return rewards

    def _prepare_inputs(self, generation_batch):
        # Agents other than the first receive ready, scored micro-batches from the orchestrator.
        if isinstance(generation_batch, dict):
            return generation_batch
        return super()._prepare_inputs(generation_batch)

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        # Accelerate refuses a DeepSpeed plugin on a second Accelerator; later agents reuse the active plugin.
        if self._is_follower and AcceleratorState._shared_state and (
            AcceleratorState().distributed_type == DistributedType.DEEPSPEED
        ):
            args["deepspeed_plugin"] = None
        return args


@contextmanager
def _frozen_weights_cast_once(model: torch.nn.Module, device_type: str):
    """While generating under autocast, let autocast cast frozen weights once instead of at every decoding step.

    Autocast keeps the low-precision copy of a weight for the whole autocast region only when the weight requires
    grad; frozen weights (the base model under LoRA) would be cast again at every token, which makes bf16 generation
    slower than fp32 on a CPU. Generation runs under `no_grad`, so marking them as requiring grad for its duration
    builds no graph; they are frozen again afterwards. Skipped when autocast is off or parameters are sharded.
    """
    frozen = []
    if torch.is_autocast_enabled(device_type) and not any(hasattr(p, "ds_id") for p in model.parameters()):
        frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


class FollowerGRPOTrainer(AgentGRPOTrainer):
    """The trainer of an agent after the first: driven by the team trainer's loop, never by its own `train()`."""

    _is_follower = True
