"""transformers' `generate` setup, for the lean decoding loop that samples without `generate` (`fast/decoding.py`).

The loop must sample with exactly the settings and logits processors `generate` would: the model's own generation
defaults filled into the caller's settings, the end-of-sequence and padding tokens as tensors, the lengths counted
from the prompt's, and the processors transformers builds for them. These come from `generate`'s own (private)
methods, called here as functions on the model (nothing is replaced), so a transformers upgrade is ported here.
"""

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList


def generate_config(model: nn.Module, generation_config: GenerationConfig) -> tuple[GenerationConfig, dict]:
    """`generate`'s copy of `generation_config`, the model's own defaults filled in, and the model arguments those
    settings add (returned attentions or hidden states)."""
    return model._prepare_generation_config(generation_config)


def generate_setup(
    model: nn.Module, config: GenerationConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
    """What `generate` prepares from `config` (its `generate_config`, changed in place) for these left-padded prompts
    (`attention_mask`: None where it is all ones, as `generate` passes it on): the logits processors in its order,
    the end-of-sequence tokens (None: none) and the token that pads finished rows."""
    rows, prompt_length = input_ids.shape
    model._prepare_special_tokens(config, True, device=input_ids.device, batch_size=rows)
    config.max_length = config.max_new_tokens + prompt_length  # `_prepare_generated_length` with max_new_tokens
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt_length
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask, "use_cache": True},
    )
    return list(processors), config._eos_token_tensor, config._pad_token_tensor
