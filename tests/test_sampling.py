"""Top-k then top-p from one top-k (`comlrl_trl/fast/top_k_top_p.py`): transformers' kept tokens and values."""

import logging

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from comlrl_trl.fast import top_k_top_p
from comlrl_trl.fast.decoding import lean_generate, sampling_config
from comlrl_trl.fast.top_k_top_p import TopKTopPLogitsWarper, fused_processors


def _warpers(top_k, top_p, min_tokens_to_keep=1):
    return (
        TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=min_tokens_to_keep),
        TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=min_tokens_to_keep),
    )


def _count_their_rows(monkeypatch) -> list[int]:
    """Rows handed to transformers' warpers by `TopKTopPLogitsWarper`, one count per call that hands any."""
    counts = []
    theirs = TopKTopPLogitsWarper._theirs
    monkeypatch.setattr(
        TopKTopPLogitsWarper, "_theirs", lambda self, ids, s: counts.append(len(s)) or theirs(self, ids, s)
    )
    return counts


def test_a_hand_worked_nucleus():
    # Top-3 keeps tokens 4, 1, 2 (probabilities 0.5, 0.3, 0.2 among them); ascending cumulative 0.2, 0.5, 1.0: with
    # top_p=0.6 only the 0.2 token lies within 1 - 0.6 = 0.4 and is dropped. Every other token is far below.
    scores = torch.full((1, 3000), -30.0)
    scores[0, 7] = -20.0  # the 4th score: not kept by top-3
    scores[0, [4, 1, 2]] = torch.tensor([0.5, 0.3, 0.2]).log()
    out = TopKTopPLogitsWarper(*_warpers(3, 0.6))(None, scores)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 4]
    assert out[0, 1] == scores[0, 1] and out[0, 4] == scores[0, 4]


@pytest.mark.parametrize("vocabulary", [3000, 50257, 49152])
@pytest.mark.parametrize("top_k", [2, 17, 50, 64, 300])
@pytest.mark.parametrize("top_p", [0.05, 0.6, 0.95])
@pytest.mark.parametrize("min_tokens_to_keep", [1, 3])
def test_keeps_what_transformers_keeps(vocabulary, top_k, top_p, min_tokens_to_keep, monkeypatch):
    their_rows = _count_their_rows(monkeypatch)
    top_k_warper, top_p_warper = _warpers(top_k, top_p, min_tokens_to_keep)
    generator = torch.Generator().manual_seed(vocabulary + top_k + int(100 * top_p) + min_tokens_to_keep)
    for trial in range(6):
        scores = torch.randn(8, vocabulary, generator=generator) * 4
        if trial % 2:
            # bf16 logits: many equal scores, where transformers' unstable sort decides which of two equal scores
            # at the cut is dropped
            scores = scores.to(torch.bfloat16).float()
        scores[3, : vocabulary - top_k + 1] = float("-inf")  # fewer finite scores than top-k keeps
        scores[5, 11] = scores[5].max()  # the two largest scores equal
        theirs = top_p_warper(None, top_k_warper(None, scores))
        ours = TopKTopPLogitsWarper(top_k_warper, top_p_warper)(None, scores)
        assert torch.equal(ours, theirs)
    # Float scores: only row 3 (and row 5 where the cut falls between its two largest) take transformers' sort;
    # bf16 scores as many rows as have a tie at the cut.
    assert len(their_rows) == 6 and all(1 <= n <= 2 for n in their_rows[0::2])


@pytest.mark.parametrize("special", ["nan", "inf", "tie_after_k", "many_ties_after_k"])
def test_rows_it_cannot_filter_go_to_transformers_alone(special, monkeypatch):
    their_rows = _count_their_rows(monkeypatch)
    top_k_warper, top_p_warper = _warpers(5, 0.9)
    scores = torch.randn(4, 4096, generator=torch.Generator().manual_seed(1))
    if special == "nan":
        scores[2, 9] = float("nan")
    elif special == "inf":
        scores[2, 9] = float("inf")
    else:  # scores equal to the 5th largest after it, which top-k keeps too: 1, or more than the candidates hold
        repeats = 1 if special == "tie_after_k" else top_k_top_p._TIES
        fifth = scores[2].topk(5).values[-1]
        scores[2, scores[2] < fifth] -= 10
        scores[2, (scores[2] < fifth).nonzero()[:repeats, 0]] = fifth
        assert torch.isfinite(top_k_warper(None, scores)[2]).sum() == 5 + repeats
    ours = TopKTopPLogitsWarper(top_k_warper, top_p_warper)(None, scores)
    theirs = top_p_warper(None, top_k_warper(None, scores))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert their_rows == ([] if special == "tie_after_k" else [1])


