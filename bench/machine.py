"""What a benchmark ran on, for its JSON: host, cores, Python, the CPU's model and the vector instructions that
decide ONNX Runtime's, FAISS's and PyTorch's speed on it.

Figures of one command differed up to 4x between sessions on machines of the same kind (the encoder of
``bench/search_filters.py classify``: 5,848 images/s on one, 1,382 on an AVX2-only AMD EPYC the next day): a
result without the CPU it ran on cannot be compared with another. Compare figures only within one machine.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

SIMD = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu() -> dict:
    """``{"model": str, "simd": [flags of SIMD the CPU has]}`` from /proc/cpuinfo (Linux), else what
    :mod:`platform` says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "simd": []}
    model, flags = platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model == platform.machine():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model, "simd": [f for f in SIMD if f in flags]}


def machine(**extra) -> dict:
    """The ``machine`` entry of a benchmark's JSON: host, cores, Python, CPU (:func:`cpu`), and ``extra``."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "cpu": cpu(),
        **extra,
    }


if __name__ == "__main__":
    print(machine())
