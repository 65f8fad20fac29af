"""TRL's side of a team generator that samples the tokens itself (`comlrl_trl.generation.cpu`).

Such a generator keeps each agent's TRL processing: the prompts are tokenised (and truncated) by the agent's
`_tokenize_prompts`, and from the sampled tokens on TRL's `_generate` does the rest (the completion ids up to the
first end-of-sequence token, decoding, metrics) through its `rollout_func` seam. These helpers are that seam; they
are here because they use TRL's internals (`tests/test_trl_boundary.py`).
"""

import copy
from contextlib import contextmanager

import torch
from trl import GRPOTrainer
from trl.trainer.utils import pad

from .grpo import Rollout


def prompt_token_ids(agent, prompts: list) -> list[list[int]] | None:
    """The agent's token ids of `prompts` as TRL tokenises (and this package truncates) them; None where the prompts
    hold images (their processing stays TRL's)."""
    ids, images, multimodal_fields = agent._tokenize_prompts(copy.deepcopy(prompts))
    if images is not None or multimodal_fields:
        return None
    return ids


def pad_token_id(agent) -> int | None:
    """The padding token of the agent's tokenizer."""
    return agent._tokenizer.pad_token_id


def left_padded(
    rows: list[list[int]], padding_value: int, device, pad_to_multiple_of: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` left-padded into one batch, and its attention mask, as TRL pads prompts for `generate`."""
    tensors = [torch.tensor(row) for row in rows]
    padded = {"padding_side": "left", "pad_to_multiple_of": pad_to_multiple_of}
    input_ids = pad(tensors, padding_value=padding_value, **padded).to(device)
    mask = pad([torch.ones_like(row) for row in tensors], padding_value=0, **padded).to(device)
    return input_ids, mask


@contextmanager
def _rollout_func(agent, output: dict):
    own = "rollout_func" in vars(agent)
    previous = agent.rollout_func
    agent.rollout_func = lambda _prompts, _trainer: output
    try:
        yield
    finally:
        if own:
            agent.rollout_func = previous
        else:
            del agent.rollout_func


def rollout_from_tokens(agent, prompts: list, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> Rollout:
    """The agent's `Rollout` of `prompts` whose tokens were sampled elsewhere: TRL's `_generate` on them, its
    `rollout_func` handing back these ids (no sampling log-probabilities)."""
    output = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
    with _rollout_func(agent, output):
        return Rollout(*GRPOTrainer._generate(agent, prompts))
