"""Our own decoding loop for Llama and Qwen2 models on a CPU: the model's modules and functions, called directly.

A decoding step of transformers' `generate` runs one token per row through every layer. For a small model on a CPU
the tensor work is small and much of a step is Python: per layer, a dozen module calls (each through
`nn.Module.__call__` and its hook checks), the decorators and keyword plumbing of the layer and attention modules,
and the output containers (SmolLM2-135M: 30 layers, 8 rows, about 46 ms per step of which the linear layers are 26);
around the steps, `generate`'s setup and its per-step input preparation, logits-processor list and stopping
criteria.

`lean_generate(model, input_ids, attention_mask, config)` samples the completions itself, without `generate`: the
prompt's forward (`_lean_prefill`), then one `_decoding_step` per new token on a `DynamicCache`, each calling the
model's own functions and modules' `forward` methods in the order its forward calls them: the embedding,
`create_causal_mask`, the rotary embedding, per layer the norm, the projections, the model's
`apply_rotary_pos_emb`, the cache's `update`, transformers' SDPA attention, the residual additions, the MLP, and the
final norm and head. Between the steps it prepares each step's inputs as `generate` would (the last token, the next
position, the attention mask grown by one column), runs transformers' logits processors for these settings with
top-k and top-p as one filter (`top_k_top_p.fused_processors`), draws with `multinomial.sparse_multinomial` (or an
argmax without sampling), pads finished rows and stops at the end-of-sequence tokens or `max_new_tokens`. The
tokens, the logits of every step and torch's random state afterwards are `generate`'s own, bit for bit, under
autocast or without (`tests/test_decoding.py`); nothing of torch, transformers or any other library is replaced
while it runs.

`sampling_config(model, generation_config)` is `generate`'s copy of the settings (the model's defaults filled in);
it raises `LeanDecodingUnavailable` for settings the loop does not run: anything but sampling or greedy search of
one sequence per prompt with `max_new_tokens`, a dynamic cache and an unchunked prompt (stop strings, time limits,
beams, assistants, returned scores). The loop applies only to models whose layers are exactly transformers'
`LlamaDecoderLayer` or `Qwen2DecoderLayer` (SmolLM2, Llama, Qwen2 and Qwen2.5), with SDPA attention and full
attention in every layer, no forward hooks on the modules it calls through `forward` (user hooks; a hook would be
skipped), and not to parameters DeepSpeed shards (`lean_decoding_applies`). A PEFT model (LoRA agents) is decoded
through its transformers model, whose LoRA layers' own `forward` runs as it would.

`lean_generate(..., decoder=team)` runs the same loop over a whole team's rows (`fast/joint_decoding.py`): the
forwards go through the team's view, which sends each row through its own agent's weights.
"""

import sys

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation.configuration_utils import GenerationConfig, GenerationMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..adapters.generate_setup import generate_config, generate_setup
from ..adapters.helpers import full_sdpa_attention, zero_sharded
from . import multinomial
from .top_k_top_p import fused_processors


# The decoder layers whose forward `_decoding_step` mirrors (transformers 5: `modeling_llama`, `modeling_qwen2`).
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")


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


class LeanDecodingUnavailable(RuntimeError):
    """Settings or a model `lean_generate` does not run (raised before any token is drawn): use `generate`."""


def sampling_config(model: nn.Module, generation_config: GenerationConfig) -> GenerationConfig:
    """The settings `model.generate(..., generation_config=generation_config)` would sample with (its copy, the
    model's own defaults filled in), for one `lean_generate` call; `LeanDecodingUnavailable` where the loop does not
    run them or `model` (see the module docstring)."""
    if not lean_decoding_applies(model):
        raise LeanDecodingUnavailable(
            "the model is not one the lean decoding loop runs (Llama or Qwen2, SDPA, no hooks)"
        )
    config, model_kwargs = generate_config(model, generation_config)
    mode = config.get_generation_mode()
    reason = (
        f"{mode.value} generation"
        if mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)
        else f"the generation settings {sorted(model_kwargs)}"
        if model_kwargs
        else "several sequences per prompt"
        if (config.num_return_sequences or 1) != 1
        else "no max_new_tokens"
        if config.max_new_tokens is None or config.max_new_tokens < 1
        else "stop strings or a time limit"
        if config.stop_strings is not None or config.max_time is not None
        else "a chunked prompt"
        if config.prefill_chunk_size is not None
        else f"a {config.cache_implementation} cache"
        if config.cache_implementation not in (None, "dynamic") or config.use_cache is False
        else "classifier-free guidance"
        if config.guidance_scale not in (None, 1)
        else "returned scores, attentions or hidden states"
        if config.return_dict_in_generate
        else "token healing"
        if config.token_healing
        else None
    )
    if reason is not None:
        raise LeanDecodingUnavailable(f"the lean decoding loop does not run {reason}")
    return config


