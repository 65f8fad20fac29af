"""The vLLM importance-sampling ratio (TRL's four modes), worked out by hand."""

import math

import pytest
import torch

from comlrl_trl.core.importance import (
    importance_sampling_ratio,
    logp_differences,
    resolve_correction,
    sampling_truncates,
)


# Two completions of three token slots. Row 0: differences trainer - sampler = +0.5, -1.0, then padding.
# Row 1: +0.25, a token the engine gave no log-probability (NaN), +1.5.
TRAINER = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -1.0, -0.5]])
SAMPLER = torch.tensor([[-1.5, -1.0, -9.0], [-0.75, math.nan, -2.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_differences_are_zero_on_padding_and_where_the_engine_gave_none():
    expected = torch.tensor([[0.5, -1.0, 0.0], [0.25, 0.0, 1.5]])
    assert torch.allclose(logp_differences(TRAINER, SAMPLER, MASK), expected)


def test_token_truncate_clamps_each_token_ratio():
    ratio = importance_sampling_ratio(TRAINER, SAMPLER, MASK, "token_truncate", clip_min=0.5, clip_max=3.0)
    # exp(0.5) = 1.6487, exp(-1) = 0.3679 -> 0.5, exp(0) = 1, exp(0.25) = 1.2840, exp(1.5) = 4.4817 -> 3.0
    expected = torch.tensor([[1.6487, 0.5, 1.0], [1.2840, 1.0, 3.0]])
    assert ratio.shape == (2, 3)
    assert torch.allclose(ratio, expected, atol=1e-4)


def test_token_mask_zeroes_tokens_outside_the_bounds():
    ratio = importance_sampling_ratio(TRAINER, SAMPLER, MASK, "token_mask", clip_min=0.5, clip_max=3.0)
    expected = torch.tensor([[1.6487, 0.0, 1.0], [1.2840, 1.0, 0.0]])
    assert torch.allclose(ratio, expected, atol=1e-4)


def test_sequence_modes_use_the_sum_over_the_completion():
    # Row 0: 0.5 - 1.0 = -0.5 -> exp = 0.6065; row 1: 0.25 + 0 + 1.5 = 1.75 -> exp = 5.7546.
    truncated = importance_sampling_ratio(TRAINER, SAMPLER, MASK, "sequence_truncate", clip_min=None, clip_max=3.0)
    assert truncated.shape == (2, 1)
    assert torch.allclose(truncated, torch.tensor([[0.6065], [3.0]]), atol=1e-4)
    masked = importance_sampling_ratio(TRAINER, SAMPLER, MASK, "sequence_mask", clip_min=None, clip_max=3.0)
    assert torch.allclose(masked, torch.tensor([[0.6065], [0.0]]), atol=1e-4)
    low = importance_sampling_ratio(TRAINER, SAMPLER, MASK, "sequence_mask", clip_min=0.7, clip_max=None)
    assert torch.allclose(low, torch.tensor([[0.0], [5.7546]]), atol=1e-4)


def test_no_bounds_leave_the_ratio_as_it_is():
    ratio = importance_sampling_ratio(TRAINER, SAMPLER, MASK, "token_truncate", clip_min=None, clip_max=None)
    assert torch.allclose(ratio[1, 2], torch.tensor(4.4817), atol=1e-4)


def test_an_unknown_mode_names_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode must be one of .*token_truncate.*'tokens'"):
        importance_sampling_ratio(TRAINER, SAMPLER, MASK, "tokens", clip_min=None, clip_max=3.0)


@pytest.mark.parametrize(
    "top_p, top_k, min_p, truncates",
    [
        (1.0, 0, None, False),  # the whole distribution
        (None, None, None, False),
        (0.6, 0, None, True),  # nucleus
        (1.0, 50, None, True),  # top-k
        (1.0, 0, 0.05, True),  # min-p
        (1.0, 0, 0.0, False),
        (0.6, 50, None, True),  # the library default
    ],
)
def test_sampling_truncates_when_any_filter_leaves_tokens_out(top_p, top_k, min_p, truncates):
    assert sampling_truncates(top_p, top_k, min_p) is truncates


# Log-probabilities at the sampling temperature (logprob_temperature=None, or equal to it).
ALIKE = dict(sampling_temperature=0.6, logprob_temperature=0.6)


def test_unset_correction_is_on_only_for_untruncated_sampling():
    assert resolve_correction(None, 1.0, 0, None, 0, **ALIKE) is True
    assert resolve_correction(None, 0.6, 50, None, 0, **ALIKE) is False
    assert resolve_correction(None, 1.0, 0, 0.1, 0, **ALIKE) is False


def test_an_explicit_setting_is_kept_where_it_is_sound():
    assert resolve_correction(True, 1.0, 0, None, 0, **ALIKE) is True
    assert resolve_correction(False, 1.0, 0, None, 0, **ALIKE) is False
    assert resolve_correction(False, 0.6, 50, None, 0, **ALIKE) is False


def test_correction_with_truncated_sampling_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"Agent 1: vllm_importance_sampling_correction=True .*top_p=0.9.*top_p=1.0"):
        resolve_correction(True, 0.9, 0, None, 1, **ALIKE)


def test_unset_correction_is_off_where_log_probabilities_are_at_another_temperature():
    # Untruncated sampling at 0.6 while the loss trains temperature-1 log-probabilities (the default): exp(trainer -
    # engine) would be p_1(token) / p_0.6(token), a weight from the temperatures alone.
    assert resolve_correction(None, 1.0, 0, None, 0, sampling_temperature=0.6, logprob_temperature=1.0) is False
    assert resolve_correction(None, 1.0, 0, None, 0, sampling_temperature=1.0, logprob_temperature=1.0) is True


def test_correction_at_another_log_probability_temperature_is_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r"Agent 2: .*logprob_temperature=1.0 and temperature=0.6.*Set logprob_temperature=None"
    ):
        resolve_correction(True, 1.0, 0, None, 2, sampling_temperature=0.6, logprob_temperature=1.0)
    assert resolve_correction(False, 1.0, 0, None, 2, sampling_temperature=0.6, logprob_temperature=1.0) is False
