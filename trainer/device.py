"""Where training runs: the torch device of this process (its GPU under torchrun, else the CPU), and whether
it trains in bfloat16."""

from __future__ import annotations

from pathlib import Path

import torch

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.trainer.config import CPU_FP32_WHY


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this process's GPU when CUDA is usable, else the CPU. Raises ConfigError for an absent GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name} requested but no CUDA GPU is usable here; use --device cpu")
        index = int(name.split(":")[1]) if ":" in name else local_rank
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device cuda:{index} does not exist ({torch.cuda.device_count()} GPUs visible)")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX) rather than emulating it. Recorded by
    the benchmarks; it does not decide the default precision (see :func:`resolve_amp`)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def resolve_amp(requested: bool | None, device: torch.device) -> tuple[bool, str]:
    """``(use bf16 autocast, why)``: as requested, else on for CUDA and off on a CPU."""
    if requested is not None:
        return requested, "--amp" if requested else "--no-amp"
    if device.type == "cuda":
        return True, "GPU"
    return False, CPU_FP32_WHY
