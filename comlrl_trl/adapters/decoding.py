"""The decoding steps of Llama and Qwen2 models with less Python around the same tensor operations, on a CPU.

A decoding step of transformers' `generate` runs one token per row through every layer. For a small model on a CPU
the tensor work is small and much of a step is Python: per layer, a dozen module calls (each through
`nn.Module.__call__` and its hook checks), the decorators and keyword plumbing of the layer and attention modules,
and the output containers (SmolLM2-135M: 30 layers, 8 rows, about 46 ms per step of which the linear layers are 26).

`lean_decoding(model)` replaces `model.forward` while `generate` runs. A decoding step (one new token per row, on a
`DynamicCache` that holds the prompt) calls the model's own functions and modules' `forward` methods in the order
its forward calls them: the embedding, `create_causal_mask`, the rotary embedding, per layer the norm, the
projections, the model's `apply_rotary_pos_emb`, the cache's `update`, transformers' SDPA attention, the residual
additions, the MLP, and the final norm and head. The values are the model's own, bit for bit, under autocast or
without (`tests/test_decoding.py` compares whole generations and random states); what is left out is the Python
between them. Every other call (the prompt's forward, anything with other arguments) is the model's own forward.

Applies only to models whose layers are exactly transformers' `LlamaDecoderLayer` or `Qwen2DecoderLayer` (SmolLM2,
Llama, Qwen2 and Qwen2.5), with SDPA attention and full attention in every layer, no forward hooks on the modules it
calls through `forward` (user hooks; a hook would be skipped), and not to parameters DeepSpeed shards. A PEFT model
(LoRA agents) is decoded through its transformers model, whose LoRA layers' own `forward` runs as it would.
"""

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .helpers import full_sdpa_attention, transformers_model, zero_sharded


# The decoder layers whose forward `_decoding_step` mirrors (transformers 5: `modeling_llama`, `modeling_qwen2`).
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
# The arguments `generate` passes at a decoding step; any other makes the step the model's own forward.
_STEP_ARGUMENTS = {
    "input_ids",
    "attention_mask",
    "position_ids",
    "cache",
    "use_cache",
    "logits_to_keep",
    "return_dict",
}


def lean_decoding_applies(model: nn.Module) -> bool:
    """Whether `_decoding_step` computes `model`'s decoding steps (see the module docstring)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    config = getattr(model, "config", None)
    if not layers or config is None or not all(type(layer).__name__ in _LAYERS for layer in layers):
        return False
    projections, norms = [model.lm_head], [inner.norm]
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections += [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    return (
        not _global_hooks()
        and full_sdpa_attention(config, inner)
        and not any(module._forward_hooks or module._forward_pre_hooks for module in projections + norms)
        and not zero_sharded(model)
    )


def _global_hooks() -> bool:
    """Whether forward hooks registered for every module would run on a module call (and not on `forward`)."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


@contextmanager
def lean_decoding(model: nn.Module) -> Iterator[None]:
    """Inside the block, `model`'s decoding steps run through `_decoding_step` where `lean_decoding_applies`; its
    `forward` is back afterwards, also after an error."""
    model = transformers_model(model)  # PEFT: its generate runs the transformers model's forward
    if not lean_decoding_applies(model):
        yield
        return
    own = "forward" in vars(model)  # TRL's fused head, for one, sets the forward on the instance
    original = model.forward

    @functools.wraps(original)  # generate validates its model arguments against this signature
    def forward(*args, **kwargs):
        if args or not _is_decoding_step(kwargs):
            return original(*args, **kwargs)
        return _decoding_step(
            model, kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs["cache"]
        )

    model.forward = forward
    try:
        yield
    finally:
        if own:
            model.forward = original
        else:
            del model.forward


def _is_decoding_step(kwargs: dict) -> bool:
    input_ids, cache, mask = kwargs.get("input_ids"), kwargs.get("cache"), kwargs.get("attention_mask")
    return (
        kwargs.keys() <= _STEP_ARGUMENTS
        and kwargs.get("use_cache", True)
        and kwargs.get("return_dict", True)
        and input_ids is not None
        and input_ids.dim() == 2
        and input_ids.shape[1] == 1
        and type(cache) is DynamicCache
        and cache.get_seq_length() > 0
        and (mask is None or mask.dim() == 2)
        and kwargs.get("logits_to_keep", 0) in (0, 1)  # both keep the one position there is
    )


def _decoding_step(
    model: nn.Module, input_ids, attention_mask, position_ids, cache: DynamicCache
) -> CausalLMOutputWithPast:
    """`model.forward(input_ids=..., attention_mask=..., position_ids=..., cache=...)` for one new token per row: the
    operations of transformers' Llama/Qwen2 forward, in its order, without its module calls and keyword plumbing."""
    inner = model.model
    apply_rotary = sys.modules[type(inner.layers[0]).__module__].apply_rotary_pos_emb
    embeds = inner.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = (torch.arange(1, device=embeds.device) + cache.get_seq_length()).unsqueeze(0)
    mask = create_causal_mask(
        config=inner.config,
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    cos, sin = inner.rotary_emb(embeds, position_ids)
    # Under autocast, SDPA casts the whole key and value cache to the autocast dtype at every step and layer; the
    # cache holds them in that dtype instead (the same values: a cast of the concatenation is the concatenation of
    # the casts), once for the prompt's and once per new token.
    kv_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    hidden = embeds
    for layer in inner.layers:
        attention, mlp = layer.self_attn, layer.mlp
        residual = hidden
        hidden = layer.input_layernorm.forward(hidden)
        heads = (*hidden.shape[:-1], -1, attention.head_dim)
        query = attention.q_proj.forward(hidden).view(heads).transpose(1, 2)
        key = attention.k_proj.forward(hidden).view(heads).transpose(1, 2)
        value = attention.v_proj.forward(hidden).view(heads).transpose(1, 2)
        query, key = apply_rotary(query, key, cos, sin)
        if kv_dtype is not None:
            _cast_layer_cache(cache.layers[attention.layer_idx], kv_dtype)
            key, value = key.to(kv_dtype), value.to(kv_dtype)
        key, value = cache.update(key, value, attention.layer_idx)
        dropout = attention.attention_dropout if attention.training else 0.0
        output, _ = sdpa_attention_forward(
            attention, query, key, value, mask, dropout=dropout, scaling=attention.scaling
        )
        output = output.reshape(*hidden.shape[:-1], -1).contiguous()
        hidden = residual + attention.o_proj.forward(output)
        residual = hidden
        hidden = layer.post_attention_layernorm.forward(hidden)
        hidden = mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(hidden)) * mlp.up_proj.forward(hidden))
        hidden = residual + hidden
    hidden = inner.norm.forward(hidden)
    return CausalLMOutputWithPast(logits=model.lm_head.forward(hidden), cache=cache)


def _cast_layer_cache(layer, dtype: torch.dtype) -> None:
    """Hold one layer's cached keys and values in `dtype` (the prompt's, written by the model's own forward)."""
    if layer.keys.dtype != dtype:
        layer.keys = layer.keys.to(dtype)
    if layer.values.dtype != dtype:
        layer.values = layer.values.to(dtype)
