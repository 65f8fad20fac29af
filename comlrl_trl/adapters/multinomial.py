"""torch's one-sample `multinomial` on a CPU, drawing only for the tokens that can be sampled.

`torch.multinomial(probs, 1)` races the entries of each row: it draws an exponential variate q for every entry
(vocabulary) and returns argmax p / q. After top-k (the default `top_k=50`) all but a few dozen probabilities of a
row are 0, yet a decoding step of 8 rows over SmolLM2's 49152 tokens draws 393k variates, each from two words of
torch's Mersenne Twister and a `log1p`: 6-7 ms, a tenth of the step.

`sparse_multinomial` returns the same tokens and leaves torch's generator in the same state. It runs a copy of the
generator (numpy's `MT19937` is the same algorithm; its state is torch's, read from `torch.get_rng_state()`) over
the same words, two per entry, turns only the words of nonzero entries into torch's variates (u from the low 53
bits, q = -log1p(-u) in double precision, rounded to float32) and takes the argmax of the same race. The advanced
state is handed back to torch. 3.6 ms instead of 6.9 for that step, most of it numpy drawing the words.

It runs where torch would run its race: one sample, float32 probabilities on the CPU, torch's default generator,
at least 65536 entries (below, torch's race is as fast). Invalid probabilities, many nonzero entries (no top-k:
every variate is needed) and every other call go to torch. On first use it checks itself against torch on a probe
(restoring the generator afterwards); where a torch build draws otherwise, it leaves sampling to torch, with one
warning.
"""

import functools
import logging
import math

import numpy as np
import torch

from .helpers import attribute_replaced


logger = logging.getLogger(__name__)

_WORDS = 624  # words of the Mersenne Twister's state
_STATE_BYTES = 5056  # torch's CPU generator state: seed, left, seeded, next, 624 words (as uint64), normal cache
_LOW_53_OF_HIGH = (1 << 21) - 1  # the high word's bits under the 53 that make u
_MAX_CANDIDATES_PER_ROW = 256  # above this many nonzero entries per row on average, torch's own race
_MIN_ENTRIES = 1 << 16  # below this many entries, torch's race is as fast (8 rows of 2000 tokens: 0.30 ms vs 0.45)
_ROWS_ENTRIES = 1 << 20  # entries whose words are drawn at once (16 MB of numpy words)


def _generator_from(state: bytes) -> np.random.MT19937:
    """numpy's Mersenne Twister at torch's state: the same words come next."""
    left = int.from_bytes(state[8:12], "little", signed=True)
    position = int.from_bytes(state[16:24], "little")
    key = np.frombuffer(state, dtype="<u8", count=_WORDS, offset=24).astype(np.uint32)
    generator = np.random.MT19937()
    # torch regenerates the words when `left` falls to 0 (left == 1: next call), numpy when `pos` reaches 624.
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": _WORDS if left == 1 else position}}
    return generator


def _state_after(state: bytes, generator: np.random.MT19937) -> torch.Tensor:
    """torch's state bytes with the words and position of `generator` (every other field kept)."""
    mt = generator.state["state"]
    position = int(mt["pos"])  # 1..624 once a word was drawn
    out = bytearray(state)
    out[8:12] = (_WORDS + 1 - position).to_bytes(4, "little", signed=True)  # torch keeps left + next == 625
    out[16:24] = position.to_bytes(8, "little")
    out[24 : 24 + 8 * _WORDS] = np.asarray(mt["key"], dtype="<u8").tobytes()
    return torch.frombuffer(out, dtype=torch.uint8).clone()


def _variates(words: np.ndarray, entries: np.ndarray) -> torch.Tensor:
    """torch's float32 exponential variates of `entries` (flat indices) from their two words (high first)."""
    high, low = words[2 * entries], words[2 * entries + 1]
    u = (((high & _LOW_53_OF_HIGH) << 32) | low).astype(np.float64) * 2.0**-53  # exact: fewer than 54 bits
    return torch.tensor([-math.log1p(-x) for x in u.tolist()], dtype=torch.float64).to(torch.float32)


