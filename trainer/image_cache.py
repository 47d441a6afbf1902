"""A decoded copy of an image folder at the training resolution, made once and shared by later runs.

Training decodes every image once into a memory-mapped uint8 array; afterwards a batch is a gather of rows
(no decoding, no PIL), and the augmentations run on whole batches (:mod:`trainer.batch_augment`).

Each image is stored squashed to ``side x side`` RGB pixels (:func:`cache_side`: 1.25x the training size, so a
random crop is rarely upsampled and never shrunk by more than 1.25x) with its original width and height, from
which crops are sampled in the original's geometry. Decoding is :func:`contracts.images.decode_image`, the
decode of every stage (EXIF orientation, 16-bit, transparency), followed by an antialiased PIL resize.

On disk, under ``CACHE_ROOT/<folder name>-<hash of its absolute path>-<side>px/``::

    index.json        {"format", "format_version", "side", "pixels": file name, "rows": rows written,
                       "entries": {path: [row, bytes, mtime_ns, width, height]},
                       "failed": {path: [bytes, mtime_ns, reason]},
                       "checksums": a crc32 per block of rows (trainer.cache_checksums)}
    pixels-<n>.u8     raw uint8 rows [rows, side, side, 3]
    .lock             held (flock) while the cache is updated

An entry is valid while the file's size and mtime are unchanged: a later run decodes only new and changed
files (appended as new rows); a file that failed to decode is not retried until it changes.

One cache, several readers. Every caller of :meth:`ImageCache.update` on the folder shares the cache: the
training run (the whole folder), the k-NN monitor (an evenly spread subset of it), other runs at the same
time. The rules that keep each of them valid:

* An update adds and refreshes the entries of the files it is given. It forgets an entry only when its
  caller says it walked the whole folder (``whole_folder=True``) and the file is not in that walk, so a
  caller asking for a subset never drops the others.
* Rows are only appended; a row an index names is never written again. Rows are written and fsynced before
  ``index.json`` is replaced atomically, so a killed update leaves the previous index, whose rows are intact.
* A reader (each :class:`CachedImages` an update returns) holds a shared ``flock`` on its rows file from the
  moment the update reads the index until it is closed or its process ends. When more than half of the rows
  are dead the live ones are copied to a new rows file; an old rows file is deleted, by any later update,
  only once nobody holds it (an exclusive non-blocking ``flock`` succeeds). So a run's rows file stays valid
  for the whole run, whatever other runs compact, and loader workers can map it by its path.

Updates take turns on ``.lock``; reading an index and taking the reader's lock happen under it, so no update
can delete a rows file between the two.

Damage is repaired, never trusted. Each update checks the rows file's size against the rows its index claims
and verifies a sample of row blocks (:mod:`trainer.cache_checksums`; all of them once one fails). The images of
a damaged block, or of the blocks a truncation cut, are dropped from the index and decoded again as new rows in
the same update (one warning line); a truncated file is first extended back to its length with zeros, so no
row number is ever reused and a reader of the old index reads zeros rather than past the end of its map.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import random
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None

import numpy as np
from PIL import Image

from moco_retrieval.contracts.atomic import output_errors, write_json_atomic
from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.images import FoundFile, decode_image
from moco_retrieval.trainer.cache_checksums import BLOCK_BYTES, SAMPLE_BLOCKS, RowChecksums

LOG = logging.getLogger(__name__)

CACHE_FORMAT = "moco-retrieval/image-cache"
CACHE_VERSION = 1
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
CACHE_ENV = "MOCO_CACHE_DIR"
COMPACT_MIN_ROWS = 1024  # below this many rows dead ones are not worth a rewrite


def cache_side(image_size: int) -> int:
    """The stored side for a training size: 1.25x, rounded up to a multiple of 8 (32 -> 40, 224 -> 280)."""
    return int(math.ceil(1.25 * image_size / 8) * 8)


def default_cache_root() -> Path:
    """``$MOCO_CACHE_DIR``, else ``$XDG_CACHE_HOME/moco-retrieval``, else ``~/.cache/moco-retrieval``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moco-retrieval"


