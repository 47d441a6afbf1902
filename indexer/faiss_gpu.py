"""FAISS on GPUs, when this FAISS build sees any: cloning for IVF training / adding, and GPU copies for
search; every guard in one place, so that the CPU path is what runs whenever a GPU cannot.

Guards (each falls back to the CPU index, with a logged reason):

- no GPU (``faiss.get_num_gpus() == 0``, or a CPU-only FAISS build): CPU;
- HNSW: FAISS has no GPU HNSW;
- IVF with on-disk inverted lists: the lists are larger than memory by design, they stay on disk;
- a search deeper than ``GPU_MAX_K`` (2048) neighbours, or with nprobe above it: that query runs on the CPU
  copy (FAISS GPU kernels stop at 2048);
- the clone itself failing (an index type or size the GPU cannot host): CPU.

The stored index is always the CPU one (``index_gpu_to_cpu`` after a GPU build), so every machine can read it.
``gpu_count`` and the cloners are parameters, so the guards are tested with the CPU build.
"""

from __future__ import annotations

import logging
from typing import Callable

import faiss
import numpy as np

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.indexer.searcher import GPU_MAX_K, unwrap

LOG = logging.getLogger(__name__)

GPU_MODES = ("auto", "none", "one", "all")  # search: auto = all GPUs when there are any


def gpu_count() -> int:
    """GPUs this FAISS build can use (0 for a CPU-only build)."""
    try:
        return int(faiss.get_num_gpus())
    except AttributeError:  # a CPU-only FAISS build
        return 0


def clone_for_build(
    index: faiss.Index, gpus: int | None = None, cloner: Callable | None = None
) -> tuple[faiss.Index, bool]:
    """``(index on GPU 0, True)`` for IVF training and adding, or ``(index, False)`` where that cannot be."""
    if (gpu_count() if gpus is None else gpus) <= 0:
        return index, False
    if faiss.try_extract_index_ivf(index) is None:
        return index, False
    try:
        if cloner is None:
            options = faiss.GpuClonerOptions()
            options.useFloat16 = True  # IVF-PQ lookup tables with many sub-quantizers need it
            work = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index, options)
        else:
            work = cloner(index)
        return work, True
    except (RuntimeError, AttributeError) as exc:
        LOG.warning("building on CPU: the GPU cannot host this index (%s)", str(exc).splitlines()[-1])
        return index, False


def to_cpu(index: faiss.Index) -> faiss.Index:
    """The CPU copy of a GPU index (what is stored)."""
    return faiss.index_gpu_to_cpu(index)


def search_refusal(index: faiss.Index, on_disk: bool) -> str | None:
    """Why ``index`` must be searched on the CPU, or ``None`` when a GPU copy can serve it."""
    if hasattr(unwrap(index), "hnsw"):
        return "FAISS has no GPU HNSW"
    if on_disk:
        return "its inverted lists are on disk"
    ivf = faiss.try_extract_index_ivf(index)
    inner = unwrap(index)
    if ivf is None and not isinstance(inner, faiss.IndexFlat):
        return f"{type(inner).__name__} is not a Flat or IVF index"
    return None


class GpuCopy:
    """A GPU copy of a CPU index for search: one GPU, or sharded over all of them."""

    def __init__(self, gpu_index: faiss.Index, params: dict, gpus: int):
        self.index = gpu_index
        self.gpus = gpus
        self.nprobe = int(params.get("nprobe", 0))
        if self.nprobe:
            try:
                faiss.GpuParameterSpace().set_index_parameter(gpu_index, "nprobe", self.nprobe)
            except (RuntimeError, AttributeError):
                faiss.ParameterSpace().set_index_parameter(gpu_index, "nprobe", self.nprobe)

    def can_search(self, k: int) -> bool:
        return k <= GPU_MAX_K and self.nprobe <= GPU_MAX_K

    def search(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(xq, k)


def gpu_copy_for_search(
    index: faiss.Index,
    params: dict,
    mode: str = "auto",
    on_disk: bool = False,
    gpus: int | None = None,
    cloner: Callable | None = None,
) -> GpuCopy | None:
    """A :class:`GpuCopy` of ``index`` per ``mode`` (auto, none, one, all), or ``None`` for CPU search.

    Args:
        gpus: GPUs to assume (default: what FAISS sees); cloner: ``(index, all_gpus: bool) -> gpu index``
            instead of FAISS's cloners (tests).

    Raises:
        ConfigError: an unknown mode, or ``one`` / ``all`` asked for where FAISS sees no GPU.
    """
    if mode not in GPU_MODES:
        raise ConfigError(f"--faiss-gpu must be one of {', '.join(GPU_MODES)}, got {mode!r}")
    if mode == "none":
        return None
    n = gpu_count() if gpus is None else gpus
    if n <= 0:
        if mode != "auto":
            raise ConfigError(f"--faiss-gpu {mode}: this FAISS build sees no GPU; use --faiss-gpu none or auto")
        return None
    reason = search_refusal(index, on_disk)
    if reason is not None:
        LOG.info("searching on the CPU: %s", reason)
        return None
    all_gpus = mode in ("auto", "all") and n > 1
    try:
        if cloner is not None:
            gpu_index = cloner(index, all_gpus)
        elif all_gpus:
            options = faiss.GpuMultipleClonerOptions()
            options.shard = True  # split the vectors over the GPUs (memory), queries go to all of them
            options.useFloat16 = True
            gpu_index = faiss.index_cpu_to_all_gpus(index, co=options)
        else:
            options = faiss.GpuClonerOptions()
            options.useFloat16 = True
            gpu_index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index, options)
    except (RuntimeError, AttributeError, MemoryError) as exc:
        LOG.warning("searching on the CPU: the GPU cannot host this index (%s)", str(exc).splitlines()[-1])
        return None
    LOG.info("searching on %s", f"{n} GPUs (sharded)" if all_gpus else "GPU 0")
    return GpuCopy(gpu_index, params, n if all_gpus else 1)


__all__ = [
    "GPU_MAX_K",
    "GPU_MODES",
    "gpu_count",
    "clone_for_build",
    "to_cpu",
    "search_refusal",
    "GpuCopy",
    "gpu_copy_for_search",
]