def race(probs: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """One sample per row of `probs` (float32, `(rows, vocabulary)`, valid) as `torch.multinomial(probs, 1)` draws
    it from torch's default generator, which it advances the same way. `candidates`: the flat indices of the
    nonzero entries, ascending."""
    state = torch.get_rng_state().numpy().tobytes()
    generator = _generator_from(state)
    rows, vocabulary = probs.shape
    flat = probs.reshape(-1)
    scores = torch.zeros_like(flat)
    step = max(1, _ROWS_ENTRIES // vocabulary) * vocabulary
    for start in range(0, flat.numel(), step):
        end = min(start + step, flat.numel())
        words = generator.random_raw(2 * (end - start))
        inside = candidates[(candidates >= start) & (candidates < end)]
        scores[inside] = flat[inside] / _variates(words, (inside - start).numpy())
        # A zero-probability entry whose variate is 0 (u == 0, odds 2**-53) scores 0/0 = NaN in torch's race, and
        # its argmax takes it: the same here.
        zero_words = np.flatnonzero(words == 0)
        low = zero_words[zero_words % 2 == 1]
        zero = low[(words[low - 1] & _LOW_53_OF_HIGH) == 0] // 2 + start
        if zero.size:
            zero = torch.from_numpy(zero)
            scores[zero] = torch.where(flat[zero] == 0, torch.nan, scores[zero])
    torch.set_rng_state(_state_after(state, generator))
    return scores.view(rows, vocabulary).argmax(dim=-1, keepdim=True)


def _candidates(probs, num_samples, generator, out) -> torch.Tensor | None:
    """The flat indices of the nonzero entries where torch would run its race on these arguments and few enough
    entries are nonzero for this one to pay; None elsewhere."""
    if not (
        num_samples == 1
        and generator is None
        and out is None
        and isinstance(probs, torch.Tensor)
        and probs.device.type == "cpu"
        and probs.dtype == torch.float32
        and probs.dim() == 2
        and probs.is_contiguous()  # the layout checked against torch (transformers passes it)
        and probs.numel() >= _MIN_ENTRIES
        and not probs.requires_grad
    ):
        return None
    candidates = probs.reshape(-1).nonzero().squeeze(1)
    if candidates.numel() > _MAX_CANDIDATES_PER_ROW * probs.shape[0]:
        return None  # dense rows: every variate is needed anyway
    # torch's checks, on the only entries that can fail them (the others are 0); invalid probabilities go to torch
    # for its error.
    values = probs.reshape(-1)[candidates]
    every_row = torch.unique_consecutive(candidates // probs.shape[1]).numel() == probs.shape[0]
    valid = every_row and bool(((values > 0) & (values < math.inf)).all())
    return candidates if valid else None


@functools.cache
def _agrees_with_torch() -> bool:
    """Whether `race` draws as this torch build does: the same samples and generator state on a probe. The
    default generator's state is restored afterwards."""
    saved = torch.get_rng_state()
    if saved.numel() != _STATE_BYTES:
        return False
    probe = torch.rand(3, 5000, generator=torch.Generator().manual_seed(0))
    probe[probe < 0.99] = 0  # about 50 candidates per row, as after top-k
    try:
        expected = _TORCH_MULTINOMIAL(probe, 1)
        expected_state = torch.get_rng_state()
        torch.set_rng_state(saved)
        ours = race(probe, probe.reshape(-1).nonzero().squeeze(1))
        same = torch.equal(ours, expected) and torch.equal(torch.get_rng_state(), expected_state)
    except (RuntimeError, ValueError, KeyError, TypeError):
        same = False
    finally:
        torch.set_rng_state(saved)
    if not same:
        logger.warning("Sampling with torch.multinomial over every token: this torch build draws otherwise.")
    return same


_TORCH_MULTINOMIAL = torch.multinomial


def sparse_multinomial(probs, num_samples, replacement=False, *, generator=None, out=None):
    """`torch.multinomial` with its signature: `race` where torch would race few candidates, else torch's."""
    candidates = _candidates(probs, num_samples, generator, out)
    if candidates is not None and _agrees_with_torch():
        return race(probs, candidates)
    return _TORCH_MULTINOMIAL(probs, num_samples, replacement, generator=generator, out=out)


def sparse_sampling():
    """A block in which `torch.multinomial` (what transformers' sampling calls) is `sparse_multinomial`."""
    return attribute_replaced(torch, "multinomial", sparse_multinomial)
