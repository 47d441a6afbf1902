"""Committed vector blocks: the embeddings each generation added, kept for compaction, ground truth and
re-ranking.

Block ``gN`` holds the vectors first embedded by the run that published generation ``gN`` (or, after a
compaction, all live vectors of that moment): int64 ``[n]`` ids (``gN.ids.npy``, ascending) and ``[n, D]``
rows (``gN.vec.npy``) in float32, or float16 for indexes that store compressed codes (IVF-PQ), where the
blocks are the only full-precision copy and half the size matters: 1 KB per 512-d vector instead of 2.
An id's vector never changes (a changed file gets a new id), so blocks are immutable and shared; which ids
are live is the metadata store's business, and :func:`live_blocks` filters by it. Ids grow with every run,
so the blocks of a manifest, in its order, hold ascending ids: :class:`BlockVectors` finds any id's row
with one binary search.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moco_retrieval.contracts.atomic import atomic_path, atomic_write, check_free_space, output_errors
from moco_retrieval.contracts.errors import ArtifactError, IndexBuildError, OutputError
from moco_retrieval.indexer.factory import Factory
from moco_retrieval.indexer.layout import IndexLayout

READ_ROWS = 65_536  # rows per block handed to FAISS


def block_dtype(factory: str) -> np.dtype:
    """float16 blocks for indexes of compressed codes (the blocks are then their only full-precision copy),
    float32 for the rest."""
    return np.dtype(np.float16 if Factory.parse(factory).pq_codes else np.float32)


class BlockWriter:
    """Writes one block of ``n`` rows in order without holding them in memory: plain writes to a temporary
    .npy (its header, then the rows as they come).

    Not a memory map: a mapped .npy is a sparse file whose pages get their disk blocks only when first
    touched, so on a full disk the write was a SIGBUS (every rerun died with "Bus error"), never an error. A
    write now fails with ENOSPC, an :class:`~contracts.errors.OutputError`; and the whole block's free space
    is checked before the first row, so a disk that cannot hold it fails at once.

    Use as a context manager: both files appear under their final names, atomically, only when the block
    ends without an error and all ``n`` rows were appended. Then ``records`` holds their ``{"bytes",
    "sha256"}`` by file name (for the manifest's ``block_files``), the rows' hashed as they were written.
    """

    def __init__(self, layout: IndexLayout, name: str, n: int, d: int, dtype=np.float32):
        self.ids_path, self.vec_path = layout.vector_block(name)
        self.n, self.d, self.pos, self.dtype = n, d, 0, np.dtype(dtype)
        self.records: dict[str, dict] = {}
        self._sha256 = hashlib.sha256()
        with output_errors(layout.vectors):
            layout.vectors.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "BlockWriter":
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header,
            {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.n, self.d)},
        )
        rows_bytes = self.n * self.d * self.dtype.itemsize
        check_free_space(
            self.vec_path.parent, header.tell() + rows_bytes + 8 * self.n + 128, f"vector block {self.vec_path}"
        )
        self.ids = np.zeros(self.n, dtype=np.int64)
        self._vec_file = atomic_path(self.vec_path)
        tmp = self._vec_file.__enter__()
        try:
            with output_errors(self.vec_path):
                self._file = open(tmp, "wb")
                self._file.write(header.getvalue())
                self._sha256.update(header.getvalue())
        except BaseException as exc:
            self._vec_file.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _write_rows(self, vectors: np.ndarray) -> None:
        rows = np.ascontiguousarray(vectors, dtype=self.dtype)
        if rows.ndim != 2 or rows.shape[1] != self.d:
            raise IndexBuildError(f"vector block {self.vec_path.name} takes [m, {self.d}] rows, got {rows.shape}")
        data = memoryview(rows).cast("B")
        with output_errors(self.vec_path):
            self._file.write(data)
        self._sha256.update(data)

    def append(self, item_id: int, vector: np.ndarray) -> None:
        self.extend(np.asarray([item_id], dtype=np.int64), np.asarray(vector).reshape(1, -1))

    def extend(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Append many rows at once."""
        end = self.pos + len(ids)
        if end > self.n:
            raise IndexBuildError(f"vector block {self.vec_path.name} holds {self.n} rows, not {end}")
        self._write_rows(vectors)
        self.ids[self.pos : end] = ids
        self.pos = end

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            with output_errors(self.vec_path):
                self._file.close()  # flushes: a full disk can still fail here
        except OutputError as closing:
            if exc_type is None:
                exc_type, exc, tb = OutputError, closing, None
        if exc_type is None and self.pos != self.n:
            exc = IndexBuildError(f"vector block {self.vec_path.name} has {self.pos} of {self.n} rows")
            exc_type = type(exc)
        if exc_type is not None:
            self._vec_file.__exit__(exc_type, exc, tb)  # removes the temporary file
            if exc is not None and tb is None:
                raise exc
            return False
        self._vec_file.__exit__(None, None, None)  # fsync + rename
        ids = io.BytesIO()
        np.save(ids, self.ids)
        with atomic_write(self.ids_path) as f:  # after the vectors: a block is complete when its ids exist
            f.write(ids.getvalue())
        self.records = {
            self.vec_path.name: {"bytes": self.vec_path.stat().st_size, "sha256": self._sha256.hexdigest()},
            self.ids_path.name: {"bytes": ids.tell(), "sha256": hashlib.sha256(ids.getvalue()).hexdigest()},
        }
        return False


def open_block(layout: IndexLayout, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, vectors)`` of block ``name``: int64 ``[n]`` and ``[n, D]``, memory-mapped read-only.

    Raises:
        ArtifactError: a block file missing, truncated or not a matching pair of arrays.
    """
    ids_path, vec_path = layout.vector_block(name)
    try:
        # numpy refuses to map a file shorter than its header's shape, so a truncated block is an error here
        ids = np.load(ids_path, mmap_mode="r")
        vec = np.load(vec_path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise ArtifactError(
            f"vector block {name} of {layout.root} is unreadable ({exc}); rebuild with `moco index --rebuild`"
        ) from exc
    if ids.ndim != 1 or ids.dtype != np.int64 or vec.ndim != 2 or len(vec) != len(ids):
        raise ArtifactError(
            f"vector block {name} of {layout.root} is damaged (ids {ids.dtype} {ids.shape}, vectors "
            f"{vec.dtype} {vec.shape}); rebuild with `moco index --rebuild`"
        )
    return ids, vec


def live_blocks(
    layout: IndexLayout, names: list[str], live_ids: np.ndarray
) -> Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]:
    """A block source (see ``indexer.faiss_index``) over the live rows of the named blocks, as float32.

    Args:
        live_ids: sorted int64 ids that are live; rows of other ids are skipped.
    """

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for name in names:
            ids, vec = open_block(layout, name)
            for start in range(0, len(ids), READ_ROWS):
                sub = ids[start : start + READ_ROWS]
                keep = is_in_sorted(sub, live_ids)
                if keep.any():
                    yield sub[keep], np.asarray(vec[start : start + READ_ROWS][keep], dtype=np.float32)

    return blocks


def is_in_sorted(values: np.ndarray, sorted_ids: np.ndarray) -> np.ndarray:
    """``values`` in ``sorted_ids`` (ascending), by binary search: O(m log n), where ``np.isin`` would sort both
    arrays on every call."""
    if not len(sorted_ids):
        return np.zeros(len(values), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, values), len(sorted_ids) - 1)
    return sorted_ids[pos] == values


def block_exists(layout: IndexLayout, name: str) -> bool:
    return all(Path(p).is_file() for p in layout.vector_block(name))


def block_rows(layout: IndexLayout, names: list[str]) -> int:
    """Rows (live or not) of the named blocks, from their headers."""
    return sum(len(open_block(layout, name)[0]) for name in names)


class BlockVectors:
    """The stored vector of any id of a generation's blocks (memory-mapped: nothing is read until asked for).

    Raises (on open):
        ArtifactError: a block is missing or unreadable.
    """

    def __init__(self, layout: IndexLayout, names: list[str]):
        ids, self._vectors, offsets = [], [], [0]
        for name in names:
            block_ids, vec = open_block(layout, name)
            self._vectors.append(vec)
            ids.append(block_ids)
            offsets.append(offsets[-1] + len(block_ids))
        self.ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._order = None
        if len(self.ids) > 1 and not np.all(self.ids[1:] > self.ids[:-1]):  # not expected; still correct
            self._order = np.argsort(self.ids, kind="stable")
            self.ids = self.ids[self._order]

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, vectors)``: bool ``[m]`` and float32 ``[m, D]`` (zero rows where not found)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        pos = np.searchsorted(self.ids, ids)
        pos_ok = np.minimum(pos, max(len(self.ids) - 1, 0))
        found = (pos < len(self.ids)) & (self.ids[pos_ok] == ids) if len(self.ids) else np.zeros(len(ids), bool)
        d = self._vectors[0].shape[1] if self._vectors else 0
        out = np.zeros((len(ids), d), dtype=np.float32)
        rows = pos_ok[found]
        if self._order is not None:
            rows = self._order[rows]
        blocks = np.searchsorted(self._offsets, rows, side="right") - 1
        where = np.flatnonzero(found)
        for b in np.unique(blocks):
            sel = blocks == b
            local = rows[sel] - self._offsets[b]
            order = np.argsort(local)  # sorted reads of the memory map
            out[where[sel][order]] = np.asarray(self._vectors[b][local[order]], dtype=np.float32)
        return found, out
