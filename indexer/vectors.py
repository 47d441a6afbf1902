"""Committed vector blocks: the embeddings each generation added, kept so later generations can rebuild.

Block ``gN`` holds the vectors first embedded by the run that published generation ``gN``: int64 ``[n]`` ids
(``gN.ids.npy``) and float32 ``[n, D]`` rows (``gN.vec.npy``). An id's vector never changes (a changed file
gets a new id), so blocks are immutable and shared; which ids are live is the metadata store's business,
and :func:`live_blocks` filters by it. The manifest lists the blocks a generation uses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from contracts.atomic import atomic_path, atomic_write, output_errors
from contracts.errors import IndexBuildError
from indexer.layout import IndexLayout

READ_ROWS = 65_536  # rows per block handed to FAISS


class BlockWriter:
    """Writes one block of ``n`` rows in order without holding them in memory (a memory-mapped .npy).

    Use as a context manager: both files appear under their final names, atomically, only when the block
    ends without an error and all ``n`` rows were appended.
    """

    def __init__(self, layout: IndexLayout, name: str, n: int, d: int):
        self.ids_path, self.vec_path = layout.vector_block(name)
        self.n, self.d, self.pos = n, d, 0
        with output_errors(layout.vectors):
            layout.vectors.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "BlockWriter":
        self._vec_file = atomic_path(self.vec_path)
        tmp = self._vec_file.__enter__()
        self.ids = np.zeros(self.n, dtype=np.int64)
        with output_errors(self.vec_path):
            self.vec = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(self.n, self.d))
        return self

    def append(self, item_id: int, vector: np.ndarray) -> None:
        self.ids[self.pos] = item_id
        self.vec[self.pos] = vector
        self.pos += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.vec.flush()
        del self.vec
        if exc_type is None and self.pos != self.n:
            exc = IndexBuildError(f"vector block {self.vec_path.name} has {self.pos} of {self.n} rows")
            exc_type = type(exc)
        if exc_type is not None:
            self._vec_file.__exit__(exc_type, exc, tb)  # removes the temporary file
            if exc is not None and tb is None:
                raise exc
            return False
        self._vec_file.__exit__(None, None, None)  # fsync + rename
        with atomic_write(self.ids_path) as f:  # after the vectors: a block is complete when its ids exist
            np.save(f, self.ids)
        return False


def live_blocks(layout: IndexLayout, names: list[str], live_ids: np.ndarray
                ) -> Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]:
    """A block source (see ``indexer.faiss_index``) over the live rows of the named blocks.

    Args:
        live_ids: sorted int64 ids that are live; rows of other ids are skipped.
    """
    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for name in names:
            ids_path, vec_path = layout.vector_block(name)
            ids = np.load(ids_path)
            vec = np.load(vec_path, mmap_mode="r")
            for start in range(0, len(ids), READ_ROWS):
                sub = ids[start:start + READ_ROWS]
                keep = np.isin(sub, live_ids, assume_unique=True)
                if keep.any():
                    yield sub[keep], np.asarray(vec[start:start + READ_ROWS][keep], dtype=np.float32)
    return blocks


def block_exists(layout: IndexLayout, name: str) -> bool:
    return all(Path(p).is_file() for p in layout.vector_block(name))
