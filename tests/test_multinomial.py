"""Sampling that draws only for the tokens that can be sampled: torch's tokens and random state, bit for bit."""

import logging

import pytest
import torch

from comlrl_trl.fast import multinomial
from comlrl_trl.fast.multinomial import sparse_multinomial


def _top_k_probs(rows: int, vocabulary: int, k: int, seed: int) -> torch.Tensor:
    """Softmax of random logits after top-k: k nonzero entries per row, the rest exactly 0."""
    logits = torch.randn(rows, vocabulary, generator=torch.Generator().manual_seed(seed)) * 3
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter(1, logits.topk(k, dim=-1).indices, True)
    return torch.softmax(logits.masked_fill(~kept, -torch.inf), -1)


def _torch_then_ours(probs: torch.Tensor, ours=None):
    """torch's sample and generator state, then ours (`race` itself unless told) from the same starting state."""
    start = torch.get_rng_state()
    expected = torch.multinomial(probs, 1)
    expected_state = torch.get_rng_state()
    torch.set_rng_state(start)
    sample = ours(probs) if ours else multinomial.race(probs, probs.reshape(-1).nonzero().squeeze(1))
    return expected, expected_state, sample, torch.get_rng_state()


@pytest.mark.parametrize(
    "rows,vocabulary,k",
    [(1, 49152, 50), (8, 49152, 50), (8, 49152, 1), (3, 1000, 200), (33, 151936, 20), (5, 7, 3), (2, 300, 300)],
)
def test_samples_and_random_state_equal_torchs(rows, vocabulary, k):
    torch.manual_seed(rows * 1000 + k)  # a freshly seeded generator: its words are regenerated at the first draw
    for step in range(4):  # and from wherever the previous draws left it
        probs = _top_k_probs(rows, vocabulary, k, seed=step)
        expected, expected_state, ours, state = _torch_then_ours(probs)
        assert torch.equal(ours, expected)
        assert torch.equal(state, expected_state)


def test_the_next_draws_after_sampling_are_torchs():
    probs = _top_k_probs(8, 49152, 50, seed=0)
    torch.manual_seed(3)
    torch.multinomial(probs, 1)
    expected = torch.rand(5)
    torch.manual_seed(3)
    assert sparse_multinomial(probs, 1).shape == (8, 1)
    assert torch.equal(torch.rand(5), expected)


def test_sampling_races_few_candidates_itself(monkeypatch):
    raced = []
    race = multinomial.race
    monkeypatch.setattr(multinomial, "race", lambda *a: raced.append(1) or race(*a))
    probs = _top_k_probs(8, 49152, 50, seed=0)
    expected, expected_state, ours, state = _torch_then_ours(probs, lambda p: sparse_multinomial(p, 1))
    assert raced == [1] and torch.equal(ours, expected) and torch.equal(state, expected_state)


def test_ties_and_rows_with_different_numbers_of_candidates_are_torchs():
    probs = torch.zeros(4, 500)
    probs[0, [3, 7, 11, 400]] = 0.25  # four equal probabilities
    probs[1, 499] = 1.0  # one candidate, at the end of the row
    probs[2, :40] = torch.linspace(1, 2, 40)  # unnormalised weights are fine for torch too
    probs[3, ::50] = 1e-30  # tiny ones
    torch.manual_seed(11)
    for _ in range(20):
        expected, expected_state, ours, state = _torch_then_ours(probs)
        assert torch.equal(ours, expected) and torch.equal(state, expected_state)
        assert ours[1].item() == 499


def test_dense_rows_and_other_calls_are_left_to_torch(monkeypatch):
    raced = []
    race = multinomial.race
    monkeypatch.setattr(multinomial, "race", lambda *a: raced.append(1) or race(*a))
    dense = torch.rand(4, 3000)  # every entry a candidate: every variate is needed anyway
    expected, expected_state, ours, state = _torch_then_ours(dense, lambda p: sparse_multinomial(p, 1))
    assert torch.equal(ours, expected) and torch.equal(state, expected_state)
    sparse = _top_k_probs(4, 30000, 10, seed=1)
    for call in (
        lambda: sparse_multinomial(_top_k_probs(8, 2000, 10, seed=1), 1),  # a small vocabulary
        lambda: sparse_multinomial(sparse, 2),  # two samples
        lambda: sparse_multinomial(sparse, 1, generator=torch.Generator().manual_seed(0)),  # not the default one
        lambda: sparse_multinomial(sparse.double(), 1),
        lambda: sparse_multinomial(sparse[0], 1),  # one row as a vector
        lambda: sparse_multinomial(sparse.t().contiguous().t(), 1),  # columns first in memory
    ):
        call()
    assert raced == []
    generator = torch.Generator().manual_seed(5)
    assert torch.equal(
        sparse_multinomial(sparse, 1, generator=generator),
        torch.multinomial(sparse, 1, generator=torch.Generator().manual_seed(5)),
    )
    sparse_multinomial(sparse, 1)
    assert raced == [1]


