"""Resumable embedding shards: the work of an unfinished ``moco index`` run, kept on disk in ``work/``.

Each process (rank) of a run embeds its part of the files in order and writes every ``shard_size`` results
as one shard, in a folder named after the model (shards of another model are never looked at, and rank 0
deletes them)::

    work/<sha256[:16]>-<D>/shard_001_000003.vec.npy   [n_ok, D] embeddings (float32, float16 for IVF-PQ) of
                                                       the readable files of shard 3 of rank 1
    work/<sha256[:16]>-<D>/shard_001_000003.json      one entry per file: path, stat bytes + mtime_ns (the
                                                       cache key), sha256, width, height, bytes, row into
                                                       .vec.npy (-1 for an unreadable file + its reason)
    work/<sha256[:16]>-<D>/shard_001_000003.done      completion marker, written last

Each file is written to a temp name, fsynced and renamed, and the marker only after both, so Ctrl-C,
``kill -9`` or a power loss loses at most the shard being filled. A process deletes its own unfinished
shards when it starts (another rank's may still be being written). Every rank looks every file up by
(path, size, mtime) in the finished shards of *all* ranks and embeds only what none holds, so a rerun
resumes where the last one stopped, with the same or another number of ranks. The folder is deleted once
the run publishes its generation.
"""

from __future__ import annotations

import json
import logging
import shutil
from operator import itemgetter
from pathlib import Path

import numpy as np

from moco_retrieval.contracts.atomic import atomic_write, output_errors, write_json_atomic, write_text_atomic

LOG = logging.getLogger(__name__)


def model_work_dir(work_root: Path, model_sha256: str, embedding_dim: int) -> Path:
    """``work/<sha256[:16]>-<D>``: the shards of one model."""
    return Path(work_root) / f"{model_sha256[:16]}-{embedding_dim}"


def discard_other_models(work_root: Path, keep: Path) -> None:
    """Delete the shards of models other than ``keep``'s (left by a run with another encoder)."""
    if not Path(work_root).is_dir():
        return
    for child in Path(work_root).iterdir():
        if child != keep:
            LOG.info("discarding unfinished shards in %s (made by another model)", child)
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


