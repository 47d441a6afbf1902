"""Reading, hashing, decoding and resizing image files in worker processes, in input order.

Each file is read once: its bytes give the sha256 and are decoded with the encoder's own
``load_image`` + ``preprocess_image`` (the server's preprocessing, so index and query embed alike).
Workers never hold an ONNX Runtime session; they return uint8 ``[H, W, 3]`` arrays to the parent, which
batches them for the encoder. Unreadable files come back with a one-line reason instead of pixels.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

from trainer.errors import DataError

LOG = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 30  # files over 1 GiB are refused before they are read into memory


@dataclass
class Decoded:
    """One file after decoding: ``pixels`` uint8 ``[size, size, 3]``, or ``None`` with ``error`` set."""

    path: str
    pixels: np.ndarray | None
    width: int
    height: int
    bytes: int
    sha256: str
    error: str | None
    seconds: float  # time spent reading + decoding + resizing this file (in its worker)


def decode_file(task: tuple[str, str, int, str]) -> Decoded:
    """Read, hash, decode and preprocess one file: ``(relative path, absolute path, image size, resize)``."""
    from indexer.encoder import load_image, preprocess_image

    rel, absolute, image_size, resize = task
    tic = time.perf_counter()
    try:
        size = os.path.getsize(absolute)
        if size > MAX_FILE_BYTES:
            raise DataError(f"file too large ({size} bytes)")
        with open(absolute, "rb") as f:
            data = f.read()
        sha256 = hashlib.sha256(data).hexdigest()
        if not data:
            raise DataError("empty file")
        with warnings.catch_warnings():  # images over the limit are refused below; no warning per file
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = load_image(data)
        pixels = preprocess_image(image, image_size, resize)
        return Decoded(rel, pixels, image.width, image.height, len(data), sha256, None, time.perf_counter() - tic)
    except DataError as exc:
        reason = str(exc).replace("image data: ", "").replace("image data is empty", "empty file")
        reason = re.sub(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", reason)
    except OSError as exc:
        reason = f"cannot read ({exc.strerror or exc})"
    except Exception as exc:  # a decoder bug on a hostile file must not stop a 10-million-file run
        reason = f"not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]
    return Decoded(rel, None, 0, 0, 0, "", reason, time.perf_counter() - tic)


def _context():
    # forkserver: workers fork from a clean server process, never from a parent that may hold threads (ORT,
    # torch in `moco demo`); spawn where forkserver does not exist.
    if sys.platform.startswith("linux"):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["indexer.decode", "indexer.encoder"])
        return ctx
    return multiprocessing.get_context("spawn")


def decode_files(root: Path, paths: list[str], image_size: int, resize: str, workers: int,
                 chunksize: int = 8) -> Iterator[Decoded]:
    """Decode ``root / path`` for each path, yielding results in input order.

    Args:
        workers: processes decoding in parallel; 0 decodes in this process (simplest, for tiny folders).
        chunksize: files handed to a worker at a time.
    """
    tasks = ((p, str(root / p), image_size, resize) for p in paths)
    if workers <= 0:
        yield from map(decode_file, tasks)
        return
    with _context().Pool(workers) as pool:
        yield from pool.imap(decode_file, tasks, chunksize=chunksize)
