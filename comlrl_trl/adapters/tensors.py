"""torch internals the CPU speed-ups read (`comlrl_trl/fast/`), kept among the adapters (`tests/test_trl_boundary.py`)."""

import torch


def tensor_version(tensor: torch.Tensor) -> int:
    """torch's count of in-place changes of `tensor` (its `_version`): a frozen weight changed in place has a new one."""
    return tensor._version