class WorkShards:
    """The finished shards of ``work/<model>/`` (a lookup table over all ranks) plus the shard being filled."""

    def __init__(
        self,
        work_root: Path,
        model_sha256: str,
        embedding_dim: int,
        shard_size: int = 1024,
        rank: int = 0,
        dtype=np.float32,
    ):
        self.dir = model_work_dir(work_root, model_sha256, embedding_dim)
        self.dim = embedding_dim
        self.shard_size = shard_size
        self.rank = rank
        self.dtype = np.dtype(dtype)
        # path -> (entry fields as a tuple, (rank, shard number)): tuples, not dicts, so 10M entries fit in RAM
        self._cache: dict[str, tuple[tuple, tuple[int, int]]] = {}
        self._vectors: dict[tuple[int, int], np.ndarray] = {}  # (rank, number) -> memory-mapped [n_ok, D]
        self._pending_entries: list[dict] = []
        self._pending_vectors: list[np.ndarray] = []
        self._next = 0
        self.flushed = 0  # results this process wrote as finished shards
        self.on_flush = None  # called with ``flushed`` after each shard (the rank's progress file)
        with output_errors(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
        self._discard_own_unfinished()
        self.refresh()

    def _stem(self, rank: int, number: int) -> Path:
        return self.dir / f"shard_{rank:03d}_{number:06d}"

    def _discard_own_unfinished(self) -> None:
        for path in self.dir.glob(f"shard_{self.rank:03d}_*"):
            if not path.name.endswith(".done") and not Path(f"{self._stem_of(path)}.done").exists():
                path.unlink(missing_ok=True)

    @staticmethod
    def _stem_of(path: Path) -> Path:
        return path.parent / path.name.split(".")[0]

    def refresh(self) -> None:
        """Load the shards other ranks finished since (rank 0 does, once they are all done)."""
        for marker in sorted(self.dir.glob("shard_*.done")):
            parts = marker.name[:-5].split("_")
            if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
                continue
            key = (int(parts[1]), int(parts[2]))
            if key[0] == self.rank:
                self._next = max(self._next, key[1] + 1)
            if key in self._vectors:
                continue
            stem = self._stem(*key)
            try:
                entries = json.loads(Path(f"{stem}.json").read_text())
                vectors = np.load(f"{stem}.vec.npy", mmap_mode="r")
            except (OSError, ValueError) as exc:
                LOG.warning("discarding unreadable shard %s: %s", stem, exc)
                continue
            if vectors.ndim != 2 or vectors.shape[1] != self.dim:
                LOG.warning("discarding shard %s: vectors of shape %s", stem, vectors.shape)
                continue
            self._vectors[key] = vectors
            for entry in entries:
                self._cache[entry["path"]] = (_pack(entry), key)
        if self._cache:
            LOG.debug("%d files already embedded in %d shards", len(self._cache), len(self._vectors))

    def __len__(self) -> int:
        return len(self._cache)

    def lookup(self, path: str, stat_bytes: int, mtime_ns: int) -> dict | None:
        """The finished entry for this file version, or ``None`` when it still has to be embedded."""
        hit = self._cache.get(path)
        if hit is None or hit[0][0] != stat_bytes or hit[0][1] != mtime_ns:
            return None
        return _unpack(path, hit[0])

    def facts(self, path: str) -> tuple[str, int, int, int]:
        """``(sha256, width, height, bytes)`` of a finished file, what its record needs: without the dict
        :meth:`lookup` builds (a full build asks this of every file, on its commit's critical path)."""
        return _FACTS(self._cache[path][0])

    def vector(self, path: str) -> np.ndarray:
        """float32 ``[D]`` embedding of a finished, readable file."""
        packed, key = self._cache[path]
        return np.asarray(self._vectors[key][packed[_ROW]], dtype=np.float32)

    def vectors(self, paths: list[str]) -> np.ndarray:
        """float32 ``[len(paths), D]`` embeddings of finished, readable files."""
        out = np.empty((len(paths), self.dim), dtype=np.float32)
        where: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # shard -> (positions in out, its rows)
        for i, path in enumerate(paths):
            packed, key = self._cache[path]
            at, rows = where.setdefault(key, ([], []))
            at.append(i)
            rows.append(packed[_ROW])
        for key, (at, rows) in where.items():  # one gather per shard, not a memory-map slice per row
            out[at] = self._vectors[key][rows]
        return out

    def add(self, entry: dict, vector: np.ndarray | None) -> None:
        """Queue one result (``vector`` ``[D]`` for a readable file, ``None`` for an unreadable one)."""
        entry = dict(entry, row=len(self._pending_vectors) if vector is not None else -1)
        self._pending_entries.append(entry)
        if vector is not None:
            self._pending_vectors.append(np.asarray(vector, dtype=self.dtype))
        if len(self._pending_entries) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the queued results as one finished shard (no-op when nothing is queued)."""
        if not self._pending_entries:
            return
        key = (self.rank, self._next)
        stem = self._stem(*key)
        vectors = (
            np.stack(self._pending_vectors) if self._pending_vectors else np.zeros((0, self.dim), dtype=self.dtype)
        )
        with atomic_write(Path(f"{stem}.vec.npy")) as f:
            np.save(f, vectors)
        write_json_atomic(Path(f"{stem}.json"), self._pending_entries, indent=None)  # a program's file: compact
        write_text_atomic(Path(f"{stem}.done"), f"{len(self._pending_entries)}\n")  # the marker, last
        # keep the file's memory map, not the rows: 10M of them would stay in RAM (10 GB even as float16)
        self._vectors[key] = np.load(f"{stem}.vec.npy", mmap_mode="r") if len(vectors) else vectors
        for entry in self._pending_entries:
            self._cache[entry["path"]] = (_pack(entry), key)
        self.flushed += len(self._pending_entries)
        self._pending_entries, self._pending_vectors = [], []
        self._next += 1
        if self.on_flush is not None:
            self.on_flush(self.flushed)

    def clear(self) -> None:
        """Delete the work folder (after its results were published)."""
        self._vectors.clear()
        self._cache.clear()
        shutil.rmtree(self.dir.parent, ignore_errors=True)


_FIELDS = ("stat_bytes", "mtime_ns", "row", "sha256", "width", "height", "bytes", "error")
_ROW = _FIELDS.index("row")
_FACTS = itemgetter(*(_FIELDS.index(f) for f in ("sha256", "width", "height", "bytes")))


def _pack(entry: dict) -> tuple:
    return tuple(entry.get(f) for f in _FIELDS)


def _unpack(path: str, packed: tuple) -> dict:
    return {"path": path, **dict(zip(_FIELDS, packed))}
