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


def check_cpu_bf16_shapes(backbone: torch.nn.Module, sizes: list[int], arch: str) -> None:
    """Refuse bf16 autocast on a CPU for inputs where a strided convolution of ``backbone`` reads a 1x1 map
    (``sizes``: the training size and multi-crop's small size). There oneDNN's bf16 convolution returns
    garbage weight gradients now and then: a 3x3, stride-2, padded convolution of a [64, 256, 1, 1] batch
    gave gradients off by up to 1e38 in some of 200 identical backward passes (PyTorch 2.14, this VM's Xeon;
    none at 2x2 or 4x4), and MoCo v2 with ``--amp --small-crops 2`` (16 px) stopped with a NaN loss in 2 of 7
    runs and trained differently in every other.

    Raises:
        ConfigError: naming the size and the smallest that works.
    """
    from moco_retrieval.trainer.backbones import smallest_strided_map

    for size in sorted(set(sizes)):
        if smallest_strided_map(backbone, size) > 1:
            continue
        works = next((s for s in range(size + 1, 257) if smallest_strided_map(backbone, s) > 1), None)
        raise ConfigError(
            f"--amp on a CPU: at {size} px a strided convolution of {arch} reads a 1x1 map, where bf16 on the "
            f"CPU returns garbage gradients; train without --amp"
            + (f", or at {works} px and more (--image-size, --small-crop-size)" if works else "")
        )


def resolve_amp(requested: bool | None, device: torch.device) -> tuple[bool, str]:
    """``(use bf16 autocast, why)``: as requested, else on for CUDA and off on a CPU."""
    if requested is not None:
        return requested, "--amp" if requested else "--no-amp"
    if device.type == "cuda":
        return True, "GPU"
    return False, CPU_FP32_WHY
