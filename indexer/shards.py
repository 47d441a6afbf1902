"""Resumable embedding shards: the work of an unfinished ``moco index`` run, kept on disk in ``work/``.

A run embeds its new and changed files in order and writes every ``shard_size`` results as one shard::

    work/state.json              {"model_sha256", "embedding_dim"}: shards made by another model are discarded
    work/shard_000003.vec.npy    float32 [n_ok, D] embeddings of the readable files of the shard
    work/shard_000003.json       one entry per file: path, stat bytes + mtime_ns (the cache key), sha256,
                                 width, height, bytes, row into .vec.npy (-1 for an unreadable file + reason)
    work/shard_000003.done       completion marker, written last; a shard without it is deleted on open

Each file is written to a temp name, fsynced and renamed, and the marker only after both, so Ctrl-C,
``kill -9`` or a power loss loses at most the shard being filled. The next run looks every file up by
(path, size, mtime) and embeds only what no finished shard holds, so it resumes where the last one stopped.
The folder is deleted once the run publishes its generation.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np

from contracts.atomic import (
    atomic_write,
    output_errors,
    write_json_atomic,
    write_text_atomic,
)

LOG = logging.getLogger(__name__)

STATE_FILE = "state.json"


class WorkShards:
    """The finished shards of ``work/`` (a lookup table) plus the shard being filled."""

    def __init__(self, work_dir: Path, model_sha256: str, embedding_dim: int, shard_size: int = 1024):
        self.dir = Path(work_dir)
        self.dim = embedding_dim
        self.shard_size = shard_size
        self._cache: dict[str, tuple[dict, int]] = {}  # path -> (entry, shard number)
        self._vectors: dict[int, np.ndarray] = {}      # shard number -> memory-mapped [n_ok, D]
        self._pending_entries: list[dict] = []
        self._pending_vectors: list[np.ndarray] = []
        state = {"model_sha256": model_sha256, "embedding_dim": embedding_dim}
        with output_errors(self.dir):
            if self.dir.exists() and self._read_state() != state:
                LOG.info("discarding unfinished shards in %s (made by another model)", self.dir)
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.dir / STATE_FILE, state)
        self._next = 0
        self._load()

    def _read_state(self) -> dict | None:
        try:
            return json.loads((self.dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _load(self) -> None:
        numbers = sorted({int(p.name[6:12]) for p in self.dir.glob("shard_*") if p.name[6:12].isdigit()})
        for n in numbers:
            stem = self.dir / f"shard_{n:06d}"
            if not Path(f"{stem}.done").exists():
                for suffix in (".vec.npy", ".json"):
                    Path(f"{stem}{suffix}").unlink(missing_ok=True)
                continue
            try:
                entries = json.loads(Path(f"{stem}.json").read_text())
                vectors = np.load(f"{stem}.vec.npy", mmap_mode="r")
            except (OSError, ValueError) as exc:
                LOG.warning("discarding unreadable shard %s: %s", stem, exc)
                continue
            if vectors.ndim != 2 or vectors.shape[1] != self.dim:
                LOG.warning("discarding shard %s: vectors of shape %s", stem, vectors.shape)
                continue
            self._vectors[n] = vectors
            for entry in entries:
                self._cache[entry["path"]] = (entry, n)
        self._next = numbers[-1] + 1 if numbers else 0
        if self._cache:
            LOG.info("resuming: %d files already embedded in %d shards", len(self._cache), len(self._vectors))

    def __len__(self) -> int:
        return len(self._cache)

    def lookup(self, path: str, stat_bytes: int, mtime_ns: int) -> dict | None:
        """The finished entry for this file version, or ``None`` when it still has to be embedded."""
        hit = self._cache.get(path)
        if hit is None or hit[0]["stat_bytes"] != stat_bytes or hit[0]["mtime_ns"] != mtime_ns:
            return None
        return hit[0]

    def vector(self, path: str) -> np.ndarray:
        """float32 ``[D]`` embedding of a finished, readable file."""
        entry, n = self._cache[path]
        return np.asarray(self._vectors[n][entry["row"]])

    def add(self, entry: dict, vector: np.ndarray | None) -> None:
        """Queue one result (``vector`` ``[D]`` for a readable file, ``None`` for an unreadable one)."""
        entry = dict(entry, row=len(self._pending_vectors) if vector is not None else -1)
        self._pending_entries.append(entry)
        if vector is not None:
            self._pending_vectors.append(np.asarray(vector, dtype=np.float32))
        if len(self._pending_entries) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the queued results as one finished shard (no-op when nothing is queued)."""
        if not self._pending_entries:
            return
        n = self._next
        stem = self.dir / f"shard_{n:06d}"
        vectors = (np.stack(self._pending_vectors) if self._pending_vectors
                   else np.zeros((0, self.dim), dtype=np.float32))
        with atomic_write(Path(f"{stem}.vec.npy")) as f:
            np.save(f, vectors)
        write_json_atomic(Path(f"{stem}.json"), self._pending_entries)
        write_text_atomic(Path(f"{stem}.done"), f"{len(self._pending_entries)}\n")  # the marker, last
        self._vectors[n] = vectors
        for entry in self._pending_entries:
            self._cache[entry["path"]] = (entry, n)
        self._pending_entries, self._pending_vectors = [], []
        self._next = n + 1

    def clear(self) -> None:
        """Delete the work folder (after its results were published)."""
        self._vectors.clear()
        self._cache.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
