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
                       "failed": {path: [bytes, mtime_ns, reason]}}
    pixels-<n>.u8     raw uint8 rows [rows, side, side, 3]
    .lock             held (flock) while the cache is updated

An entry is valid while the file's size and mtime are unchanged: a later run decodes only new and changed
files (appended as new rows) and forgets removed ones; a file that failed to decode is not retried until it
changes. Rows are written and flushed before ``index.json`` is replaced atomically, so a killed update leaves
the previous index, whose rows are untouched. When more than half of the rows are dead the live ones are
copied to a new pixels file. Concurrent runs on the same folder take turns on the lock; a reader only ever
reads rows its own index snapshot names, which no later update overwrites.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

from moco_retrieval.contracts.atomic import output_errors, write_json_atomic
from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.images import FoundFile, decode_image

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
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
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


@dataclass
class CachedImages:
    """Cached pixels of a list of images: row ``i`` of the cache file is image ``rows.index(i)``.

    Attributes:
        folder: the cache folder; pixels_file: its rows file; side: stored side.
        rows: int64 ``[N]`` cache row of each image (in the caller's order).
        sizes: int64 ``[N, 2]`` original (width, height).
    """

    folder: Path
    pixels_file: Path
    side: int
    rows: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def open(self) -> np.ndarray:
        """The rows file memory-mapped read-only, ``[rows, side, side, 3]`` (open it once per process)."""
        total = self.pixels_file.stat().st_size // (self.side * self.side * 3)
        return np.memmap(self.pixels_file, dtype=np.uint8, mode="r", shape=(total, self.side, self.side, 3))


class ImageCache:
    """The cache of one image folder at one side; :meth:`update` brings it up to date with the folder."""

    def __init__(self, root: str | os.PathLike, side: int, cache_root: str | os.PathLike | None = None):
        self.root = Path(root)
        self.side = side
        self.folder = cache_dir_for(root, side, cache_root)

    def _read_index(self) -> dict:
        try:
            index = json.loads((self.folder / INDEX_FILE).read_text())
        except FileNotFoundError:
            index = None
        except (OSError, ValueError) as exc:
            LOG.warning("image cache index %s is unreadable (%s); rebuilding the cache", self.folder, exc)
            index = None
        if (not isinstance(index, dict) or index.get("format") != CACHE_FORMAT
                or index.get("format_version") != CACHE_VERSION or index.get("side") != self.side
                or not (self.folder / str(index.get("pixels"))).is_file()):
            return {"format": CACHE_FORMAT, "format_version": CACHE_VERSION, "side": self.side,
                    "pixels": "pixels-0.u8", "rows": 0, "entries": {}, "failed": {}}
        return index

    def update(self, files: list[FoundFile], workers: int = 0, progress: bool = True) -> tuple[CachedImages, dict]:
        """Decode what is new or changed among ``files`` and return the cached view of the readable ones.

        Args:
            files: the folder's image files (``walk_image_files``; entries with a skip reason are passed over).
            workers: decoding processes (0: in this process).
            progress: show a progress bar while decoding.

        Returns:
            ``(cached, failed)``: the readable files' rows in ``files`` order, and ``{path: reason}`` of the
            files that do not decode.
        """
        files = [f for f in files if f.skip_reason is None]
        with _locked(self.folder):
            index = self._read_index()
            entries, failed = index["entries"], index["failed"]
            todo = []
            for f in files:
                entry, fail = entries.get(f.path), failed.get(f.path)
                if entry is not None and entry[1] == f.bytes and entry[2] == f.mtime_ns:
                    continue
                if fail is not None and fail[0] == f.bytes and fail[1] == f.mtime_ns:
                    continue
                todo.append(f)
            present = {f.path for f in files}
            dropped = [p for p in entries if p not in present] + [p for p in failed if p not in present]
            for p in dropped:
                entries.pop(p, None)
                failed.pop(p, None)
            if todo:
                self._decode_into(index, todo, workers, progress)
            if todo or dropped:
                replaced = self._compact_if_sparse(index)
                write_json_atomic(self.folder / INDEX_FILE, index, "set --cache-dir to a writable folder")
                if replaced is not None:  # readers that mapped the old file keep their mapping
                    replaced.unlink(missing_ok=True)
        readable = [f for f in files if f.path in entries]
        rows = np.array([entries[f.path][0] for f in readable], dtype=np.int64)
        sizes = np.array([entries[f.path][3:5] for f in readable], dtype=np.int64).reshape(-1, 2)
        cached = CachedImages(self.folder, self.folder / index["pixels"], self.side, rows, sizes)
        return cached, {f.path: failed[f.path][2] for f in files if f.path in failed}

    def _decode_into(self, index: dict, todo: list[FoundFile], workers: int, progress: bool) -> None:
        from tqdm import tqdm

        row_bytes = self.side * self.side * 3
        tasks = [(str(self.root / f.path), self.side) for f in todo]
        tic = time.perf_counter()
        bar = tqdm(total=len(todo), unit="img", desc=f"caching images at {self.side} px", disable=not progress,
                   dynamic_ncols=True, leave=False)
        pool = _context().Pool(workers) if workers > 0 and len(todo) > 64 else None
        results = pool.imap(_decode_task, tasks, chunksize=16) if pool else map(_decode_task, tasks)
        path = self.folder / index["pixels"]
        try:
            with output_errors(path, "set --cache-dir to a writable folder"), open(path, "r+b" if path.exists()
                                                                                   else "w+b") as out:
                out.seek(index["rows"] * row_bytes)
                row = index["rows"]
                for f, (pixels, width, height, reason) in zip(todo, results):
                    bar.update(1)
                    if pixels is None:
                        LOG.warning("skipping %s: %s", display_name(f.path), reason)
                        index["failed"][f.path] = [f.bytes, f.mtime_ns, reason]
                        index["entries"].pop(f.path, None)
                        continue
                    out.write(pixels.tobytes())
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
        unreadable = sum(1 for f in todo if f.path in index["failed"])
        LOG.info("cached %d images at %d px in %.1f s (%s)%s", len(todo) - unreadable, self.side,
                 time.perf_counter() - tic, self.folder, f"; {unreadable} unreadable" if unreadable else "")

    def _compact_if_sparse(self, index: dict) -> Path | None:
        """Copy the live rows to a new pixels file when more than half of the rows are dead; returns the
        replaced file (to delete once the new index is written), or None."""
        live = len(index["entries"])
        if index["rows"] <= 2 * live or index["rows"] < COMPACT_MIN_ROWS:
            return None
        row_bytes = self.side * self.side * 3
        old = self.folder / index["pixels"]
        number = int(index["pixels"].split("-")[1].split(".")[0]) + 1
        new = self.folder / f"pixels-{number}.u8"
        src = np.memmap(old, dtype=np.uint8, mode="r", shape=(index["rows"], row_bytes))
        with output_errors(new, "set --cache-dir to a writable folder"), open(new, "wb") as out:
            for new_row, (path, entry) in enumerate(sorted(index["entries"].items(), key=lambda kv: kv[1][0])):
                out.write(src[entry[0]].tobytes())
                entry[0] = new_row
            out.flush()
            os.fsync(out.fileno())
        del src
        LOG.info("compacted the image cache %s: %d live of %d rows", self.folder, live, index["rows"])
        index["pixels"], index["rows"] = new.name, live
        return old


def _context():
    # forkserver: workers fork from a clean server process, never from a parent holding threads (torch's)
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")