def cache_dir_for(root: str | os.PathLike, side: int, cache_root: str | os.PathLike | None = None) -> Path:
    """The cache folder of image folder ``root`` at ``side`` pixels."""
    real = os.path.realpath(root)
    digest = hashlib.sha1(os.fsencode(real)).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(real).name)[:40] or "root"
    return Path(cache_root or default_cache_root()) / f"{name}-{digest}-{side}px"


def decode_to_side(path: str, side: int) -> tuple[np.ndarray | None, int, int, str | None]:
    """``(uint8 [side, side, 3], width, height, None)`` of one file, or ``(None, 0, 0, reason)``."""
    try:
        image = decode_image(path)
        width, height = image.size
        pixels = np.asarray(image.resize((side, side), resample=Image.BILINEAR, reducing_gap=None), dtype=np.uint8)
        return pixels, width, height, None
    except DataError as exc:
        return None, 0, 0, str(exc).replace(f"{path}: ", "")
    except Exception as exc:  # a decoder bug on one hostile file must not stop a run over a million files
        return None, 0, 0, f"not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]


def _decode_task(task: tuple[str, int]):
    return decode_to_side(*task)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    if fcntl is None:  # not POSIX: no lock
        yield
        return
    with output_errors(folder / LOCK_FILE, "set --cache-dir to a writable folder"):
        folder.mkdir(parents=True, exist_ok=True)
        f = open(folder / LOCK_FILE, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        f.close()


def _hold_shared(path: Path) -> int | None:
    """A file descriptor of rows file ``path`` holding a shared flock: a reader's claim, which keeps the file
    from being deleted (see the module docstring). None where there is no file (no rows yet) or no flock."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DataError(
            f"cannot read the image cache {path} ({exc.strerror or exc}); set --cache-dir to a readable folder"
        ) from exc
    # never waits: the only exclusive flock on a rows file is the non-blocking probe of _delete_unheld
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _rows_file_number(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


@dataclass
class CachedImages:
    """Cached pixels of a list of images: row ``i`` of the cache file is image ``rows.index(i)``.

    While it is open (until :meth:`close`, or its process ends) it holds a shared flock on its rows file, so
    no update deletes the file under it; a pickled copy (a loader worker) maps the file by its path and relies
    on the original's claim.

    Attributes:
        folder: the cache folder; pixels_file: its rows file; side: stored side.
        rows: int64 ``[N]`` cache row of each image (in the caller's order).
        sizes: int64 ``[N, 2]`` original (width, height).
        decoded: files the update that made this view decoded (readable or not); reused: files it found cached.
    """

    folder: Path
    pixels_file: Path
    side: int
    rows: np.ndarray
    sizes: np.ndarray
    decoded: int = 0
    reused: int = 0
    _hold: weakref.finalize | None = field(default=None, repr=False, compare=False)  # closes the claim's fd

    def __len__(self) -> int:
        return len(self.rows)

    def open(self) -> np.ndarray:
        """The rows file memory-mapped read-only, ``[rows, side, side, 3]`` (open it once per process)."""
        total = self.pixels_file.stat().st_size // (self.side * self.side * 3)
        return np.memmap(self.pixels_file, dtype=np.uint8, mode="r", shape=(total, self.side, self.side, 3))

    def close(self) -> None:
        """Give up the claim on the rows file (mappings already made stay valid)."""
        if self._hold is not None:
            self._hold()
            self._hold = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_hold"] = None  # a file descriptor means nothing in another process; the original holds it
        return state


class ImageCache:
    """The cache of one image folder at one side; :meth:`update` brings it up to date with the files it is given.

    Args:
        root: the image folder; side: stored side (:func:`cache_side`); cache_root: where caches live (None:
            :func:`default_cache_root`).
        compact_min_rows: rows below which dead ones are never compacted (None: :data:`COMPACT_MIN_ROWS`).
        block_bytes: bytes of rows per checksum block of a new checksum record (None: ``BLOCK_BYTES``).
        sample_blocks: blocks verified at each update (None: ``SAMPLE_BLOCKS``).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        side: int,
        cache_root: str | os.PathLike | None = None,
        compact_min_rows: int | None = None,
        block_bytes: int | None = None,
        sample_blocks: int | None = None,
    ):
        self.root = Path(root)
        self.side = side
        self.folder = cache_dir_for(root, side, cache_root)
        self.compact_min_rows = COMPACT_MIN_ROWS if compact_min_rows is None else compact_min_rows
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        self.sample_blocks = SAMPLE_BLOCKS if sample_blocks is None else sample_blocks
        self.row_bytes = side * side * 3
        self._rng = random.Random()  # which blocks to verify; never the global RNG, which training seeds

    def _read_index(self) -> dict:
        try:
            index = json.loads((self.folder / INDEX_FILE).read_text())
        except FileNotFoundError:
            index = None
        except (OSError, ValueError) as exc:
            LOG.warning("image cache index %s is unreadable (%s); rebuilding the cache", self.folder, exc)
            index = None
        if (
            not isinstance(index, dict)
            or index.get("format") != CACHE_FORMAT
            or index.get("format_version") != CACHE_VERSION
            or index.get("side") != self.side
            or not (self.folder / str(index.get("pixels"))).is_file()
        ):
            # a new rows file, never an old one: a reader of the old index may still hold and map it
            numbers = [_rows_file_number(p.name) for p in self.folder.glob("pixels-*.u8")]
            return {
                "format": CACHE_FORMAT,
                "format_version": CACHE_VERSION,
                "side": self.side,
                "pixels": f"pixels-{max(numbers, default=-1) + 1}.u8",
                "rows": 0,
                "entries": {},
                "failed": {},
            }
        return index

    def update(
        self, files: list[FoundFile], workers: int = 0, progress: bool = True, whole_folder: bool = False
    ) -> tuple[CachedImages, dict]:
        """Decode what is new or changed among ``files`` and return the cached view of the readable ones.

        Args:
            files: image files of the folder (``walk_image_files``; entries with a skip reason are passed over).
            workers: decoding processes (0: in this process).
            progress: show a progress bar while decoding.
            whole_folder: ``files`` is a walk of the whole folder, so cached files missing from it were removed
                and are forgotten; otherwise (a subset, such as the k-NN monitor's) only add and refresh.

        Returns:
            ``(cached, failed)``: the readable files' rows in ``files`` order (holding its rows file until
            closed), and ``{path: reason}`` of the files that do not decode.
        """
        files = [f for f in files if f.skip_reason is None]
        tic = time.perf_counter()
        with _locked(self.folder):
            index = self._read_index()
            sums, repaired = self._check_rows(index)
            entries, failed = index["entries"], index["failed"]
            todo = []
            for f in files:
                entry, fail = entries.get(f.path), failed.get(f.path)
                if entry is not None and entry[1] == f.bytes and entry[2] == f.mtime_ns:
                    continue
                if fail is not None and fail[0] == f.bytes and fail[1] == f.mtime_ns:
                    continue
                todo.append(f)
            dropped = []
            if whole_folder:
                present = {f.path for f in files}
                dropped = [p for p in entries if p not in present] + [p for p in failed if p not in present]
            for p in dropped:
                entries.pop(p, None)
                failed.pop(p, None)
            if todo:
                self._decode_into(index, todo, sums, workers, progress)
            if todo or dropped:
                sums, lost = self._compact_if_sparse(index, sums)
                again = [f for f in files if f.path in lost]
                if again:  # rows of damaged blocks the compaction found: decoded anew, as at the start
                    self._decode_into(index, again, sums, workers, progress)
                    todo += again
            if todo or dropped or repaired:
                index["checksums"] = sums.to_json()
                write_json_atomic(self.folder / INDEX_FILE, index, "set --cache-dir to a writable folder")
            self._delete_unheld(index["pixels"])
            hold = _hold_shared(self.folder / index["pixels"])  # under the lock: no update deletes it first
        readable = [f for f in files if f.path in entries]
        rows = np.array([entries[f.path][0] for f in readable], dtype=np.int64)
        sizes = np.array([entries[f.path][3:5] for f in readable], dtype=np.int64).reshape(-1, 2)
        cached = CachedImages(
            self.folder,
            self.folder / index["pixels"],
            self.side,
            rows,
            sizes,
            decoded=len(todo),
            reused=len(files) - len(todo),
        )
        if hold is not None:  # released when the view is closed or garbage-collected
            cached._hold = weakref.finalize(cached, os.close, hold)
        unreadable = [f for f in files if f.path in failed]
        LOG.info(
            "image cache %s: %d images reused, %d decoded in %.1f s%s",
            self.folder,
            cached.reused,
            cached.decoded,
            time.perf_counter() - tic,
            f"; {len(unreadable)} unreadable" if unreadable else "",
        )
        return cached, {f.path: failed[f.path][2] for f in unreadable}

    def _check_rows(self, index: dict) -> tuple[RowChecksums, bool]:
        """Check the rows file against ``index`` (its size, a sample of its checksummed blocks; see the module
        docstring), drop the entries of damaged rows so that the update decodes them again, and return the
        checksums and whether the index changed (a repair, or checksums made for the first time)."""
        sums = RowChecksums.from_index(index)
        changed = sums is None
        if sums is None:  # a new cache, or one written before checksums: they are made from its rows
            sums = RowChecksums.for_rows(index["pixels"], self.row_bytes, self.block_bytes)
        rows, path = index["rows"], self.folder / index["pixels"]
        if rows == 0:  # nothing to check; the record is written with the first rows
            return sums, False
        lost, why = set(), []
        with output_errors(path, "set --cache-dir to a writable folder"), open(path, "r+b") as f:
            fd = f.fileno()
            intact = os.fstat(fd).st_size // self.row_bytes
            if intact < rows:  # truncated: the blocks from the first missing row on are lost
                first = sums.block_of(intact)
                lost.update(range(first, sums.block_of(rows - 1) + 1))
                why.append(f"its rows file is truncated ({intact} of {rows} rows)")
                f.truncate(rows * self.row_bytes)  # its length back (zeros): row numbers are never reused
                sums.drop_from(first)
            if sums.rows < rows:
                if sums.rows == 0 and not lost:
                    LOG.info("image cache %s: checksumming its %d rows (written before checksums)", self.folder, rows)
                sums.cover(fd, self.row_bytes, rows)
                changed = True
            sample = [b for b in sums.sample(self.sample_blocks, self._rng) if b not in lost]
            bad = sums.damaged(fd, self.row_bytes, sample)
            if bad:  # one damaged block: check them all
                bad = sums.damaged(fd, self.row_bytes, [b for b in range(len(sums.crc32)) if b not in lost])
                why.append(
                    "1 block of rows fails its checksum"
                    if len(bad) == 1
                    else f"{len(bad)} blocks of rows fail their checksums"
                )
                sums.recompute(fd, self.row_bytes, bad)  # their rows are dead from now on
                lost.update(bad)
        if not lost:
            return sums, changed
        damaged = [p for p, entry in index["entries"].items() if sums.block_of(entry[0]) in lost]
        for p in damaged:
            del index["entries"][p]
        LOG.warning(
            "image cache %s is damaged (%s): decoding its %d images there again",
            self.folder,
            "; ".join(why),
            len(damaged),
        )
        return sums, True

    def _decode_into(
        self, index: dict, todo: list[FoundFile], sums: RowChecksums, workers: int, progress: bool
    ) -> None:
        from tqdm import tqdm

        row_bytes = self.row_bytes
        assert sums.rows == index["rows"], "checksums cover every row before rows are appended"
        tasks = [(str(self.root / f.path), self.side) for f in todo]
        bar = tqdm(
            total=len(todo),
            unit="img",
            desc=f"caching images at {self.side} px",
            disable=not progress,
            dynamic_ncols=True,
            leave=False,
        )
        pool = _context().Pool(workers) if workers > 0 and len(todo) > 64 else None
        results = pool.imap(_decode_task, tasks, chunksize=16) if pool else map(_decode_task, tasks)
        path = self.folder / index["pixels"]
        try:
            with (
                output_errors(path, "set --cache-dir to a writable folder"),
                open(path, "r+b" if path.exists() else "w+b") as out,
            ):
                out.seek(index["rows"] * row_bytes)
                row = index["rows"]
                for f, (pixels, width, height, reason) in zip(todo, results):
                    bar.update(1)
                    if pixels is None:
                        LOG.warning("skipping %s: %s", display_name(f.path), reason)
                        index["failed"][f.path] = [f.bytes, f.mtime_ns, reason]
                        index["entries"].pop(f.path, None)
                        continue
                    data = pixels.tobytes()
                    out.write(data)
                    sums.add(data)
                    index["entries"][f.path] = [row, f.bytes, f.mtime_ns, width, height]
                    index["failed"].pop(f.path, None)
                    row += 1
                out.flush()
                os.fsync(out.fileno())
                index["rows"] = row
        finally:
            bar.close()
            if pool is not None:
                pool.terminate()

    def _compact_if_sparse(self, index: dict, sums: RowChecksums) -> tuple[RowChecksums, set[str]]:
        """Copy the live rows to a new pixels file when more than half of the rows are dead (the old file is
        deleted once nobody holds it: :meth:`_delete_unheld`), verifying each block it copies from.

        Returns:
            the new rows file's checksums (``sums`` when nothing was compacted), and the paths whose rows were
            in a damaged block: dropped from the index, for the caller to decode again.
        """
        live = len(index["entries"])
        if index["rows"] <= 2 * live or index["rows"] < self.compact_min_rows:
            return sums, set()
        row_bytes = self.row_bytes
        old = self.folder / index["pixels"]
        new = self.folder / f"pixels-{_rows_file_number(index['pixels']) + 1}.u8"
        fresh = RowChecksums(new.name, sums.block_rows)
        by_block: dict[int, list[tuple[str, list]]] = {}
        for path, entry in sorted(index["entries"].items(), key=lambda kv: kv[1][0]):
            by_block.setdefault(sums.block_of(entry[0]), []).append((path, entry))
        lost: set[str] = set()
        with output_errors(new, "set --cache-dir to a writable folder"), open(old, "rb") as src, open(new, "wb") as out:
            for block, items in by_block.items():
                start, stop = sums.span(block)
                data = os.pread(src.fileno(), (stop - start) * row_bytes, start * row_bytes)
                if not sums.matches(block, data):
                    lost.update(path for path, _ in items)
                    continue
                for _, entry in items:
                    row = data[(entry[0] - start) * row_bytes : (entry[0] - start + 1) * row_bytes]
                    out.write(row)
                    entry[0] = fresh.rows
                    fresh.add(row)
            out.flush()
            os.fsync(out.fileno())
        for path in lost:
            del index["entries"][path]
        if lost:
            LOG.warning(
                "image cache %s is damaged (rows failing their checksum while compacting): decoding its "
                "%d images there again",
                self.folder,
                len(lost),
            )
        LOG.info("compacted the image cache %s: %d live of %d rows", self.folder, fresh.rows, index["rows"])
        index["pixels"], index["rows"] = new.name, fresh.rows
        return fresh, lost

    def _delete_unheld(self, current: str) -> None:
        """Delete the rows files other than ``current`` that no reader holds (replaced by a compaction, or left
        by a killed one). Without flock nothing tells whether a file is held, so none is deleted."""
        if fcntl is None:
            return
        for path in self.folder.glob("pixels-*.u8"):
            if path.name == current:
                continue
            with output_errors(path, "set --cache-dir to a writable folder"):
                with open(path, "rb") as probe:
                    try:
                        fcntl.flock(probe.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:  # a reader holds it: a later update deletes it
                        continue
                    path.unlink()


def _context():
    # forkserver: workers fork from a clean server process, never from a parent holding threads (torch's)
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")
