"""The fixed costs taken out of a `generate` call (`fast/call_overheads.py`): the same processing, fewer lookups."""

import inspect

import accelerate.utils.other
import pytest
import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from comlrl_trl.fast import call_overheads
from comlrl_trl.fast.call_overheads import fewer_fixed_costs


TRANSFORMERS_CALL = LogitsProcessorList.__call__


class AddsOffset(LogitsProcessor):
    """A processor with a keyword argument of its own, as transformers' processors for other modes have."""

    def __call__(self, input_ids, scores, offset):
        return scores + offset


class Doubles(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * 2


def test_the_processed_scores_are_transformers_own():
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(5), TopPLogitsWarper(0.6)])
    scores = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    input_ids = torch.zeros(4, 3, dtype=torch.long)
    expected = TRANSFORMERS_CALL(processors, input_ids, scores.clone())
    with fewer_fixed_costs():
        ours = processors(input_ids, scores.clone())
    assert LogitsProcessorList.__call__ is TRANSFORMERS_CALL
    assert torch.equal(ours, expected)
    assert 0 < int(torch.isfinite(ours).sum(dim=-1).max()) <= 5  # top-k and top-p did filter


def test_a_processor_gets_its_keyword_arguments_and_a_missing_one_is_the_same_error():
    processors = LogitsProcessorList([AddsOffset(), Doubles()])
    scores, input_ids = torch.ones(2, 3), torch.zeros(2, 1, dtype=torch.long)
    with fewer_fixed_costs():
        assert torch.equal(processors(input_ids, scores, offset=1.5), torch.full((2, 3), 5.0))
        with pytest.raises(ValueError, match=r"required parameters: \['input_ids', 'scores', 'offset'\]"):
            processors(input_ids, scores)
    with pytest.raises(ValueError, match=r"required parameters: \['input_ids', 'scores', 'offset'\]"):
        processors(input_ids, scores)  # transformers' own message, for the same call


def test_each_processor_class_is_inspected_once(monkeypatch):
    class Fresh(LogitsProcessor):  # a class no earlier test has inspected
        def __call__(self, input_ids, scores):
            return scores + 1

    inspected = []
    signature = inspect.signature

    def counting(obj, *args, **kwargs):
        inspected.append(obj)
        return signature(obj, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    processors = LogitsProcessorList([Fresh(), Fresh()])
    with fewer_fixed_costs():
        for _ in range(5):
            out = processors(None, torch.zeros(1, 2))
    assert torch.equal(out, torch.full((1, 2), 2.0))  # both instances ran at every call
    assert len(inspected) == 1
    TRANSFORMERS_CALL(processors, None, torch.zeros(1, 2))
    assert len(inspected) == 3  # transformers inspects each processor at each call


def test_an_instance_with_its_own_call_is_inspected_as_transformers_does():
    processor = Doubles()
    processor.__call__ = lambda input_ids, scores, offset: scores  # what transformers inspects, not what it calls
    processors = LogitsProcessorList([processor])
    with fewer_fixed_costs(), pytest.raises(ValueError, match="offset"):
        processors(None, torch.ones(1, 2))
    with pytest.raises(ValueError, match="offset"):
        processors(None, torch.ones(1, 2))


def test_accelerate_asks_for_deepspeed_once_while_unwrapping_for_generation(monkeypatch):
    asked = []
    monkeypatch.setattr(call_overheads, "_ACCELERATE_CHECK", lambda: asked.append(1) or False)
    call_overheads._deepspeed_available.cache_clear()
    original = accelerate.utils.other.is_deepspeed_available
    model = nn.Linear(2, 2)
    try:
        with fewer_fixed_costs():
            for _ in range(3):
                assert extract_model_from_parallel(model) is model  # what `Accelerator.unwrap_model` calls
    finally:
        call_overheads._deepspeed_available.cache_clear()
    assert asked == [1]  # the seam is still there, and answered once
    assert accelerate.utils.other.is_deepspeed_available is original


def test_the_originals_are_back_after_an_error():
    original = accelerate.utils.other.is_deepspeed_available
    with pytest.raises(RuntimeError, match="inside"), fewer_fixed_costs():
        raise RuntimeError("inside")
    assert LogitsProcessorList.__call__ is TRANSFORMERS_CALL
    assert accelerate.utils.other.is_deepspeed_available is original