def test_repeats_of_the_kth_score_beyond_the_candidates_go_to_transformers(monkeypatch):
    # Scores 5, 4, 3, 2 and 18 repeats of 1 (the 5th largest, so top-5 keeps all 22); the k + 16 = 21 candidates
    # hold only 17 of the repeats. Ascending cumulative probabilities of transformers' 22 tokens: 0.175 after the
    # repeats, 0.2016 after the 2; over 21 tokens they would be 0.167 and 0.1937. With 1 - top_p = 0.198 transformers
    # keeps the 2, and the short row would drop it: the row must go to transformers.
    assert top_k_top_p._TIES == 16
    their_rows = _count_their_rows(monkeypatch)
    top_k_warper, top_p_warper = _warpers(5, 0.802)
    scores = torch.full((2, 4096), -20.0)
    scores[0] = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    scores[1, [7, 70, 700, 3000]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    scores[1, 100:118] = 1.0
    theirs = top_p_warper(None, top_k_warper(None, scores))
    assert torch.isfinite(theirs[1]).nonzero().flatten().tolist() == [7, 70, 700, 3000]
    assert torch.equal(TopKTopPLogitsWarper(top_k_warper, top_p_warper)(None, scores), theirs)
    assert their_rows == [1]


def test_the_nucleus_sums_match_the_full_row_only_when_aligned():
    # The short row must start at the full row's position modulo the vector blocks: a few positions off, torch adds
    # the scores in other lanes, and the sums differ on a quarter of these rows. Which offsets do depends on the
    # vector width (16 positions off with AVX512, 4 or 8 with AVX2 only, where 16 lands in the same lanes).
    generator = torch.Generator().manual_seed(2)
    ascending = (torch.randn(512, 3, generator=generator) * 3).sort(dim=-1).values
    vocabulary = 4095
    row = torch.full((512, vocabulary), -float("inf"))
    row[:, -3:] = ascending
    full = row.softmax(-1).cumsum(-1)[:, -3:]
    assert torch.equal(top_k_top_p.nucleus_cumulative(ascending, vocabulary), full)
    differing = [
        (top_k_top_p.nucleus_cumulative(ascending, vocabulary + off) != full).any(-1).sum() for off in (4, 8, 16)
    ]
    assert max(differing) > 64


def test_a_torch_that_adds_otherwise_keeps_transformers_warpers(monkeypatch, caplog):
    # A short row that starts elsewhere: other sums with AVX512 (16-float vectors) and with AVX2 only (8-float ones).
    monkeypatch.setattr(top_k_top_p, "_ALIGN", 8)
    top_k_top_p._agrees_with_torch.cache_clear()
    their_rows = _count_their_rows(monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger=top_k_top_p.__name__):
            scores = torch.randn(2, 4096, generator=torch.Generator().manual_seed(3))
            TopKTopPLogitsWarper(*_warpers(50, 0.6))(None, scores)
        assert their_rows == [2]
        assert "sorts every token" in caplog.text
    finally:
        top_k_top_p._agrees_with_torch.cache_clear()


def test_the_pair_of_transformers_warpers_becomes_one_and_the_rest_stays_transformers():
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )

    def built(**settings):
        config = GenerationConfig(do_sample=True, **settings)
        return model._get_logits_processor(config, input_ids_seq_length=1, device="cpu")

    def fused(**settings):
        return [type(p) for p in fused_processors(built(**settings))]

    assert fused(temperature=0.6, top_k=50, top_p=0.6) == [TemperatureLogitsWarper, TopKTopPLogitsWarper]
    assert fused(top_k=50, top_p=1.0) == [TopKLogitsWarper]
    assert fused(top_k=0, top_p=0.6) == [TopPLogitsWarper]
    theirs = built(top_k=50, top_p=0.6)
    assert [type(p) for p in theirs] == [TopKLogitsWarper, TopPLogitsWarper]  # transformers' list is left as it was
    (pair,) = fused_processors(theirs)
    assert (pair.top_k, pair.top_p) == tuple(theirs)  # transformers' warpers, with their settings


def test_whole_generations_are_transformers_own(monkeypatch):
    their_rows = _count_their_rows(monkeypatch)
    filtered = []
    call = TopKTopPLogitsWarper.__call__
    monkeypatch.setattr(TopKTopPLogitsWarper, "__call__", lambda *args: filtered.append(1) or call(*args))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    prompts = torch.randint(1, 4096, (6, 5))
    settings = GenerationConfig(
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        pad_token_id=0,
    )

    def generate(lean: bool):
        torch.manual_seed(1)
        with torch.no_grad():
            if lean:  # our own loop, which filters with `fused_processors`
                ones = torch.ones_like(prompts)
                return lean_generate(model, prompts, ones, sampling_config(model, settings)), torch.get_rng_state()
            return model.generate(prompts, generation_config=settings), torch.get_rng_state()

    theirs, ours = generate(False), generate(True)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert len(filtered) == 16  # every step of our loop filtered with the fused warper
    assert sum(their_rows) < 6 * 16 // 2  # most rows of the 16 steps filtered on the short row
