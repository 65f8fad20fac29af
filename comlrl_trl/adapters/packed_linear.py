"""bf16 generation on a CPU with every linear layer's weight packed once per `generate` call.

A decoding step multiplies a few rows by every weight matrix of the model, so on a CPU it is bound by reading the
weights from memory. Under bf16 autocast, `F.linear` reads each bf16 weight (autocast's cached copy) in its stored
layout, and oneDNN rearranges it into the blocked layout its bf16 kernels read, at every step. Packing each weight
into that layout once for the whole call (`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with the packed
copy (`torch.ops.mkldnn._linear_pointwise`) runs the same kernels on the same bf16 values: on one thread the
outputs are equal to autocast's `F.linear` bit for bit (`tests/test_cpu_paths.py` checks layer shapes and whole
generations); on several, oneDNN may split a large product (a long prompt's rows) differently, a difference of
one bf16 rounding step. A SmolLM2-135M `generate` call (8 rows, 48 tokens) takes 3.78 instead of 4.31 CPU-s,
packing included.

Applies only without gradients (the packed copies are detached), where autocast runs in bf16 on the CPU and oneDNN
has bf16 kernels, and not to parameters DeepSpeed shards (their values live elsewhere) or to layers whose `forward`
something else has replaced already (Accelerate's offloading hooks). Where oneDNN refuses to pack (an instruction
set capped by `ONEDNN_MAX_CPU_ISA`), generation runs unpacked, with one warning. The packed copies (the bf16
weights, which autocast would cache anyway) are dropped when the call ends.
"""

import functools
import logging
from contextlib import contextmanager

import torch
from torch import nn

from .helpers import zero_sharded


logger = logging.getLogger(__name__)


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("Generating without packed bf16 weights: oneDNN cannot pack them here (%s).", reason)


def packing_applies(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can run packed here: no gradients, bf16 autocast on the CPU, oneDNN bf16 and
    no ZeRO shards."""
    return (
        not torch.is_grad_enabled()
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and not zero_sharded(model)
    )


class PackedLinear:
    """The forward of one `nn.Linear` with its weight packed for oneDNN's bf16 kernels."""

    def __init__(self, layer: nn.Linear, rows: int):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().to(torch.bfloat16), rows)
        self.bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            hidden.to(torch.bfloat16), self.weight, self.bias, "none", [None], ""
        )


@contextmanager
def packed_linear_weights(model: nn.Module, rows: int):
    """Run every `nn.Linear` of `model` with its weight packed (see the module docstring) inside the block.

    `rows` (the rows generated at once) helps oneDNN pick the layout. Does nothing where `packing_applies` is
    False. The layers' own `forward` is back afterwards, also after an error.
    """
    if not packing_applies(model):
        yield
        return
    layers = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m) and m.weight.numel()]
    try:
        packed = [PackedLinear(layer, rows) for layer in layers]
    except RuntimeError as error:  # oneDNN limited to an instruction set without bf16 (ONEDNN_MAX_CPU_ISA)
        _warn_once(str(error))
        yield
        return
    for layer, forward in zip(layers, packed):
        layer.forward = forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
