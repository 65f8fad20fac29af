"""Which precision a run trains and samples in, from what the device does fast: the configurations' bf16 default, the
autocast of forwards beside the agents' own, fp16 on a CPU, and the colocated vLLM engines' dtype."""

import functools
import os

import torch
from accelerate.utils import DistributedType
from transformers.utils import is_torch_bf16_gpu_available


# CPU flags (Linux /proc/cpuinfo) of native bf16 matrix products: Intel AMX tiles, and AVX512-BF16 (Intel Cooper
# Lake and later, AMD Zen 4 and later). Without them PyTorch emulates bf16 and mixed precision is slower than fp32.
_CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def bf16_is_fast(use_cpu: bool) -> bool:
    """Whether bf16 mixed precision pays off on the device training will run on.

    On the CPU (`use_cpu`, or no accelerator): the CPU must have AMX or AVX512-BF16. On an accelerator: the
    accelerator must support bf16 (`transformers.utils.is_torch_bf16_gpu_available`).
    """
    if use_cpu or not torch.accelerator.is_available():
        return cpu_has_fast_bf16()
    return is_torch_bf16_gpu_available()


@functools.cache
def cpu_has_fast_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX-BF16 or AVX512-BF16 (read from `cpuinfo`; False where it is absent)."""
    flags = (cpuinfo_value("flags", cpuinfo) or "").split()
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def cpuinfo_value(key: str, cpuinfo: str) -> str | None:
    """The value of the first `key: value` line of `cpuinfo`, stripped; None where the file or the line is absent."""
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


# Below this hidden size a model's matrix products are too small for bf16 to gain on a CPU: autocast's casts then
# cost more than they save (measured: the tiny test models, hidden size 32-48, train about 20% slower under bf16;
# SmolLM2-135M, hidden size 576, generates 2.3x and runs forward and backward 2.8x faster).
CPU_BF16_MIN_HIDDEN_SIZE = 256


def cpu_bf16_pays_off(models) -> bool:
    """Whether every model (a `PreTrainedModel`, PEFT model or a path/id readable by `AutoConfig`) is large enough
    for bf16 autocast to speed it up on a CPU."""
    return all(_hidden_size(model) >= CPU_BF16_MIN_HIDDEN_SIZE for model in models)


def _hidden_size(model) -> int:
    """The model's hidden size; where it cannot be read (e.g. a directory holding only a LoRA adapter), the
    threshold itself, so that the device default stands."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError):
            return CPU_BF16_MIN_HIDDEN_SIZE
    else:
        config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "hidden_size", CPU_BF16_MIN_HIDDEN_SIZE)


def training_autocast(accelerator, bf16: bool):
    """The autocast of a forward outside the agents' own loss: bf16 when the run trains in bf16.

    Accelerate's `autocast()` is a no-op under DeepSpeed (its engines cast the modules they hold to bf16 themselves),
    so a model beside the engines (a critic with its own optimiser, fp32 master weights) would run in fp32 there:
    torch's own bf16 autocast is used instead. Elsewhere it is Accelerate's (bf16 or fp16, or none).
    """
    if bf16 and not accelerator.native_amp:
        return torch.autocast(device_type=accelerator.device.type, dtype=torch.bfloat16)
    return accelerator.autocast()


def enable_cpu_fp16(accelerator) -> None:
    """Give an Accelerator told `fp16` on a CPU what it gives one on a GPU: fp16 autocast and its own loss scaler.

    Accelerate ignores `mixed_precision="fp16"` on a CPU (no scaler, no autocast: the run silently trains in fp32).
    torch has fp16 autocast and a `GradScaler` on the CPU too, so the same path as on a GPU is switched on here: the
    forward under fp16 autocast, `scaler.scale(loss).backward()` (`accelerator.backward`), the gradients unscaled
    before clipping (`accelerator.clip_grad_norm_`), and `scaler.step`/`scaler.update` in the prepared optimiser,
    which skips the step when a gradient is inf or nan and halves the scale. Call it before the optimiser is
    prepared (the prepared optimiser takes the accelerator's scaler). A no-op elsewhere, and under DeepSpeed (its own
    fp16 loss scaling).
    """
    if (
        accelerator.mixed_precision != "fp16"
        or accelerator.device.type != "cpu"
        or accelerator.scaler is not None
        or accelerator.distributed_type == DistributedType.DEEPSPEED
    ):
        return
    if not torch.amp.is_autocast_available("cpu"):
        raise ValueError("fp16=True on a CPU needs torch's CPU autocast; this torch build has none. Use bf16 or fp32.")
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")


def rollout_dtype(fp16: bool, bf16: bool) -> str:
    """The dtype of the team's colocated vLLM engines: the training forward's (fp16 or bf16), else the checkpoint's.

    Sampling in the precision the loss forward runs in keeps the training-inference mismatch small (fp16's 10
    mantissa bits against bf16's 7; docs/scaling.md, "Precision on GPUs")."""
    return "float16" if fp16 else "bfloat16" if bf16 else "auto"
