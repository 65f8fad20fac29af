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
between them. Every other call of `model.forward` (the prompt's forward outside the loop below, anything with other
arguments) is the model's own forward.

The sampling loop around the steps (`_sampling_loop`, in place of transformers' `_sample` for this model) prepares
each step's inputs directly: the last token, the next position (and the attention mask grown by one column), the
cache, without `prepare_inputs_for_generation`, `_update_model_kwargs_for_generation` and the model call in between;
the logits processors, the draw, the end-of-sequence padding and the stopping criteria are transformers' own, in
its order. The prompt's forward runs the same operations as a step, on the whole prompt (`_lean_prefill`). The loop
runs where each of its steps would be a `_decoding_step`: sampling or greedy search of a decoder-only model from an
empty `DynamicCache`, no streamer, no synchronised GPUs, no returned attentions or hidden states, no other model
arguments; anywhere else, transformers' loop. On the tiny test model this saves about a tenth of a `generate` call.

Applies only to models whose layers are exactly transformers' `LlamaDecoderLayer` or `Qwen2DecoderLayer` (SmolLM2,
Llama, Qwen2 and Qwen2.5), with SDPA attention and full attention in every layer, no forward hooks on the modules it
calls through `forward` (user hooks; a hook would be skipped), and not to parameters DeepSpeed shards. A PEFT model
(LoRA agents) is decoded through its transformers model, whose LoRA layers' own `forward` runs as it would.

`lean_decoding(model, team)` runs the same loop over a whole team's rows (`fast/joint_decoding.py`): the forwards
go through the team's view, which sends each row through its own agent's weights, and a call the loop (with its
lean prompt forward) would not run raises `JointDecodingUnavailable` before any token is drawn.
"""

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..adapters.helpers import full_sdpa_attention, zero_sharded
from ..loading import base_model


# The decoder layers whose forward `_decoding_step` mirrors (transformers 5: `modeling_llama`, `modeling_qwen2`).
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
# The model arguments `_sampling_loop` prepares; any other in a `generate` call makes the loop transformers' own.
_LOOP_ARGUMENTS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep"}
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


class JointDecodingUnavailable(RuntimeError):
    """A team's `generate` call that `_sampling_loop` cannot run as one loop (raised before any token is drawn)."""


@contextmanager
def lean_decoding(model: nn.Module, team: nn.Module | None = None) -> Iterator[None]:
    """Inside the block, `model`'s decoding steps run through `_decoding_step` where `lean_decoding_applies`; its
    `forward` is back afterwards, also after an error.

    `team` (`joint_decoding.team_view` of a team whose first agent is `model`): `model.generate` then decodes every agent's
    rows at once, each row through its own agent's weights, and raises `JointDecodingUnavailable` where our loop and
    its lean prompt forward do not apply."""
    model = base_model(model)  # PEFT: its generate runs the transformers model's forward
    if not lean_decoding_applies(model):
        if team is not None:
            raise JointDecodingUnavailable("the first agent's model is not one lean decoding runs")
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
    owner = type(model)  # transformers looks its decoding loop up on the class
    own_sample = "_sample" in vars(owner)
    original_sample = owner._sample

    @functools.wraps(original_sample)  # generate inspects its signature
    def sample(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):
        applies = self is model and _loop_applies(self, generation_config, synced_gpus, streamer, model_kwargs)
        if team is not None and self is model:
            if not (applies and _lean_prefill_applies(generation_config, model_kwargs)):
                raise JointDecodingUnavailable("transformers' own sampling loop would run")
            return _sampling_loop(
                self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs, team
            )
        if applies:
            return _sampling_loop(
                self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs
            )
        return original_sample(
            self,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus,
            streamer,
            **model_kwargs,
        )

    owner._sample = sample
    try:
        yield
    finally:
        if own:
            model.forward = original
        else:
            del model.forward
        if own_sample:
            owner._sample = original_sample
        else:
            del owner._sample


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


