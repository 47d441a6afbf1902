"""moco-retrieval: self-supervised MoCo v2/v3 image representations, exported to ONNX, indexed with FAISS and
served over HTTP. Every module of the project lives under this one name:

    moco_retrieval.contracts   what every stage shares (errors, image rules, file formats, atomic writes)
    moco_retrieval.trainer     ``moco train``, ``moco export``, ``moco eval`` (PyTorch)
    moco_retrieval.indexer     ``moco index`` (ONNX Runtime, FAISS, LMDB; no torch)
    moco_retrieval.serve       the search engine and the HTTP API (no torch)
    moco_retrieval.app         the ``moco`` command line and the Gradio UI

``python -m moco_retrieval`` is the ``moco`` command.
"""

from __future__ import annotations

try:
    from importlib.metadata import PackageNotFoundError as _NotFound, version as _version

    __version__ = _version("moco-retrieval")
except _NotFound:  # a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["Encoder", "Index", "build_index", "train", "export", "TrainConfig", "IndexConfig", "__version__"]


def __getattr__(name: str):
    """The public API (:mod:`moco_retrieval.api`), imported when first used: ``import moco_retrieval`` stays
    free of torch, ONNX Runtime and FAISS."""
    if name in __all__:
        from moco_retrieval import api

        return getattr(api, name)
    raise AttributeError(f"module 'moco_retrieval' has no attribute {name!r}")
