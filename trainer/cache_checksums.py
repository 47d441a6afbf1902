"""Checksums of the image cache's rows (:mod:`trainer.image_cache`): a ``zlib.crc32`` per block of rows.

Garbled rows of a rows file used to train silently, and a truncated one failed every rerun with a traceback.
The cache's ``index.json`` therefore records, beside its rows::

    "checksums": {"pixels": rows file, "block_rows": rows per block, "rows": rows covered, "crc32": [one per block]}

Block ``b`` covers rows ``[b * block_rows, (b + 1) * block_rows)`` (the last one may be partial, and grows as
rows are appended: crc32 extends incrementally). A block is about :data:`BLOCK_BYTES`, so verifying one costs a
millisecond whatever the training size. What is verified when:

* every update (each run and its k-NN monitor, at start): the rows file's size against the rows the index
  claims, and :data:`SAMPLE_BLOCKS` blocks drawn at random, plus the partial last block that the update is
  about to extend; one damaged block makes it verify every block;
* a compaction: every block it copies rows from (it reads them anyway).

A record that is missing (a cache written before checksums), stale (another rows file) or malformed is
rebuilt from the rows as they are, once, reading the rows file; one that covers fewer rows than the index
(rows appended by an older version) is extended over the rest.
"""

from __future__ import annotations

import math
import os
import random
import zlib
from dataclasses import dataclass, field

BLOCK_BYTES = 1 << 20  # ~1 MiB a block: a millisecond of crc32; 218 rows at 40 px, 4 at 280 px
SAMPLE_BLOCKS = 8  # blocks verified at every update: ~8 MiB read, a few milliseconds


@dataclass
class RowChecksums:
    """The crc32 of each block of rows of one rows file (see the module docstring)."""

    pixels: str
    block_rows: int
    rows: int = 0
    crc32: list[int] = field(default_factory=list)

    @classmethod
    def for_rows(cls, pixels: str, row_bytes: int, block_bytes: int = BLOCK_BYTES) -> RowChecksums:
        """An empty record for rows file ``pixels``, blocks of ``block_bytes`` (at least one row)."""
        return cls(pixels, max(1, block_bytes // row_bytes))

    @classmethod
    def from_index(cls, index: dict) -> RowChecksums | None:
        """The index's record, or None when it is missing, stale or malformed (then it is rebuilt)."""
        record = index.get("checksums")
        try:
            sums = cls(
                str(record["pixels"]), int(record["block_rows"]), int(record["rows"]), [int(c) for c in record["crc32"]]
            )
        except (TypeError, KeyError, ValueError):
            return None
        if (
            sums.pixels != index["pixels"]
            or sums.block_rows < 1
            or not 0 <= sums.rows <= index["rows"]
            or len(sums.crc32) != math.ceil(sums.rows / sums.block_rows)
        ):
            return None
        return sums

    def to_json(self) -> dict:
        return {"pixels": self.pixels, "block_rows": self.block_rows, "rows": self.rows, "crc32": self.crc32}

    def add(self, row: bytes) -> None:
        """Account for one row appended after the covered ones."""
        if self.rows % self.block_rows == 0:
            self.crc32.append(zlib.crc32(row))
        else:
            self.crc32[-1] = zlib.crc32(row, self.crc32[-1])
        self.rows += 1

    def block_of(self, row: int) -> int:
        return row // self.block_rows

    def span(self, block: int) -> tuple[int, int]:
        """``(first row, row after the last)`` of covered block ``block``."""
        start = block * self.block_rows
        return start, min(start + self.block_rows, self.rows)

    def drop_from(self, block: int) -> None:
        """Forget the blocks from ``block`` on (to cover them again from the rows as they are)."""
        self.crc32 = self.crc32[:block]
        self.rows = min(self.rows, block * self.block_rows)

    def cover(self, fd: int, row_bytes: int, rows: int) -> None:
        """Extend the record over rows ``[self.rows, rows)`` of open rows file ``fd``, as they are."""
        while self.rows < rows:
            stop = min(rows, (self.block_of(self.rows) + 1) * self.block_rows)
            data = os.pread(fd, (stop - self.rows) * row_bytes, self.rows * row_bytes)
            if self.rows % self.block_rows == 0:
                self.crc32.append(zlib.crc32(data))
            else:
                self.crc32[-1] = zlib.crc32(data, self.crc32[-1])
            self.rows = stop

    def matches(self, block: int, data: bytes) -> bool:
        return zlib.crc32(data) == self.crc32[block]

    def damaged(self, fd: int, row_bytes: int, blocks) -> list[int]:
        """The blocks among ``blocks`` whose rows in ``fd`` do not match their checksum."""
        bad = []
        for block in blocks:
            start, stop = self.span(block)
            if not self.matches(block, os.pread(fd, (stop - start) * row_bytes, start * row_bytes)):
                bad.append(block)
        return bad

    def sample(self, count: int, rng: random.Random | None = None) -> list[int]:
        """``count`` blocks at random, and the partial last block (the next append extends it)."""
        blocks = len(self.crc32)
        chosen = set((rng or random).sample(range(blocks), min(count, blocks)))
        if self.rows % self.block_rows:
            chosen.add(blocks - 1)
        return sorted(chosen)

    def recompute(self, fd: int, row_bytes: int, blocks) -> None:
        """Take the rows of ``blocks`` as they are now (their images were dropped: they are dead rows)."""
        for block in blocks:
            start, stop = self.span(block)
            self.crc32[block] = zlib.crc32(os.pread(fd, (stop - start) * row_bytes, start * row_bytes))
