"""Two fixed costs of transformers' and Accelerate's generation code that do not depend on the model, taken out.

- `LogitsProcessorList.__call__` runs `inspect.signature` on every processor at every decoding step, to see whether
  it takes keyword arguments beyond `(input_ids, scores)`. A processor's `__call__` is its class's, so
  `processors_called_by_class` asks once per class and then calls the processors exactly as transformers does: with
  the keyword arguments where the signature has more parameters (and the same `ValueError` when one is missing),
  without them otherwise. A processor whose instance carries its own `__call__` is inspected at every call, as in
  transformers.
- `Accelerator.unwrap_model`, which TRL calls once per `generate` call, asks `accelerate.utils.is_deepspeed_available`
  whether DeepSpeed is installed, and that reads the package's metadata from disk each time (0.9 ms).
  `_deepspeed_available` answers from the first answer of this process.

On the tiny test model (two agents, 16 new tokens) the two took 2.4% and 1.7% of `train()` in a sampling profile
(docs/benchmarks.md, "Where the tiny model's time goes").
"""

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import accelerate.utils.other
import torch
from transformers.generation.logits_process import LogitsProcessorList

from ..adapters.helpers import attribute_replaced


_PARAMETERS_BY_CLASS: dict[type, tuple[str, ...]] = {}


def _call_parameters(processor) -> tuple[str, ...]:
    """The parameter names of `processor.__call__`, as transformers inspects them: once per class, unless the
    instance carries its own `__call__`."""
    if "__call__" in getattr(processor, "__dict__", ()):
        return tuple(inspect.signature(processor.__call__).parameters)
    cls = type(processor)
    if cls not in _PARAMETERS_BY_CLASS:
        _PARAMETERS_BY_CLASS[cls] = tuple(inspect.signature(processor.__call__).parameters)
    return _PARAMETERS_BY_CLASS[cls]


def processors_called_by_class(processors, input_ids: torch.LongTensor, scores: torch.Tensor, **kwargs):
    """`LogitsProcessorList.__call__` (transformers 5), with each processor's signature looked up once per class."""
    for processor in processors:
        parameters = _call_parameters(processor)
        if len(parameters) > 2:
            if not all(name in kwargs for name in parameters[2:]):
                raise ValueError(
                    f"Make sure that all the required parameters: {list(parameters)} for "
                    f"{processor.__class__} are passed to the logits processor."
                )
            scores = processor(input_ids, scores, **kwargs)
        else:
            scores = processor(input_ids, scores)
    return scores


@functools.cache
def _deepspeed_available() -> bool:
    return _ACCELERATE_CHECK()


_ACCELERATE_CHECK = accelerate.utils.other.is_deepspeed_available


@contextmanager
def fewer_fixed_costs() -> Iterator[None]:
    """A block (one `generate` call) in which logits processors are inspected once per class and Accelerate's
    DeepSpeed check answers from memory."""
    with (
        attribute_replaced(LogitsProcessorList, "__call__", processors_called_by_class),
        attribute_replaced(accelerate.utils.other, "is_deepspeed_available", _deepspeed_available),
    ):
        yield
