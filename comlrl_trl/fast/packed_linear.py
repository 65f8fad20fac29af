"""Generation on a CPU with every linear layer's weight packed once per `generate` call (bf16, or fp16 in fp32 runs).

A decoding step multiplies a few rows by every weight matrix of the model, so on a CPU it is bound by reading the
weights from memory. Under bf16 autocast, `F.linear` reads each bf16 weight (autocast's cached copy) in its stored
layout, and oneDNN rearranges it into the blocked layout its bf16 kernels read, at every step. Packing each weight
into that layout once for the whole call (`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with the packed
copy (`torch.ops.mkldnn._linear_pointwise`) runs the same kernels on the same bf16 values: on one thread the
outputs are equal to autocast's `F.linear` bit for bit (`tests/test_packed_linear.py` checks layer shapes and whole
generations); on several, oneDNN may split a large product (a long prompt's rows) differently, a difference of
one bf16 rounding step. A SmolLM2-135M `generate` call (8 rows, 48 tokens) takes 3.78 instead of 4.31 CPU-s,
packing included.

Applies only without gradients (the packed copies are detached), where autocast runs in bf16 on the CPU and oneDNN
has bf16 kernels, and not to parameters DeepSpeed shards (their values live elsewhere) or to layers whose `forward`
something else has replaced already (Accelerate's offloading hooks). Where oneDNN refuses to pack (an instruction
set capped by `ONEDNN_MAX_CPU_ISA`), generation runs unpacked, with one warning. The packed copies (the bf16
weights, which autocast would cache anyway) are dropped when the call ends.

fp32 generation on a CPU (no bf16 units, or `bf16=False`) reads fp32 weights, and MKL's fp32 product of a few rows
reads them at about a third of the memory bandwidth (a [8, 576] x [576, 1536] product: 0.86 ms, 4 GB/s, on an AVX2
EPYC). With `fp16_weights`, each linear layer's weight is rounded to fp16 once per call and multiplied by fbgemm's
fp16-weight kernel (`quantized::linear_dynamic_fp16`: fp32 activations, fp32 sums, fp16 weights read): 0.27 ms
there, and a SmolLM2-135M `generate` call's products take 2.6 instead of 5.6 CPU-s. This is not bit for bit: the
weights lose their last 13 mantissa bits (a relative rounding of at most 2**-11, where bf16 runs round to 2**-8), so
sampling follows a policy a rounding away from the trained one; the loss and the old log-probabilities stay fp32.
Frozen layers (a LoRA model's base) are packed once and kept while their weights are unchanged (an
fp16 copy of the base in memory). Trainable layers change at every update and are packed at every call, which pays
only for calls of at least `FP16_MIN_NEW_TOKENS` tokens: packing costs about 10 ns per weight, as much as 20
decoding steps of 8 rows save. Layers with fewer than `FP16_MIN_IN_FEATURES` inputs stay fp32: their products are
too small to gain (a tiny test model's 32-wide layers are 5x slower). So do layers with a weight beyond fp16's
range. Where fbgemm is missing (e.g. ARM CPUs), generation runs unpacked, with one warning.
"""

import functools
import logging
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from ..adapters.helpers import zero_sharded
from ..adapters.tensors import tensor_version


logger = logging.getLogger(__name__)


# Linear layers with fewer inputs than this stay fp32 with `fp16_weights`: fbgemm's fp16 kernel gains from 256
# inputs on (2-3x at 576 and 1536, 8 rows) and loses on tiny layers (5x slower at 32 inputs).
FP16_MIN_IN_FEATURES = 256
# Trainable layers are packed in fp16 only for calls that may decode at least this many tokens: packing SmolLM2-135M
# takes 1-2 CPU-s, and fp16 products save about 80 ms per decoding step of 8 rows (16 tokens: no gain).
FP16_MIN_NEW_TOKENS = 32


@functools.cache
def _warn_once(message: str, reason: str) -> None:
    logger.warning("%s (%s).", message, reason)


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


