"""Top-k then top-p filtering as transformers' warpers do it, computed on the tokens top-k keeps, on a CPU.

transformers filters a decoding step's scores in two passes over the whole vocabulary: `TopKLogitsWarper` finds the
k-th score (a top-k) and masks the rest, then `TopPLogitsWarper` sorts the whole row (all but k scores are `-inf`),
takes a softmax and cumulative sum over it and masks again. `TopKTopPLogitsWarper` does both from one top-k of
k + 16 scores (`_TIES`: top-k also keeps the scores equal to the k-th, frequent with bf16 logits): the nucleus is
found on the kept scores and the output row is written once. It keeps exactly the tokens transformers keeps, with
the same values:

- the softmax and cumulative sum run over a short row that ends with the kept scores ascending, as transformers'
  sorted row does, and whose length equals the vocabulary's modulo 64 (`_ALIGN`): torch's CPU softmax adds a row in
  vector lanes from its start, and the `-inf` entries before the scores add exact zeros, so the sums, and every
  cumulative probability, are transformers' to the last bit (`_agrees_with_torch` checks this build once);
- a row goes to transformers' two warpers where more than 16 scores after the k-th equal it, where the nucleus'
  cut falls between two equal scores (which of them is dropped is the choice of transformers' sort, which is not
  stable), or where a top score is not finite. Rows are filtered independently, so only those rows take the full
  sort (4% of the rows of a SmolLM2 generation; the whole batch was sorted when one row had such a tie).

On SmolLM2's 49152 tokens, 8 rows: about 1 ms per decoding step against 9 ms for transformers' two warpers.
transformers' own warpers run on small vocabularies (below `_MIN_VOCABULARY`, where its sort is as fast), with a
large top-k (above `_MAX_TOP_K`), with other filter values, and for any other processor order. The lean decoding
loop (`decoding.lean_generate`) filters with `fused_processors` of transformers' processors for its settings.
"""

import functools
import logging

import torch
from transformers.generation.logits_process import LogitsProcessor, TopKLogitsWarper, TopPLogitsWarper


logger = logging.getLogger(__name__)

# Below this vocabulary, transformers' full sort is as fast (8 rows of 2000 tokens: 0.19 ms against 0.17).
_MIN_VOCABULARY = 2048
# Above this top-k, transformers' own warpers (sorting that many scores gains little).
_MAX_TOP_K = 1024
# Scores taken beyond the k-th, for the ones equal to it that top-k keeps too (frequent with bf16 logits).
_TIES = 16
# The short row's length equals the vocabulary's modulo this: a multiple of the vector lanes (8 or 16 floats) and
# of the unrolled blocks torch's CPU reductions add them in.
_ALIGN = 64


def nucleus_cumulative(ascending: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """The cumulative probabilities of `ascending` (`(rows, k)` scores, ascending) in transformers' top-p: those of
    its sorted row of `vocabulary` entries, `vocabulary - k` of them `-inf` and then these k, at the same positions
    modulo `_ALIGN`."""
    rows, k = ascending.shape
    row = ascending.new_full((rows, k + (vocabulary - k) % _ALIGN), -float("inf"))
    row[:, -k:] = ascending
    return row.softmax(dim=-1).cumsum(dim=-1)[:, -k:]


class TopKTopPLogitsWarper(LogitsProcessor):
    """transformers' `top_k` warper followed by its `top_p` warper (the same output), from one top-k."""

    def __init__(self, top_k: TopKLogitsWarper, top_p: TopPLogitsWarper):
        self.top_k, self.top_p = top_k, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k.top_k, scores.shape[-1])
        width = k + _TIES
        if not self._applies(scores, width) or not _agrees_with_torch():
            return self._theirs(input_ids, scores)
        values, indices = scores.topk(width, dim=-1)  # descending
        # transformers' top-k keeps every score not below the k-th: k of them, or more where the k-th repeats.
        kth = values[:, k - 1 : k]
        candidates = values.masked_fill(values < kth, -float("inf"))
        ascending = candidates.flip(-1)  # as in transformers' sorted row: -inf, then the kept scores ascending
        cumulative = nucleus_cumulative(ascending, scores.shape[-1])
        # transformers' rule: drop the ascending prefix whose cumulative probability stays within 1 - top_p, keeping
        # the `min_tokens_to_keep` most likely tokens.
        remove = cumulative <= (1 - self.top_p.top_p)
        remove[:, -self.top_p.min_tokens_to_keep :] = False
        cut = remove.sum(dim=-1, keepdim=True).clamp(1, width - 1)
        exact = (
            (values[:, -1:] < kth).squeeze(-1)  # every score equal to the k-th is among the candidates
            & torch.isfinite(values[:, :k]).all(dim=-1)  # (NaN: not exact either)
            & (ascending.gather(-1, cut - 1) != ascending.gather(-1, cut)).squeeze(-1)  # no tie at the cut
        )
        out = torch.full_like(scores, -float("inf"))
        out.scatter_(1, indices, candidates.masked_fill(remove.flip(-1), -float("inf")))
        if not bool(exact.all()):
            rows = (~exact).nonzero().squeeze(1)
            out[rows] = self._theirs(None if input_ids is None else input_ids[rows], scores[rows])
        return out

    def _applies(self, scores: torch.Tensor, width: int) -> bool:
        return (
            scores.device.type == "cpu"
            and scores.dtype == torch.float32
            and scores.dim() == 2
            and _MIN_VOCABULARY <= scores.shape[-1]
            and width <= min(_MAX_TOP_K, scores.shape[-1])
            and self.top_k.filter_value == -float("inf")
            and self.top_p.filter_value == -float("inf")
        )

    def _theirs(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        return self.top_p(input_ids, self.top_k(input_ids, scores))


@functools.cache
def _agrees_with_torch() -> bool:
    """Whether `nucleus_cumulative` gives this torch build's full-row numbers on a probe of random rows."""
    generator = torch.Generator().manual_seed(0)
    same = True
    for vocabulary in (49152, 50257, 4095):
        for k in (3, 17, 50, 257):
            ascending = (torch.randn(64, k, generator=generator) * 3).sort(dim=-1).values
            row = torch.full((64, vocabulary), -float("inf"))
            row[:, -k:] = ascending
            same &= torch.equal(nucleus_cumulative(ascending, vocabulary), row.softmax(-1).cumsum(-1)[:, -k:])
    if not same:
        logger.warning("Top-p filtering sorts every token: this torch build's softmax adds the short row otherwise.")
    return same


def fused_processors(processors) -> list:
    """`processors` (transformers' logits processors, in order) with each top-k warper directly followed by a top-p
    warper (exactly transformers' classes) replaced by one `TopKTopPLogitsWarper`; a new list."""
    fused, i = [], 0
    while i < len(processors):
        pair = processors[i : i + 2]
        if len(pair) == 2 and type(pair[0]) is TopKLogitsWarper and type(pair[1]) is TopPLogitsWarper:
            fused.append(TopKTopPLogitsWarper(*pair))
            i += 2
        else:
            fused.append(processors[i])
            i += 1
    return fused
