"""The importance-sampling correction for completions sampled by another engine (vLLM).

The engine samples with its own kernels (and, between syncs, possibly older weights), so its token probabilities
differ a little from the trainer's. The policy loss of every token is weighted by the ratio between the trainer's
probability of the sampled completion and the engine's, computed here as TRL defines it (its `vllm_importance_*`
settings), so that the two ways of getting the trainer's log-probabilities (a separate scoring forward, or the
loss's own forward when nothing changed the weights in between) give the same weights.
"""

import math
from typing import Literal

import torch


ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampling_truncates(top_p: float | None, top_k: int | None, min_p: float | None) -> bool:
    """Whether sampling leaves tokens out (top-p below 1, top-k above 0, min-p above 0).

    vLLM then reports each sampled token's log-probability under the renormalised, truncated distribution, which is
    always at least the trainer's (temperature-only) one: the ratio measures the truncation, not the engine.
    """
    return (top_p is not None and top_p < 1.0) or (top_k is not None and top_k > 0) or bool(min_p)


def resolve_correction(
    setting: bool | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    agent_index: int,
    *,
    sampling_temperature: float,
    logprob_temperature: float,
) -> bool:
    """Whether an agent corrects its vLLM samples (`vllm_importance_sampling_correction`, `setting`).

    Under truncated sampling the ratio is below 1 for nearly every token, so TRL's default `sequence_mask` would
    drop nearly every sequence from the loss; where the loss's log-probabilities are at another temperature than
    the sampling one (`logprob_temperature`), the ratio measures the two temperatures, not the engine. Unset (None),
    the correction is on only where neither is the case; set True where one is, it is refused.
    """
    truncates = sampling_truncates(top_p, top_k, min_p)
    if setting is None:
        return not truncates and logprob_temperature == sampling_temperature
    if setting and logprob_temperature != sampling_temperature:
        raise ValueError(
            f"Agent {agent_index}: vllm_importance_sampling_correction=True with logprob_temperature="
            f"{logprob_temperature} and temperature={sampling_temperature}. vLLM's log-probabilities are those of the "
            "distribution it samples, the loss's are at logprob_temperature, so the ratio would weight samples by "
            "the temperature gap, not by the engine's. Set logprob_temperature=None (the sampling temperature) to "
            "correct for the engine, or leave vllm_importance_sampling_correction unset (None)."
        )
    if setting and truncates:
        raise ValueError(
            f"Agent {agent_index}: vllm_importance_sampling_correction=True with truncated sampling "
            f"(top_p={top_p}, top_k={top_k}, min_p={min_p}). vLLM's log-probabilities are those of the truncated "
            "distribution and the trainer's are not, so the ratio would weight (or mask) nearly every sequence down. "
            "Set top_p=1.0, top_k=0 and min_p=None to correct for the engine, or leave "
            "vllm_importance_sampling_correction unset (None)."
        )
    return bool(setting)


def logp_differences(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`trainer - sampling` log-probability per completion token, 0 on padding and where the engine gave no
    log-probability (NaN): such a token is not corrected, rather than turning the loss into NaN."""
    return torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)


def importance_sampling_ratio(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: ImportanceSamplingMode,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """The weight of each token's policy loss: `exp(trainer - sampling)` per token, `(B, T)` for the `token_*`
    modes, or per sequence (the sum over its tokens), `(B, 1)` for the `sequence_*` modes.

    `*_truncate` clamps the ratio into `[clip_min, clip_max]`; `*_mask` sets ratios outside it to 0 (the token or
    sequence is left out of the loss). A bound of None is no bound.
    """
    if mode not in _MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {_MODES}, got {mode!r}.")
    differences = logp_differences(trainer_logps, sampling_logps, mask)
    if mode.startswith("sequence"):
        differences = differences.sum(dim=-1, keepdim=True)
    ratio = differences.exp()
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
