"""Committed vector blocks: the embeddings each generation added, kept so later generations can rebuild.

Block ``gN`` holds the vectors first embedded by the run that published generation ``gN``: int64 ``[n]`` ids
(``gN.ids.npy``) and float32 ``[n, D]`` rows (``gN.vec.npy``). An id's vector never changes (a changed file
gets a new id), so blocks are immutable and shared; which ids are live is the metadata store's business,
and :func:`live_blocks` filters by it. The manifest lists the blocks a generation uses.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from indexer.layout import IndexLayout, fsync_dir, output_errors

READ_ROWS = 65_536  # rows per block handed to FAISS


class BlockWriter:
    """Writes one block of ``n`` rows in order without holding them in memory (a memory-mapped .npy)."""

    def __init__(self, layout: IndexLayout, name: str, n: int, d: int):
        self.ids_path, self.vec_path = layout.vector_block(name)
        self.n, self.pos = n, 0
        with output_errors(layout.vectors):
            layout.vectors.mkdir(parents=True, exist_ok=True)
            self._tmp = self.vec_path.with_name(f".{self.vec_path.name}.tmp")
            self.ids = np.zeros(n, dtype=np.int64)
            self.vec = np.lib.format.open_memmap(self._tmp, mode="w+", dtype=np.float32, shape=(n, d))

    def append(self, item_id: int, vector: np.ndarray) -> None:
        self.ids[self.pos] = item_id
        self.vec[self.pos] = vector
        self.pos += 1

    def close(self) -> None:
        """Flush both files to disk under their final names."""
        assert self.pos == self.n, f"block has {self.pos} of {self.n} rows"
        with output_errors(self.vec_path):
            self.vec.flush()
            del self.vec
            with open(self._tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(self._tmp, self.vec_path)
            tmp_ids = self.ids_path.with_name(f".{self.ids_path.name}.tmp")
            with open(tmp_ids, "wb") as f:
                np.save(f, self.ids)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_ids, self.ids_path)
            fsync_dir(self.vec_path.parent)


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
