"""TRL's chunked log-probability head (`trl.kernels.chunked_logprob.ChunkedLogProbFunction`) with a leaner CPU backward.

TRL's head projects the hidden states onto the vocabulary in tiles and, in its backward, turns each recomputed tile
into the logits' gradient and accumulates the two gradient products in fp32. On devices without Triton it folds the
tiles with torch operations that each allocate a new `[tokens, chunk]` fp32 tensor (a dozen per tile), zero-fills the
fp32 gradient of the whole vocabulary matrix (113 MB for SmolLM2) before adding the first product into it, and casts
the bf16 tile to fp32 twice (once per product). At the few hundred completion tokens of a CPU update that is about
as much time as the products themselves.

`CpuChunkedLogProb` keeps TRL's forward and its arithmetic on the logits: the same bf16 tile product, the same fp32
operations on it in the same order (`z = tile * inv_t`, `p = exp(z - log_z)`, `g * (1[target] - p)`, `* inv_t`) and
the same bf16 rounding of the gradient tile. The two gradient products differ in precision only: TRL multiplies the
bf16 operands as fp32 tensors; here they are multiplied as bf16, as autocast does in every other layer's backward,
with fp32 accumulation inside the product and its result rounded to bf16 before it is added to the fp32 gradient.
The products run 3x faster, which took this backward from 0.27 to 0.14 CPU-s for 192 SmolLM2 tokens (2-core Xeon
with AMX), and a gradient entry moves by at most bf16 rounding (`tests/test_cpu_logprob.py`). Under fp32 (no
autocast) the values are TRL's bit for bit, up to the sign of exact zeros (TRL adds its products to +0). The work
differs too: one fp32 buffer per tile updated in place, the target entries written once, the vocabulary gradient
written by its products instead of zeroed and added to, and each weight chunk cast once per backward instead of once
per token chunk and product.

Applies on a CPU without a bias, logit soft-capping or a gradient for the entropy; the rest is TRL's own backward.

`cpu_fused_head(model)` runs it, for one block and for `model` only: TRL's module is never changed (see there).
"""

import importlib
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE, ChunkedLogProbFunction
from trl.kernels.chunked_logprob import _use_triton as _trl_use_triton
from trl.trainer.utils import maybe_gather_lm_head_ctx

from ..loading import base_model


# Vocabulary rows per product of the weight's gradient: its output buffer (4.7 MB in bf16 for SmolLM2) is reused.
# A whole chunk's product (38 MB) would be a fresh allocation above glibc's mmap threshold, page-faulted at every
# backward.
_WEIGHT_BLOCK = 4096


_TRL_UTILS = importlib.import_module("trl.trainer.utils")
# The globals TRL's fused forward (`add_fused_lm_head`) reads at call time for its head: which positions it scores
# and the autograd function that scores them.
_HEAD_GLOBALS = {"_use_triton", "_ChunkedLogProbFunction"}


class CpuChunkedLogProb(ChunkedLogProbFunction):
    """`ChunkedLogProbFunction` whose CPU backward is in place (see the module docstring)."""

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):  # type: ignore[override]
        hidden, weight, bias, *_ = ctx.saved_tensors
        args = ctx.kernel_args
        if hidden.device.type != "cpu" or bias is not None or args["HAS_SOFTCAP"] or grad_entropy is not None:
            return ChunkedLogProbFunction.backward(ctx, grad_logprobs, grad_entropy)
        with maybe_gather_lm_head_ctx(weight):  # ZeRO-3: the full head for the backward, as TRL's backward does
            grad_hidden, grad_weight = _backward(ctx, grad_logprobs)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _backward(ctx, grad_logprobs: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    hidden, weight, _, targets, log_z, _ = ctx.saved_tensors
    needs_hidden, needs_weight = ctx.needs_input_grad[:2]
    compute_dtype, chunk_size = ctx.compute_dtype, ctx.chunk_size
    scale, inv_t = ctx.kernel_args["logit_scale"], ctx.kernel_args["inv_t"]
    N, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32) if needs_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=torch.float32) if needs_weight else None
    if grad_logprobs is None:  # no gradient reaches the head: TRL's zero gradients
        return (
            None if grad_hidden is None else grad_hidden.zero_().to(hidden.dtype),
            None if grad_weight is None else grad_weight.zero_().to(weight.dtype),
        )
    grad_logprobs = grad_logprobs.float()
    chunks = [(start, min(start + chunk_size, vocab)) for start in range(0, vocab, chunk_size)]
    w_chunks = [weight[start:end].to(compute_dtype) for start, end in chunks]
    tile_buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), chunk_size), dtype=compute_dtype)
    grad_buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), chunk_size), dtype=torch.float32)
    part_buf = torch.empty((min(chunk_size, _WEIGHT_BLOCK), hidden.shape[1]), dtype=compute_dtype)
    for token_start in range(0, N, TOKEN_CHUNK_SIZE):
        token_end = min(token_start + TOKEN_CHUNK_SIZE, N)
        n = token_end - token_start
        hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
        rows = slice(token_start, token_end)
        first_token_chunk = token_start == 0
        for i, (start, end) in enumerate(chunks):
            tile, grad = tile_buf[:n, : end - start], grad_buf[:n, : end - start]
            torch.mm(hidden_chunk, w_chunks[i].t(), out=tile)
            _logits_grad_(tile, grad, targets[rows], log_z[rows], grad_logprobs[rows], start, scale, inv_t)
            if grad_hidden is not None:
                part = torch.mm(tile, w_chunks[i])
                if i == 0:
                    grad_hidden[rows].copy_(part)
                else:
                    grad_hidden[rows].add_(part)
            if grad_weight is not None:
                for block in range(0, end - start, _WEIGHT_BLOCK):
                    stop = min(block + _WEIGHT_BLOCK, end - start)
                    part = torch.mm(tile[:, block:stop].t(), hidden_chunk, out=part_buf[: stop - block])
                    if first_token_chunk:
                        grad_weight[start + block : start + stop].copy_(part)
                    else:
                        grad_weight[start + block : start + stop].add_(part)
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        None if grad_weight is None else grad_weight.to(weight.dtype),
    )