def lean_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: GenerationConfig,
    decoder=None,
    logits: list | None = None,
) -> torch.Tensor:
    """`model.generate(input_ids=..., attention_mask=..., generation_config=...)`'s sequences (the prompts and their
    new tokens), from our own loop (see the module docstring). `config`: `sampling_config`'s, for this call only.
    `decoder` (default `model`) is what the forwards run: a team's view decodes every agent's rows with its own
    weights. `logits`: each step's float32 logits are appended to it (`output_logits`)."""
    decoder = model if decoder is None else decoder
    rows, prompt_length = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    # What `generate` prepares: positions from the mask, no mask where it is all ones, lengths from the prompt's.
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    mask = None if bool((attention_mask == 1).all()) else attention_mask
    processors, eos, pad = generate_setup(model, config, input_ids, mask)
    processors = fused_processors(processors)
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    outputs = _lean_prefill(decoder, input_ids.clone(), mask, position_ids, cache)
    position_ids = position_ids[..., -1:] + 1
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
    for step in range(config.max_new_tokens):
        scores = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
        if logits is not None:
            logits.append(scores)
        for processor in processors:
            scores = processor(input_ids, scores)
        if config.do_sample:
            next_tokens = multinomial.sparse_multinomial(nn.functional.softmax(scores, dim=-1), 1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if eos is not None:  # finished rows get the pad token; a row finishes at an end-of-sequence token
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if eos is not None:
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
        if step + 1 == config.max_new_tokens or unfinished.max() == 0:
            break
        outputs = _decoding_step(decoder, input_ids[:, -1:].clone(), mask, position_ids, cache)
        position_ids = position_ids + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
    return input_ids


def _decoding_step(
    model: nn.Module, input_ids, attention_mask, position_ids, cache: DynamicCache
) -> CausalLMOutputWithPast:
    """`model.forward(input_ids=..., attention_mask=..., position_ids=..., cache=...)` for one new token per row: the
    operations of transformers' Llama/Qwen2 forward, in its order, without its module calls and keyword plumbing."""
    return _lean_forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep=0)


def _lean_prefill(
    model: nn.Module, input_ids, attention_mask, position_ids, cache: DynamicCache
) -> CausalLMOutputWithPast:
    """The prompt's forward in `generate` (`logits_to_keep=1`, an empty cache), as `_decoding_step` computes a step."""
    return _lean_forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep=1)


def _lean_forward(
    model: nn.Module, input_ids, attention_mask, position_ids, cache: DynamicCache, logits_to_keep: int
) -> CausalLMOutputWithPast:
    """The operations of transformers' Llama/Qwen2 forward on `input_ids` after the tokens `cache` holds (the
    logits of the last `logits_to_keep` positions; 0: of all)."""
    inner = model.model
    apply_rotary = rotary_function(inner.layers[0])
    embeds = inner.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = (torch.arange(embeds.shape[1], device=embeds.device) + cache.get_seq_length()).unsqueeze(0)
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
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:, :]  # transformers' `slice_logits_to_keep`
    return CausalLMOutputWithPast(logits=model.lm_head.forward(hidden), cache=cache)


def rotary_function(layer: nn.Module):
    """The `apply_rotary_pos_emb` of a decoder layer's modelling module (a team's layer view names its own)."""
    return getattr(layer, "apply_rotary_pos_emb", None) or sys.modules[type(layer).__module__].apply_rotary_pos_emb


def _cast_layer_cache(layer, dtype: torch.dtype) -> None:
    """Hold one layer's cached keys and values in `dtype` (the prompt's, where the model's own forward wrote them)."""
    if not layer.is_initialized:
        return  # an empty cache: the prompt's keys and values are cast as they come
    if layer.keys.dtype != dtype:
        layer.keys = layer.keys.to(dtype)
    if layer.values.dtype != dtype:
        layer.values = layer.values.to(dtype)
