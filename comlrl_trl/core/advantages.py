"""Group-relative advantages for (multi-agent) policy-gradient training.

``returns`` is a flat 1-D tensor of length ``G * K``: consecutive blocks of
``K = num_generations`` entries are the returns of the ``K`` completions sampled
for one task item (one *group*). For a group ``r = (r_1, ..., r_K)``:

Baselines (``mode``):

* ``"mean"`` (MAREINFORCE with a group-mean baseline, as GRPO): ``A_i = r_i - mean(r)``
* ``"raw"``  (no baseline):                                      ``A_i = r_i``
* ``"max"``  (MAReMax-style max baseline):                       ``A_i = r_i - max(r)``
* ``"rloo"`` (MARLOO, leave-one-out):  ``A_i = r_i - mean_{j != i} r_j = (K * r_i - sum(r)) / (K - 1)``

Normalisation (``scale``), with ``std`` the *unbiased* standard deviation
(``torch.std``, ``correction=1``) exactly as TRL's ``GRPOTrainer``:

* ``"group"``: ``A <- (A - mean_group(A)) / (std_group(A) + eps)``
* ``"batch"``: ``A <- (A - mean_group(A)) / (std(returns over the whole batch) + eps)``
* ``"none"``:  ``A`` unchanged (no re-centering either)

With ``mode="mean"`` this reproduces TRL's
``(r - group_mean) / (group_std + 1e-4)`` for ``scale_rewards="group"``,
``(r - group_mean) / (batch_std + 1e-4)`` for ``"batch"`` and
``r - group_mean`` for ``"none"``.

Known property: with ``scale="group"`` every baseline above is an affine map
``A = c * r + b`` of the group's returns with positive slope ``c`` (1 for
mean/raw/max, ``K/(K-1)`` for rloo), and group standardisation removes any
positive affine map, so all four modes yield the same advantages. (mean, raw
and max have slope 1 and agree up to float rounding; rloo agrees up to the
``eps`` term, whose relative effect is about ``eps * (1 - (K-1)/K) / std``.) The estimators MAREINFORCE / MARLOO / MAReMax therefore only
differ when normalisation is off (``scale="none"``); with ``scale="batch"``
rloo differs from the others by the factor ``K/(K-1)``.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch


AdvantageMode = Literal["mean", "raw", "max", "rloo"]
ScaleMode = Literal["group", "batch", "none"]

_ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)
_SCALE_MODES: tuple[str, ...] = get_args(ScaleMode)


def group_advantages(
    returns: torch.Tensor,
    num_generations: int,
    mode: AdvantageMode = "mean",
    scale: ScaleMode = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Compute per-completion advantages from grouped returns (see module docstring).

    Args:
        returns: 1-D tensor of length ``G * K``; block ``g`` is ``returns[g*K:(g+1)*K]``.
        num_generations: group size ``K`` (>= 2).
        mode: baseline, one of ``"mean"``, ``"raw"``, ``"max"``, ``"rloo"``.
        scale: normalisation, one of ``"group"``, ``"batch"``, ``"none"``.
        eps: added to the std in the denominator (TRL uses 1e-4).

    Returns:
        Float tensor of the same shape as ``returns``.
    """
    # ---- validate inputs ------------------------------------------------
    if mode not in _ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {_ADVANTAGE_MODES}")
    if scale not in _SCALE_MODES:
        raise ValueError(f"unknown scale mode {scale!r}; expected one of {_SCALE_MODES}")
    if returns.dim() != 1:
        raise ValueError(f"returns must be 1-D, got shape {tuple(returns.shape)}")
    k = num_generations
    if k < 2:
        raise ValueError(f"num_generations must be >= 2 for group baselines, got {k}")
    if returns.numel() % k != 0:
        raise ValueError(f"len(returns)={returns.numel()} is not divisible by num_generations={k}")

    r = returns if returns.is_floating_point() else returns.to(torch.get_default_dtype())
    grouped = r.view(-1, k)  # (G, K)
    finite = torch.isfinite(grouped).all(dim=1)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(f"returns contain NaN/inf in group index {bad[0]} (bad groups: {bad})")

    # ---- baseline per group ----------------------------------------------
    if mode == "mean":
        adv = grouped - grouped.mean(dim=1, keepdim=True)
    elif mode == "raw":
        adv = grouped.clone()
    elif mode == "max":
        adv = grouped - grouped.max(dim=1, keepdim=True).values
    else:  # "rloo": r_i - mean of the other K-1 returns
        adv = (k * grouped - grouped.sum(dim=1, keepdim=True)) / (k - 1)

    # ---- normalisation ---------------------------------------------------
    # For mode="mean" the baseline output is already group-centred and its std
    # equals std_group(r) (std is shift-invariant); we use those directly so the
    # result is bit-for-bit TRL's (r - mean) / (std + eps) without the float
    # rounding a redundant re-centering would add.
    if scale != "none":
        if mode == "mean":
            centered, group_std = adv, grouped.std(dim=1, keepdim=True)
        else:
            centered = adv - adv.mean(dim=1, keepdim=True)
            group_std = adv.std(dim=1, keepdim=True)
        denom = group_std if scale == "group" else r.std()  # "batch": std of all returns
        adv = centered / (denom + eps)
    # scale == "none": leave the baseline-subtracted returns untouched.

    return adv.reshape(returns.shape)