def _loop_applies(model: nn.Module, generation_config, synced_gpus: bool, streamer, model_kwargs: dict) -> bool:
    """Whether every step of transformers' `_sample` loop on these arguments would be a `_decoding_step`."""
    cache, mask = model_kwargs.get("cache"), model_kwargs.get("attention_mask")
    returns_dict = generation_config.return_dict_in_generate
    return (
        not synced_gpus
        and streamer is None
        and not model.config.is_encoder_decoder
        and not getattr(generation_config, "is_assistant", False)
        and not (returns_dict and (generation_config.output_attentions or generation_config.output_hidden_states))
        and model_kwargs.keys() <= _LOOP_ARGUMENTS
        and model_kwargs.get("use_cache", False)
        and type(cache) is DynamicCache
        and cache.get_seq_length() == 0
        and (mask is None or mask.dim() == 2)
        and model_kwargs.get("logits_to_keep", 0) in (0, 1)
        and not model._valid_auto_compile_criteria(model_kwargs, generation_config)
    )


def _lean_prefill_applies(generation_config, model_kwargs: dict) -> bool:
    """Whether `_sampling_loop` runs the prompt's forward as `_lean_prefill` (one pass, the last position's logits)."""
    return generation_config.prefill_chunk_size is None and model_kwargs.get("logits_to_keep") == 1


def _sampling_loop(
    model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs: dict, decoder=None
):
    """transformers' `_sample` (sampling or greedy search) where `_loop_applies`: the prompt's forward (`_lean_prefill`,
    or transformers' `_prefill` for chunked prompts or all positions' logits), then one `_decoding_step` per new
    token, with the inputs transformers would prepare. `decoder` (default `model`) is what the forwards run: a
    team's view decodes every agent's rows with its own weights."""
    decoder = model if decoder is None else decoder
    pad_token_id = padding_token(generation_config)
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores, raw_logits = [], []
    unfinished_sequences = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    if _lean_prefill_applies(generation_config, model_kwargs):
        # What `_prefill` hands the model's forward for a whole prompt and an empty cache.
        outputs = _lean_prefill(
            decoder,
            input_ids.clone(),
            model_kwargs.get("attention_mask"),
            model_kwargs.get("position_ids"),
            model_kwargs["cache"],
        )
    else:
        outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
    cache, mask = model_kwargs["cache"], model_kwargs.get("attention_mask")
    position_ids = model_kwargs.get("position_ids")
    position_ids = None if position_ids is None else position_ids[..., -1:]
    with model._optimize_model_for_decode():
        while True:
            next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            next_token_scores = logits_processor(input_ids, next_token_logits)
            if keep_scores:
                scores.append(next_token_scores)
            if keep_logits:
                raw_logits.append(next_token_logits)
            if generation_config.do_sample:
                probs = nn.functional.softmax(next_token_scores, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(next_token_scores, dim=-1)
            if has_eos_stopping_criteria:
                next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            # transformers hands the criteria its tuple of kept scores (None when none are kept), not this step's.
            kept = tuple(scores) if keep_scores else None
            unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, kept)
            if unfinished_sequences.max() == 0:
                break
            del outputs
            outputs = _decoding_step(decoder, input_ids[:, -1:].clone(), mask, position_ids, cache)
            # What `_update_model_kwargs_for_generation` and `prepare_inputs_for_generation` hand the next step.
            if position_ids is not None:
                position_ids = position_ids + 1
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
    if not generation_config.return_dict_in_generate:
        return input_ids
    return GenerateDecoderOnlyOutput(
        sequences=input_ids,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
        attentions=None,
        hidden_states=None,
        cache=cache,
    )


def padding_token(generation_config) -> torch.Tensor | None:
    """The token that pads finished rows, as `generate` picks it: the pad token, else the first end-of-sequence
    token."""
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return None if pad is None else torch.tensor(pad)


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
