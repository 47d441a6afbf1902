"""Turning the files of a plan into vectors in work shards: the encoder side of ``moco index``.

An *embedder* is what :func:`indexer.build.build_index_dir` needs from a model: ``encoder`` (an object with
``path``, ``sha256``, ``embedding_dim``, ``metadata`` and ``provider``, e.g. an ``OnnxEncoder``) and
``embed_into(entries, shards, progress) -> stats``, which puts a result for every entry no finished shard
holds yet into the shards. :class:`FolderEmbedder` is the real one: worker processes read, hash, decode and
resize (:mod:`indexer.decode`), this process batches the pixels through the ONNX encoder, two batches at once
on the CPU (:mod:`indexer.encoder_lanes`). The scale benchmark (``bench/index_scale.py``) passes one that
makes synthetic vectors instead, and everything after the encoder runs as it does for images.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.indexer.decode import decode_files
from moco_retrieval.indexer.encoder import OnnxEncoder
from moco_retrieval.indexer.encoder_lanes import embed_in_order
from moco_retrieval.contracts.images import FoundFile
from moco_retrieval.indexer.shards import WorkShards

LOG = logging.getLogger(__name__)


class Embedder(Protocol):
    """What ``moco index`` needs from a model (see the module docstring)."""

    encoder: OnnxEncoder  # or anything with its path, sha256, embedding_dim, metadata and provider

    def embed_into(self, entries: list[FoundFile], shards: WorkShards, progress: bool = True) -> dict:
        """Put a result for every entry no finished shard holds into ``shards``; returns ``embedded`` and
        ``resumed`` (counts) and seconds per phase (``embed``, ``encoder`` (busy time per lane), ``decode_wait``,
        ``decode_cpu``)."""
        ...


class FolderEmbedder:
    """Embeds image files under ``image_root`` with ``encoder``, ``batch_size`` images per encoder call and
    ``lanes`` calls at once (:mod:`indexer.encoder_lanes`), decoded by ``workers`` processes (0: in this
    process)."""

    def __init__(self, encoder: OnnxEncoder, image_root: Path, batch_size: int, workers: int, lanes: int = 1):
        self.encoder = encoder
        self.image_root = Path(image_root)
        self.batch_size = batch_size
        self.workers = workers
        self.lanes = lanes

    def embed_into(self, entries: list[FoundFile], shards: WorkShards, progress: bool = True) -> dict:
        """Embed every entry no finished shard holds; returns counts and where the time went."""
        from tqdm import tqdm

        encoder = self.encoder
        pending = [e for e in entries if shards.lookup(e.path, e.bytes, e.mtime_ns) is None]
        resumed = len(entries) - len(pending)
        stats = {
            "embedded": len(pending),
            "resumed": resumed,
            "embed": 0.0,
            "decode_wait": 0.0,
            "encoder": 0.0,
            "decode_cpu": 0.0,
        }
        if not pending:
            return stats
        by_path = {e.path: e for e in pending}
        bar = tqdm(
            total=len(entries),
            initial=resumed,
            unit="img",
            desc="embedding",
            disable=not progress,
            dynamic_ncols=True,
            smoothing=0.1,
        )

        def batches():  # (decoded files, their pixels) of batch_size readable files; unreadable ones stored at once
            batch: list = []
            while True:
                tic = time.perf_counter()
                d = next(stream, None)
                stats["decode_wait"] += time.perf_counter() - tic
                if d is None:
                    break
                stats["decode_cpu"] += d.seconds
                if d.pixels is None:
                    LOG.warning("skipping %s: %s", display_name(d.path), d.error)
                    shards.add(shard_entry(by_path[d.path], d), None)
                    bar.update(1)
                    continue
                batch.append(d)
                if len(batch) >= self.batch_size:
                    yield batch, np.stack([b.pixels for b in batch])
                    batch = []
            if batch:
                yield batch, np.stack([b.pixels for b in batch])

        tic_all = time.perf_counter()
        stream = decode_files(
            self.image_root, [e.path for e in pending], encoder.image_size, encoder.resize, self.workers
        )
        embedded = embed_in_order(encoder.embed, batches(), self.lanes)
        try:
            for batch, vectors, seconds in embedded:
                stats["encoder"] += seconds / self.lanes
                for d, v in zip(batch, vectors):
                    shards.add(shard_entry(by_path[d.path], d), v)
                bar.update(len(batch))
        finally:
            embedded.close()  # waits for the encoder runs in flight
            stream.close()
            shards.flush()  # keep finished work on Ctrl-C too
            bar.close()
        stats["embed"] = time.perf_counter() - tic_all
        return stats


def shard_entry(e: FoundFile, d) -> dict:
    """The shard entry of one decoded (or failed) file."""
    return {
        "path": e.path,
        "stat_bytes": e.bytes,
        "mtime_ns": e.mtime_ns,
        "sha256": d.sha256,
        "width": d.width,
        "height": d.height,
        "bytes": d.bytes,
        "error": d.error,
    }