def fp16_packing_applies(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can run with fp16 weights here: no gradients, no autocast on the CPU and no
    ZeRO shards (the layers themselves must also hold fp32 CPU weights, `_fp16_packable`)."""
    return not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and not zero_sharded(model)


def _fp16_packable(layer: nn.Linear) -> bool:
    """A wide fp32 CPU layer (whether fp16 can hold its weights is checked when it is packed, `_fp16_copy`)."""
    weight = layer.weight
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and layer.in_features >= FP16_MIN_IN_FEATURES


class Fp16WeightLinear:
    """The forward of one fp32 `nn.Linear` with its weight rounded to fp16 and packed for fbgemm's kernel."""

    def __init__(self, layer: nn.Linear):
        bias = None if layer.bias is None else layer.bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(layer.weight.detach(), bias)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(hidden, self.packed)


def _fp16_copy(layer: nn.Linear) -> "Fp16WeightLinear | None":
    """`layer`'s fp16 copy, or None where a weight lies beyond fp16's range (+-65504, it would be clamped): the layer
    then stays fp32."""
    low, high = torch.aminmax(layer.weight.detach())  # one pass, no copy (abs() would copy every weight)
    limit = torch.finfo(torch.float16).max
    return Fp16WeightLinear(layer) if -limit <= low.item() and high.item() <= limit else None


# The fp16 copies of frozen layers (a LoRA model's base), kept across `generate` calls while their weights are
# unchanged: layer -> ((a weak reference to each of its weight and bias, with its version), the copy or None).
_frozen_fp16 = weakref.WeakKeyDictionary()


def _fp16_weights(layer: nn.Linear) -> "Fp16WeightLinear | None":
    """The fp16 copy of `layer` (`_fp16_copy`): made anew for trainable weights (they change at every update), and
    only once for frozen ones (packing SmolLM2-135M's layers takes 1-2 CPU-s, about a quarter of a 48-token call of
    8 rows). A frozen copy is made again when a weight or bias is another tensor or was changed in place (its
    version)."""
    if layer.weight.requires_grad:
        return _fp16_copy(layer)
    params = tuple(p for p in (layer.weight, layer.bias) if p is not None)
    cached = _frozen_fp16.get(layer)
    unchanged = (
        cached is not None
        and len(cached[0]) == len(params)
        and all(ref() is p and version == tensor_version(p) for (ref, version), p in zip(cached[0], params))
    )
    if not unchanged:
        state = tuple((weakref.ref(p), tensor_version(p)) for p in params)
        cached = _frozen_fp16[layer] = (state, _fp16_copy(layer))
    return cached[1]


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
def packed_linear_weights(model: nn.Module, rows: int, fp16_weights: bool = False, new_tokens: int | None = None):
    """Run every `nn.Linear` of `model` with its weight packed (see the module docstring) inside the block.

    Under bf16 autocast: oneDNN's bf16 layout, where `packing_applies`; `rows` (the rows generated at once) helps
    oneDNN pick it. Without autocast and with `fp16_weights`: fbgemm's fp16 weights, where `fp16_packing_applies`,
    for the layers `_fp16_packable` accepts; trainable ones only when the call may decode `new_tokens` >=
    `FP16_MIN_NEW_TOKENS` (None: unknown, packed). Otherwise it does nothing. The layers' own `forward` is back
    afterwards, also after an error.
    """
    candidates = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m) and m.weight.numel()]
    if packing_applies(model):
        pack = functools.partial(PackedLinear, rows=rows)
        failure = "Generating without packed bf16 weights: oneDNN cannot pack them here"
    elif fp16_weights and fp16_packing_applies(model):
        pack, failure = _fp16_weights, "Generating with fp32 weights: fbgemm cannot pack fp16 weights here"
        long_call = new_tokens is None or new_tokens >= FP16_MIN_NEW_TOKENS
        candidates = [m for m in candidates if _fp16_packable(m) and (long_call or not m.weight.requires_grad)]
    else:
        yield
        return
    try:
        packed = [pack(layer) for layer in candidates]
    except RuntimeError as error:  # oneDNN limited to an instruction set without bf16 (ONEDNN_MAX_CPU_ISA), no fbgemm
        _warn_once(failure, str(error))
        packed = []
    replaced = [(layer, forward) for layer, forward in zip(candidates, packed) if forward is not None]
    for layer, forward in replaced:
        layer.forward = forward
    try:
        yield
    finally:
        for layer, _ in replaced:
            del layer.forward
