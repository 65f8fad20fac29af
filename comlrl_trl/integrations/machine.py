"""What a run reports about the machine beside its timings: the CPU's model and a matrix-product rate."""

import time

import torch

from ..precision import cpuinfo_value


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux `/proc/cpuinfo`), or "unknown": benchmark results record it, because the same
    code runs several-fold faster or slower on machines with the same core count."""
    return cpuinfo_value("model name", cpuinfo) or "unknown"


def matmul_gflops(
    dtype: torch.dtype = torch.bfloat16, size: int = 1024, repeats: int = 5, clock=None, device="cpu"
) -> float:
    """The rate of one `size` x `size` matrix product in `dtype` on `device`, in GFLOP/s (on the CPU: on the current
    torch threads; on a GPU each timed product is synchronised).

    The best of `repeats` timed products after one warm-up (2 * size**3 floating-point operations each). Training
    times differ several-fold between machines with the same core count (bf16 units, clock, memory), so a timing is
    reported with this rate beside it. `clock` (default `time.perf_counter`) is for tests.
    """
    clock = clock or time.perf_counter
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    a = torch.randn(size, size).to(device, dtype)
    b = torch.randn(size, size).to(device, dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = clock()
        torch.mm(a, b)
        sync()
        best = min(best, clock() - start)
    return 2 * size**3 / best / 1e9