@pytest.mark.parametrize(
    "row,message",
    [
        ([0.0, -0.5, 1.0], "probability tensor contains either `inf`, `nan` or element < 0"),
        ([0.0, float("nan"), 1.0], "probability tensor contains either `inf`, `nan` or element < 0"),
        ([0.0, float("inf"), 1.0], "probability tensor contains either `inf`, `nan` or element < 0"),
        ([0.0, 0.0, 0.0], "invalid multinomial distribution"),
    ],
)
def test_invalid_probabilities_raise_torchs_error(row, message):
    probs = torch.zeros(2, 40000)
    probs[0, :5] = 0.2
    probs[1, :3] = torch.tensor(row)
    with pytest.raises(RuntimeError, match=message.replace("`", ".")):
        sparse_multinomial(probs, 1)


def test_a_zero_probability_entry_whose_variate_is_zero_wins_as_in_torch(monkeypatch):
    """torch's race scores such an entry 0/0 = NaN and its argmax takes the NaN (odds 2**-53 per entry, so the
    uniform is forced here): entry 2, whose uniform is 0, beats entry 0, the only candidate."""
    real = multinomial._uniforms

    def forced(count):
        u = real(count)
        u[2] = 0.0
        return u

    monkeypatch.setattr(multinomial, "_uniforms", forced)
    probs = torch.zeros(2, 10)
    probs[:, 0] = 1.0
    assert multinomial.race(probs, torch.tensor([0, 10])).flatten().tolist() == [2, 0]


def test_the_first_of_equal_scores_wins_as_in_torch(monkeypatch):
    """Equal p / q in a row (equal probabilities, forced equal uniforms): torch's argmax takes the first."""
    monkeypatch.setattr(multinomial, "_uniforms", lambda count: torch.full((count,), 0.5, dtype=torch.float64))
    probs = torch.zeros(3, 10)
    probs[0, [3, 7]] = 0.5
    probs[1, [1, 4, 6]] = torch.tensor([0.25, 0.5, 0.25])
    probs[2, [8, 9]] = 0.5
    candidates = probs.reshape(-1).nonzero().squeeze(1)
    assert multinomial.race(probs, candidates).flatten().tolist() == [3, 4, 8]


def test_a_torch_that_draws_otherwise_keeps_its_own_sampling_with_a_warning(monkeypatch, caplog):
    multinomial._agrees_with_torch.cache_clear()
    monkeypatch.setattr(multinomial, "race", lambda probs, candidates: candidates[:1].expand(probs.shape[0], 1))
    probs = _top_k_probs(8, 10000, 50, seed=2)
    try:
        with caplog.at_level(logging.WARNING, logger="comlrl_trl.fast.multinomial"):
            expected, expected_state, ours, after = _torch_then_ours(probs, lambda p: sparse_multinomial(p, 1))
        assert torch.equal(ours, expected) and torch.equal(after, expected_state)
        assert "this torch build draws otherwise" in caplog.text
    finally:
        multinomial._agrees_with_torch.cache_clear()


def test_the_check_against_torch_leaves_the_generator_where_it_was():
    multinomial._agrees_with_torch.cache_clear()
    state = torch.get_rng_state()
    assert multinomial._agrees_with_torch()
    assert torch.equal(torch.get_rng_state(), state)


def test_generation_samples_the_same_tokens_as_transformers(qwen_path, monkeypatch):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from comlrl_trl.fast.decoding import lean_generate, sampling_config

    raced = []
    race = multinomial.race
    monkeypatch.setattr(multinomial, "race", lambda *a: raced.append(1) or race(*a))
    monkeypatch.setattr(multinomial, "_MIN_ENTRIES", 0)  # the test model's vocabulary is small
    model = AutoModelForCausalLM.from_pretrained(qwen_path)
    prompt = torch.tensor([[5, 9, 14, 3, 7]] * 6)
    settings = GenerationConfig(
        do_sample=True, max_new_tokens=16, min_new_tokens=16, top_k=50, top_p=0.6, temperature=0.6
    )

    def generate(lean: bool):
        torch.manual_seed(7)
        with torch.no_grad():
            if lean:  # our own loop, which draws with `sparse_multinomial`
                ones = torch.ones_like(prompt)
                return lean_generate(model, prompt, ones, sampling_config(model, settings)), torch.get_rng_state()
            return model.generate(prompt, generation_config=settings), torch.get_rng_state()

    (plain, plain_state), (ours, our_state) = generate(False), generate(True)
    assert len(raced) == 16  # every step of our loop raced the kept tokens itself
    assert torch.equal(ours, plain) and torch.equal(our_state, plain_state)


def test_agents_sample_through_it_on_a_cpu(make_team, monkeypatch):
    from comlrl_trl.generation.cpu import LeanCpuGeneration  # the generator whose loop draws with it

    trainer = make_team(use_cpu=True)
    raced = []
    race = multinomial.race
    monkeypatch.setattr(multinomial, "race", lambda *a: raced.append(1) or race(*a))
    monkeypatch.setattr(multinomial, "_MIN_ENTRIES", 0)  # the test models' vocabulary is small
    for agent in trainer.agent_trainers:
        raced.clear()
        LeanCpuGeneration([agent])([["Write a story about item 1:"] * 4])[0]
        assert raced  # top-k 50 (the default) leaves few candidates: every decoding step races them
    assert torch.multinomial is multinomial._TORCH_MULTINOMIAL  # torch's own, never replaced
