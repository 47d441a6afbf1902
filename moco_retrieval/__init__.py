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
