"""A diagnostic for the learning benchmark: fp32 training whose forward sees every linear weight rounded to bf16.

bf16 autocast changes two things at once: the weights a forward multiplies by (the fp32 master weights rounded to
bf16) and the precision of the activations. `WeightRounding` separates the first: each `nn.Linear` weight of
an fp32 model is read through a parametrization that rounds it to bf16 (and back to fp32) while the products,
activations and the optimiser's master weights stay fp32; its gradient passes straight through to the master weight,
as autocast's cast does. A learning run with it (`learning.py --forward-weights bf16`) shows how much of bf16's cost
to learning comes from the weights alone.

`seen_change` measures why that can matter: how much of the change training made to the master weights a bf16
forward sees, `round(W) - round(W0)` against `W - W0`. Run as a script, it prints how the tutorial's optimiser step
compares with bf16's spacing at the demo model's weights (`spacing_summary`):

    python benchmarks/weight_rounding.py [--lr 5e-5] [--json F]
"""

from contextlib import contextmanager
from typing import Literal, NamedTuple, get_args

import torch
from torch import nn
from torch.nn.utils import parametrize


def stochastic_bf16(w: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`w` (fp32) rounded to one of its two bf16 neighbours, the upper with probability its distance from the lower
    over their spacing: a uniform 16-bit integer added to the fp32 bits below bf16's, then those bits dropped."""
    noise = torch.randint(0, 1 << 16, w.shape, dtype=torch.int32, generator=generator)
    return (w.view(torch.int32) + noise).bitwise_and_(-(1 << 16)).view(torch.float32).to(torch.bfloat16)


def bf16_spacing(w: torch.Tensor) -> torch.Tensor:
    """The distance between neighbouring bf16 values at each element of `w` (bf16 keeps 8 significant bits)."""
    return torch.ldexp(torch.ones_like(w, dtype=torch.float32), torch.frexp(w.float()).exponent - 8)


def spacing_summary(weights: list[torch.Tensor], step: float) -> dict:
    """How an optimiser step of `step` compares with bf16's spacing at the weights (each at its bf16 value).

    `median_magnitude` over all elements; `median_spacing` and `above_four_steps` (the fraction whose spacing exceeds
    four steps) over the non-zero ones, where the spacing is set by the weight's own magnitude."""
    flat = torch.cat([w.detach().flatten().float() for w in weights])
    nonzero = flat[flat != 0].to(torch.bfloat16).float()
    spacing = bf16_spacing(nonzero)
    return {
        "step": step,
        "median_magnitude": flat.abs().median().item(),
        "median_spacing": spacing.median().item(),
        "above_four_steps": (spacing > 4 * step).float().mean().item(),
        "elements": flat.numel(),
    }


def relative_bf16(w: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """`w0`'s bf16 value moved by `w - w0` rounded to whole bf16 spacings at that value: a weight moves by no more
    than half a spacing beyond what its master moved, and not at all before its master moved half a spacing (nearest
    rounding of `w` itself can move it by a whole spacing for the smallest change, where `w0` lies near a boundary)."""
    base = w0.to(torch.bfloat16).float()
    spacing = bf16_spacing(base)
    change = w - w0
    change = torch.where(base == 0, change, torch.round(change / spacing) * spacing)
    return (base + change).to(torch.bfloat16)


class _StraightThrough(torch.autograd.Function):
    """The rounded copy of `w` in the forward; the gradient reaches `w` unchanged (not rounded to bf16)."""

    @staticmethod
    def forward(ctx, w, rounded):
        return rounded.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _RoundToBf16(nn.Module):
    """The parametrization: one rounded copy per value of the weight, for generation and the loss alike."""

    def __init__(self, rounding: "WeightRounding", index: int):
        super().__init__()
        self.rounding, self.index = rounding, index
        self._key, self._rounded = None, None

    def forward(self, w):
        if not self.rounding.enabled:
            return w
        key = (w.data_ptr(), w._version)  # the optimiser's in-place step bumps the version
        if key != self._key:
            self._key, self._rounded = key, self.rounding.round(w.detach(), self.index).to(w.dtype)
        if torch.is_grad_enabled() and w.requires_grad:
            return _StraightThrough.apply(w, self._rounded)
        return self._rounded


Mode = Literal["nearest", "stochastic", "relative"]


class ForwardWeights(NamedTuple):
    mode: Mode
    label: str  # appended to a learning.py row's label, and so to its runs' file names


# `learning.py --forward-weights` choices: the rounding each selects and how its rows are labelled.
FORWARD_WEIGHTS = {
    "bf16": ForwardWeights("nearest", "bf16 forward weights"),
    "bf16-stochastic": ForwardWeights("stochastic", "stochastic bf16 forward weights"),
    "bf16-relative": ForwardWeights("relative", "relative bf16 forward weights"),
}


class WeightRounding:
    """The rounding of `models`' linear weights, on from construction; `paused()` reads the master weights.

    `mode`: "nearest" rounds to the nearest bf16 value, as autocast's cast does; "stochastic" draws one of the two
    nearest at each new value of a weight (`stochastic_bf16`, from a generator of its own seeded with `seed`, so that
    the run's sampling draws the same random numbers), unbiased: on average the forward sees the master weight;
    "relative" moves the initial weight's bf16 value by the master's change in whole spacings (`relative_bf16`).
    """

    def __init__(self, models, mode: Mode = "nearest", seed: int = 0):
        if mode not in get_args(Mode):
            raise ValueError(f"mode must be 'nearest', 'stochastic' or 'relative', got {mode!r}")
        self.enabled, self.mode = True, mode
        self.generator = torch.Generator().manual_seed(seed)
        self.modules = [m for model in models for m in model.modules() if isinstance(m, nn.Linear)]
        if any(m.weight.dtype != torch.float32 for m in self.modules):
            raise TypeError("WeightRounding needs fp32 weights: bf16 weights have nothing left to round.")
        self.initial = [m.weight.detach().clone() for m in self.modules]
        for index, module in enumerate(self.modules):
            parametrize.register_parametrization(module, "weight", _RoundToBf16(self, index), unsafe=True)

    def round(self, w: torch.Tensor, index: int) -> torch.Tensor:
        if self.mode == "stochastic":
            return stochastic_bf16(w, self.generator)
        if self.mode == "relative":
            return relative_bf16(w, self.initial[index])
        return w.to(torch.bfloat16)

    def master_weights(self) -> list[torch.Tensor]:
        return [m.parametrizations.weight.original.detach() for m in self.modules]

    @contextmanager
    def paused(self):
        """The master weights as they are, e.g. for an evaluation that must match the other runs' (fp32) one."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


def seen_change(initial: list[torch.Tensor], current: list[torch.Tensor]) -> dict:
    """How the change a bf16 forward sees, `e = round(W) - round(W0)`, compares with the master's, `d = W - W0`.

    `cosine` and `norm_ratio` (|e| / |d|) over all elements together; `error` is |e - d| / |d|; `changed` the
    fraction of elements whose bf16 value changed, `moved` of those whose master value did."""
    dd = ee = ed = err = 0.0
    moved = changed = total = 0
    for w0, w in zip(initial, current, strict=True):
        d = w.double() - w0.double()
        e = w.to(torch.bfloat16).double() - w0.to(torch.bfloat16).double()
        dd += float((d * d).sum())
        ee += float((e * e).sum())
        ed += float((e * d).sum())
        err += float(((e - d) ** 2).sum())
        moved += int((d != 0).sum())
        changed += int((e != 0).sum())
        total += d.numel()
    return {
        "cosine": ed / (dd * ee) ** 0.5 if dd and ee else 0.0,
        "norm_ratio": (ee / dd) ** 0.5 if dd else 0.0,
        "error": (err / dd) ** 0.5 if dd else 0.0,
        "changed": changed / total,
        "moved": moved / total,
    }


def main():
    import argparse
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from comlrl_trl.models.demo import demo_model_path

    parser = argparse.ArgumentParser(description="bf16's spacing at the demo model's weights against an AdamW step")
    parser.add_argument("--lr", type=float, default=5e-5, help="the step (AdamW moves a weight by about lr or less)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    tensors = {}
    for path in sorted(Path(demo_model_path()).glob("*.safetensors")):
        tensors.update(load_file(path))
    summary = spacing_summary([t for t in tensors.values() if t.dim() == 2], args.lr)  # the weight matrices
    for key, value in summary.items():
        print(f"{key:<18} {value:.6g}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