def _logits_grad_(
    tile: torch.Tensor,
    grad: torch.Tensor,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    grad_logprobs: torch.Tensor,
    vocab_start: int,
    scale: float,
    inv_t: float,
) -> None:
    """Overwrite the bf16 logits `tile` with the gradient of `sum(grad_logprobs * log p[target])` with respect to it,
    using `grad` (fp32, the tile's shape) as the work space: TRL's `_backward_tile` without soft-capping or entropy,
    the same operations in the same order on the same values."""
    grad.copy_(tile)
    if scale != 1.0:
        grad.mul_(scale)
    if inv_t != 1.0:
        grad.mul_(inv_t)
    p = grad.sub_(log_z.unsqueeze(-1)).exp_()  # p_j
    local = targets - vocab_start
    rows = ((local >= 0) & (local < tile.shape[1])).nonzero().squeeze(-1)
    columns = local[rows]
    target_grad = grad_logprobs[rows] * (1.0 - p[rows, columns])  # g * (1 - p_target)
    p.mul_(grad_logprobs.neg().unsqueeze(-1))  # g * (0 - p_j) = -(g * p_j) = (-g) * p_j, exactly
    p.index_put_((rows, columns), target_grad)
    if inv_t != 1.0:
        p.mul_(inv_t)
    if scale != 1.0:
        p.mul_(scale)
    tile.copy_(p)


def _scores_completions_only(device: torch.device) -> bool:
    """TRL's `_use_triton` with CPUs added: its head then projects only the positions whose label is set.

    TRL projects every position, prompt included, on devices without Triton: devices that compile kernels (Neuron)
    would recompile for every new number of positions. A CPU compiles nothing, and there scoring the prompt too made
    the head, its backward and its fp32 gradient of the vocabulary matrix cost several times what the completions
    need. The values are TRL's up to the rounding of a matrix product over fewer rows; positions without a label get
    log-probability 0 and no gradient either way.
    """
    return device.type == "cpu" or _trl_use_triton(device)


def _trl_fused_function(module: nn.Module) -> types.FunctionType | None:
    """The function of TRL's fused forward installed on `module` by `add_fused_lm_head` (also under Accelerate's
    mixed-precision wrapper, which keeps TRL's bound method as `_original_forward`), or None."""
    for forward in (vars(module).get("_original_forward"), vars(module).get("forward")):
        function = getattr(forward, "__func__", None)
        if (
            isinstance(function, types.FunctionType)
            and function.__globals__ is vars(_TRL_UTILS)  # its name and module are the model's (`functools.wraps`)
            and function.__code__.co_name == "_fused_forward"
            and _HEAD_GLOBALS <= set(function.__code__.co_names)
        ):
            return function
    return None


def _with_cpu_head(function: types.FunctionType) -> types.FunctionType:
    """A copy of TRL's fused forward `function` (same code, closure and defaults) that reads `_use_triton` and
    `_ChunkedLogProbFunction` from its own globals: `_scores_completions_only` and `CpuChunkedLogProb`. TRL's module
    dictionary is copied at each call, so the copy sees whatever else TRL's module holds then."""
    own_globals = {**vars(_TRL_UTILS), "_use_triton": _scores_completions_only}
    own_globals["_ChunkedLogProbFunction"] = CpuChunkedLogProb
    copy = types.FunctionType(
        function.__code__, own_globals, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


@contextmanager
def cpu_fused_head(model: nn.Module | None) -> Iterator[None]:
    """A block in which `model`'s TRL fused log-probability head, on a CPU, scores the completion positions only
    (`_scores_completions_only`) with the in-place backward of `CpuChunkedLogProb` (TRL's values).

    Only `model` changes, and only for the block: the module carrying TRL's fused forward (`model`'s PEFT base model,
    or `model`) gets an instance `forward`, a copy of TRL's with those two globals of its own, and its previous
    instance `forward` back afterwards, also when the block raises. TRL's module (`trl.trainer.utils`) is not touched,
    so another thread, another agent's model and TRL's own trainers keep TRL's head. Under Accelerate's mixed
    precision the copy replaces Accelerate's wrapper for the block: TRL's log-probability forward already runs the
    model under `accelerator.autocast()`, and the head's outputs are fp32, which the wrapper's conversion leaves as
    they are. Nothing changes off a CPU, for `model=None`, or where TRL's fused forward is not found (then TRL's
    head runs as it is).
    """
    if isinstance(model, DistributedDataParallel):  # CPU runs of several processes (gloo)
        model = model.module
    module = None if model is None else base_model(model)
    function = None if module is None else _trl_fused_function(module)
    if function is None or module.get_output_embeddings().weight.device.type != "cpu":
        yield
        return
    missing = object()
    previous = vars(module).get("forward", missing)
    module.forward = types.MethodType(_with_cpu_head(function), module)
    try:
        yield
    finally:
        if previous is missing:
            del module.forward
        else:
            module.forward = previous
