"""Loading a critic backbone in the precision and the layout it trains in.

Without ZeRO-3 every process holds the whole critic: it is loaded in fp32 when all of it trains (the critic's own
AdamW steps fp32 master weights; bf16 comes from autocast or the DeepSpeed engine), so nothing is cast after loading.
Under ZeRO-3 it is loaded while transformers' DeepSpeed config is live, so `from_pretrained` creates it inside
`deepspeed.zero.Init`, as it creates the agents: each process holds its partition of every weight from the start, in
the engine's precision (DeepSpeed keeps the fp32 master weights, partitioned too), and never the whole critic.
"""

import os
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ...adapters.helpers import zero_partition_dtype, zero_partitioned
from ...loading import load_causal_lm
from ...value_models import fp32_trainable


def critic_load_kwargs(critic_kwargs: dict[str, Any], source, peft_config, zero3: bool, bf16: bool) -> dict[str, Any]:
    """`from_pretrained`'s settings for a critic: `critic_kwargs` with the dtype it trains in.

    Under ZeRO-3: the engine's (bf16 with `bf16=True`, else fp32), which `zero.Init` stores the partitions in. Else,
    a critic that trains whole (no LoRA, not a saved adapter): fp32. A LoRA critic keeps the dtype asked for: its
    frozen base stays in it, and PEFT makes the adapters fp32.
    """
    kwargs = {key: value for key, value in critic_kwargs.items() if key not in ("dtype", "torch_dtype")}
    if zero3:
        return {**kwargs, "dtype": torch.bfloat16 if bf16 else torch.float32}
    if peft_config is None and load_saved_adapter_dir(source) is None:
        return {**kwargs, "dtype": torch.float32}
    return dict(critic_kwargs)


def load_saved_adapter_dir(source) -> str | None:
    """`source` when it is a local directory holding a PEFT adapter (from `save_model` with LoRA), else None."""
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(os.path.join(source, "adapter_config.json")):
        return os.fspath(source)
    return None


def load_critic_backbone(source, model_kwargs: dict[str, Any], label: str, deepspeed_plugin=None) -> nn.Module:
    """A critic backbone from a model id, a directory (full weights or a PEFT adapter) or a model object.

    With the ZeRO-3 `deepspeed_plugin` of the run, an id or directory is loaded partitioned (`zero.Init`); a model
    object stays as given (DeepSpeed partitions it when the critic's engine is built). Otherwise it is loaded whole.
    """
    if deepspeed_plugin is None:
        return load_causal_lm(source, model_kwargs, label)
    return load_causal_lm(source, model_kwargs, label, weights=lambda: zero3_config_live(deepspeed_plugin))


@contextmanager
def zero3_config_live(deepspeed_plugin):
    """A block in which transformers sees the run's ZeRO-3 config (`is_deepspeed_zero3_enabled()`), so that
    `from_pretrained` partitions what it creates. Accelerate makes it live when the agents load; where it is not
    (`zero3_init_flag: false`), it is made live from `deepspeed_plugin` for the block only and the previous state is
    restored after it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    if hf_deepspeed.is_deepspeed_zero3_enabled():
        yield
        return
    reference = hf_deepspeed._hf_deepspeed_config_weak_ref
    deepspeed_plugin.set_deepspeed_weakref()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = reference


def place_critic(model: nn.Module, device) -> nn.Module:
    """A critic held whole: fp32 trainable weights on `device`. One that ZeRO-3 partitioned as it loaded stays as
    `zero.Init` placed it (its partitions on the device, in the engine's precision); what was added after loading
    (LoRA adapters) takes that precision too, since DeepSpeed's optimiser takes one dtype per partition."""
    partition_dtype = zero_partition_dtype(model)
    if partition_dtype is not None:
        for p in model.parameters():
            if not zero_partitioned(p):
                p.data = p.data.to(partition_dtype)
        return model
    fp32_trainable(model)  # a model object given in bf16: the critic's own AdamW steps fp32 master weights
    return model.to(device)
