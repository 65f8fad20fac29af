"""TRL helpers that are not TRL's public API, and transformers' private `save_model` keyword, behind functions of
ours.

`trl.trainer.utils` and `trl.models.utils` are TRL's internals: their names and signatures may change in any release.
The rest of the package calls the wrappers below, so a TRL or transformers upgrade is ported here
(`tests/test_trl_boundary.py` keeps every other deep TRL import and private keyword argument out of the package).
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from torch import nn
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import pad, selective_log_softmax


def pad_sequences(
    tensors: list[torch.Tensor], padding_value: int, padding_side: Literal["left", "right"]
) -> torch.Tensor:
    """Stack 1-D tensors into one `(len(tensors), longest)` tensor, each padded with `padding_value` on
    `padding_side` (TRL's `pad`)."""
    return pad(tensors, padding_value=padding_value, padding_side=padding_side)


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The log-probability of each of `token_ids` under `logits` (shape `(..., vocabulary)` -> `(...)`), without
    holding the whole log-softmax in memory (TRL's `selective_log_softmax`)."""
    return selective_log_softmax(logits, token_ids)


def gradient_checkpointing_disabled(
    model: nn.Module, gradient_checkpointing_kwargs: dict | None
) -> AbstractContextManager[None]:
    """A block in which `model` runs without gradient checkpointing; when it was on, it is enabled again after the
    block with `gradient_checkpointing_kwargs` (TRL's `disable_gradient_checkpointing`)."""
    return disable_gradient_checkpointing(model, gradient_checkpointing_kwargs)


def call_save_model(save_model: Callable[..., None], output_dir: str, internal_call: bool) -> None:
    """Call a `Trainer.save_model` (`trainer.save_model`, or `super().save_model` inside an override) on `output_dir`.

    `internal_call=True` marks a save made for a checkpoint, not by the user: transformers' private `_internal_call`
    keyword then skips the Hub upload that `push_to_hub=True` adds to a user's `save_model`. An override of
    `save_model` keeps accepting `_internal_call` (the Trainer passes it) and forwards it through here.
    """
    save_model(output_dir, _internal_call=internal_call)


def full_sdpa_attention(config: Any, backbone: nn.Module) -> bool:
    """Whether every layer of a transformers decoder (`backbone`, with its `config`) attends to all earlier tokens
    through transformers' SDPA attention: no sliding-window or other layer types, no other attention implementation."""
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
        and not getattr(backbone, "has_sliding_layers", False)
    )


def zero_partitioned(parameter: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned `parameter` (it marks such parameters with `ds_id`)."""
    return hasattr(parameter, "ds_id")


def zero_partition_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of `model`'s parameters that DeepSpeed ZeRO-3 partitioned, or None where it partitioned none."""
    return next((p.dtype for p in model.parameters() if zero_partitioned(p)), None)


def zero_sharded(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 shards `model`'s parameters (their values live in its partitions, not in `.data`)."""
    return zero_partition_dtype(model) is not None


@contextmanager
def attribute_replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """A block in which `owner.name` (a function or class that TRL or transformers looks up at call time, or a
    setting TRL reads) is `value`; the original is back after the block, also when it raises."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
