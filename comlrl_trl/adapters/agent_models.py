"""The one place that loads an agent's model from a model id or path the way TRL's `GRPOTrainer` does (with TRL's
internal loader), for the callers that must load it before TRL does: `loading.shared_lora_bases`."""

from typing import Any

from transformers import PreTrainedModel
from trl.trainer.utils import create_model_from_path


def load_agent_model(source: str, args: Any) -> PreTrainedModel:
    """The model `GRPOTrainer(model=source, args=args)` would load: `args.model_init_kwargs` (TRL's default dtype
    float32 when it names none), `device_map=None` under DDP and DeepSpeed, and `args.trust_remote_code`."""
    return create_model_from_path(source, **agent_load_kwargs(args))


def agent_load_kwargs(args: Any) -> dict[str, Any]:
    """The `from_pretrained` keyword arguments TRL's `GRPOTrainer` derives from `args` for a model id or path."""
    kwargs = dict(args.model_init_kwargs or {})
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs
