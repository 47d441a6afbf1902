"""The Python API: the few objects a program needs, re-exported from ``moco_retrieval`` (see docs/API.md).

    Encoder.open(path).embed(images)             images -> L2-normalized float32 [N, D] embeddings
    Index.open(index_dir).search(queries, k)      images or vectors -> their nearest indexed items (min_score,
                                                  labels, path_prefix, exclude: thresholds and filters)
    Index.open(index_dir).classify(images, k)     k-NN label votes
    build_index(image_dir, model, out, ...)       ``moco index`` (new index or incremental update)
    train(TrainConfig(data_dir=..., out_dir=...)) ``moco train``
    export(run_dir, "encoder.onnx")               ``moco export`` (verified against PyTorch)

Everything else in the package is internal: its names may change between versions. Importing this module
imports neither torch nor the indexer: each object loads what it needs when it is first used.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

__all__ = ["Encoder", "Index", "build_index", "train", "export", "TrainConfig", "IndexConfig"]  # noqa: F822 (lazy)


class Encoder:
    """An encoder file written by ``moco export``: images in, L2-normalized embeddings out (ONNX Runtime).

    Attributes:
        path, sha256: the file and its digest. image_size: its input side. embedding_dim: D.
        metadata: the file's metadata (arch, MoCo version, preprocessing, ...). provider: where it runs.
    """

    def __init__(self, onnx_encoder):
        self._encoder = onnx_encoder

    @classmethod
    def open(cls, path: str | os.PathLike, device: str = "auto", threads: int | None = None) -> Encoder:
        """Open ``path`` on ``device`` (``auto``: a GPU when ONNX Runtime can use one, else the CPU).

        Raises:
            ArtifactError: not an encoder file of ``moco export``. ConfigError: ``cuda`` asked for but unusable.
        """
        from moco_retrieval.indexer.encoder import OnnxEncoder

        return cls(OnnxEncoder(path, device=device, threads=threads))

    def __getattr__(self, name: str):
        if name in ("path", "sha256", "image_size", "embedding_dim", "metadata", "provider"):
            return getattr(self._encoder, name)
        raise AttributeError(name)

    def embed(self, images: Sequence, batch_size: int = 64) -> np.ndarray:
        """Embed image files, encoded bytes or PIL images (decoded and resized as the model declares), or a
        ready uint8 ``[N, H, W, 3]`` array: float32 ``[N, D]``, rows L2-normalized.

        Raises:
            DataError: an image that does not decode (the message names it), or an array of the wrong shape.
        """
        if isinstance(images, np.ndarray):
            return self._encoder.embed(images)
        images = list(images)
        parts = [self._encoder.embed_images(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
        return np.concatenate(parts) if parts else np.zeros((0, self.embedding_dim), dtype=np.float32)

    def __repr__(self) -> str:
        return repr(self._encoder).replace("OnnxEncoder", "Encoder", 1)


class Index:
    """The live generation of an index directory, searchable (it follows ``moco index`` updates when
    ``follow_updates`` is set). Use as a context manager, or call :meth:`close`.

    Results are item records: ``id``, ``path`` (relative to the image folder), ``label``, ``width``,
    ``height``, ``bytes``, ``sha256``, ... and ``score``, the cosine similarity to the query, best first.
    """

    def __init__(self, engine):
        self._engine = engine

    @classmethod
    def open(
        cls,
        index_dir: str | os.PathLike,
        device: str = "auto",
        model: str | os.PathLike | None = None,
        follow_updates: bool = False,
    ) -> Index:
        """Open ``index_dir`` with the encoder it was built with (or ``model``, which must be that encoder).

        Raises:
            ArtifactError: not an index directory, or ``model`` did not make its vectors.
        """
        from moco_retrieval.serve.engine import EngineConfig, SearchEngine

        config = EngineConfig(
            device=device, model=None if model is None else str(model), poll_seconds=1.0 if follow_updates else 0
        )
        return cls(SearchEngine(index_dir, config))

    def search(
        self,
        queries,
        k: int | None = None,
        min_score: float | None = None,
        labels: Sequence[str] = (),
        path_prefix: str | None = None,
        exclude: Sequence[int] = (),
    ) -> list[list[dict]]:
        """The nearest items of each query: a float32 ``[n, D]`` array of L2-normalized vectors, or a sequence of
        images (file paths, encoded bytes, PIL images). One list of records (with ``score``) per query, in order.

        Args:
            k: how many (default 10; with ``min_score``, at most this many, default 1,000).
            min_score: every item at least this similar (cosine, in [-1, 1]) instead of a fixed k.
            labels, path_prefix, exclude: only items with one of these labels, whose relative path starts with
                ``path_prefix`` (a folder: ``"shoes/"``), never these ids.

        Raises:
            DataError: an image that does not decode, or vectors of another dimension. ConfigError: bad k or
            min_score, a label the index does not have.
        """
        flt = self._filter(labels, path_prefix, exclude)
        if isinstance(queries, np.ndarray):
            results = self._engine.search_vectors(queries, k, min_score, flt)
        else:
            results = self._engine.search(list(queries), k, min_score, flt)
        return [res.hits for res in results]

    def neighbours(
        self,
        item_id: int,
        k: int | None = None,
        min_score: float | None = None,
        labels: Sequence[str] = (),
        path_prefix: str | None = None,
        exclude: Sequence[int] = (),
    ) -> list[dict]:
        """The items nearest to the indexed item ``item_id`` (itself left out); options as :meth:`search`."""
        return self._engine.search_by_id(item_id, k, min_score, self._filter(labels, path_prefix, exclude)).hits

    def duplicates(self, item_id: int, threshold: float = 0.95) -> list[dict]:
        """The near-duplicates of item ``item_id``: every item at least ``threshold`` similar (re-encodes, crops,
        resizes of one photo; ``moco duplicates`` groups a whole index)."""
        return self._engine.duplicates(item_id, threshold).hits

    def classify(self, images: Iterable, k: int = 20) -> list[tuple[str | None, dict[str, float]]]:
        """``(label, {label: probability})`` of each image, by a vote of its ``k`` nearest labeled items."""
        return [(res.label, res.probabilities) for res in self._engine.classify(list(images), k)]

    @staticmethod
    def _filter(labels, path_prefix, exclude):
        from moco_retrieval.serve.search_filter import SearchFilter

        flt = SearchFilter(labels=tuple(labels), path_prefix=path_prefix, exclude=tuple(int(i) for i in exclude))
        return flt or None

    def item(self, item_id: int) -> dict:
        """The record of item ``item_id``. Raises UnknownItemError."""
        return self._engine.item(item_id)

    def __len__(self) -> int:
        return self._engine.item_count()

    @property
    def labels(self) -> dict[str, int]:
        return self._engine.labels()

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_index(image_dir: str | os.PathLike, model: str | os.PathLike, out: str | os.PathLike, **options):
    """``moco index IMAGE_DIR --model MODEL --out OUT``: embed the folder into a new index directory, or update
    ``out`` with what changed. ``options`` are :class:`IndexConfig` fields (``index_type``, ``batch_size``,
    ``workers``, ``device``, ``rebuild``, ...). Returns the run's ``IndexResult`` (counts, timings)."""
    from moco_retrieval.indexer.build import IndexConfig, build_index_dir

    options.setdefault("progress", False)
    return build_index_dir(IndexConfig(str(image_dir), str(model), str(out), **options))


def train(config):
    """``moco train``: train a MoCo encoder as ``config`` (a :class:`TrainConfig`) says; returns the run's
    ``TrainResult`` (run directory, steps, final k-NN accuracy). Export it with ``moco export``."""
    from moco_retrieval.trainer.train import train as _train

    return _train(config)


def export(
    run: str | os.PathLike,
    out: str | os.PathLike,
    fp16: bool = False,
    image_size: int | None = None,
    mirror_average: bool | None = None,
):
    """``moco export RUN --out OUT``: the run's (or checkpoint's) encoder as an ONNX file, checked against
    PyTorch before it is written; returns the ``ExportResult`` (path, metadata, measured differences).
    ``image_size``: the side it embeds at (default: ``moco export``'s, :mod:`trainer.embedding_size`);
    ``mirror_average``: average each image with its mirror (default: ``moco export``'s,
    :mod:`trainer.mirror_average`)."""
    from moco_retrieval.trainer.export import export_encoder

    return export_encoder(run, out, fp16=fp16, image_size=image_size, mirror_average=mirror_average)


def __getattr__(name: str):
    if name == "TrainConfig":
        from moco_retrieval.trainer.config import TrainConfig

        return TrainConfig
    if name == "IndexConfig":
        from moco_retrieval.indexer.build import IndexConfig

        return IndexConfig
    raise AttributeError(name)
