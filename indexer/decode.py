"""Reading, hashing, decoding and resizing image files in worker processes, in input order.

Each file is read once (:func:`contracts.images.read_image_bytes`: regular files only, never blocking): its
bytes give the sha256 and are decoded with :func:`contracts.images.decode_image` (told the encoder's size, so
a JPEG is decoded reduced) and the encoder's resize policy (:func:`contracts.encoder_format.preprocess_image`),
the server's preprocessing exactly, so index and query embed alike.
Workers never hold an ONNX Runtime session; they return each chunk's uint8 ``[H, W, 3]`` pixels to the parent
as one array (:func:`decode_chunk`), which batches them for the encoder. Unreadable files come back with a
one-line reason instead of pixels.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from moco_retrieval.contracts.encoder_format import preprocess_image
from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.images import decode_image, read_image_bytes

LOG = logging.getLogger(__name__)


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
    seconds: float  # CPU seconds of reading + decoding + resizing this file (its thread's, not the wall clock)


def decode_file(task: tuple[str, str, int, str]) -> Decoded:
    """Read, hash, decode and preprocess one file: ``(relative path, absolute path, image size, resize)``."""
    rel, absolute, image_size, resize = task
    tic = time.thread_time()  # CPU, not wall: a decoder waiting for a core it shares must not count that wait
    try:
        data = read_image_bytes(absolute)
        sha256 = hashlib.sha256(data).hexdigest()
        image = decode_image(data, target_size=image_size)  # reduced while decoding where the format allows it
        pixels = preprocess_image(image, image_size, resize)
        width, height = image.info["source_size"]
        return Decoded(rel, pixels, width, height, len(data), sha256, None, time.thread_time() - tic)
    except DataError as exc:
        reason = str(exc).replace("image data: ", "")
    except Exception as exc:  # a decoder bug on a hostile file must not stop a 10-million-file run
        reason = f"not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]
    return Decoded(rel, None, 0, 0, 0, "", reason, time.thread_time() - tic)


def decode_chunk(tasks: list[tuple[str, str, int, str]]) -> tuple[np.ndarray | None, list[Decoded]]:
    """:func:`decode_file` of each task, as one message back to the parent: the readable files' pixels stacked
    into one uint8 ``[n_readable, H, W, 3]`` array (``None`` when none is readable), the ``Decoded`` of every
    task with its ``pixels`` left out. One array crosses the pipe instead of one a file: pickling and
    unpickling 3.0 instead of 10.5 us a file of 32 x 32 pixels."""
    decoded = [decode_file(task) for task in tasks]
    readable = [d.pixels for d in decoded if d.pixels is not None]
    for d in decoded:
        d.pixels = None
    return (np.stack(readable) if readable else None), decoded


def _unchunk(chunk: tuple[np.ndarray | None, list[Decoded]]) -> list[Decoded]:
    """The ``Decoded`` of a :func:`decode_chunk` message, each readable one holding its row of the array."""
    pixels, decoded = chunk
    readable = (d for d in decoded if d.error is None)
    for d, row in zip(readable, pixels if pixels is not None else ()):
        d.pixels = row
    return decoded


def start_decoder_server() -> None:
    """Start the decode processes' fork server now rather than when the pool opens: it boots on a core of its
    own (a new interpreter importing numpy, Pillow and this module, ~0.2 s) while this process scans the folder
    and opens the encoder, where the encoder lanes used to wait for it. A no-op where workers are spawned."""
    if _context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


def _context():
    # forkserver: workers fork from a clean server process, never from a parent that may hold threads (ORT,
    # torch in `moco demo`); spawn where forkserver does not exist.
    if sys.platform.startswith("linux"):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["moco_retrieval.indexer.decode"])
        return ctx
    return multiprocessing.get_context("spawn")


def _start_decoder() -> None:
    """A decode process's initializer.

    - Ctrl-C is left to the process that started the pool, which stops it (each decoder printed a traceback).
    - The decoder ends when that process dies: after a ``kill -9`` of ``moco index`` its ``concurrent.futures``
      workers (which hold both ends of their task queue, so never see it close) and their fork server ran on.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


DECODE_WINDOW = 1024  # files per window handed to the pool; at most two windows are decoded ahead of the reader


def decode_files(
    root: Path,
    paths: list[str],
    image_size: int,
    resize: str,
    workers: int,
    chunksize: int = 32,
    window: int = DECODE_WINDOW,
) -> Iterator[Decoded]:
    """Decode ``root / path`` for each path, yielding results in input order.

    The pool gets the files a ``window`` at a time, the next window while the reader takes the current one, so
    at most ``2 * window`` decoded images wait in memory however far the decoders run ahead of the reader
    (mapping every file at once: with a CPU encoder 3-4x slower than decoding, a folder of a million 224-px
    images would pile up tens of GB of pixels).

    A ``concurrent.futures`` process pool, not ``multiprocessing.Pool``: the latter's worker-handler thread
    wakes for every result waiting in its pipe and polls each worker, 1.3 of the 25 CPU seconds of embedding
    56,000 small PNGs on 2 cores; and a decoder that dies here ends the run with a one-line error where
    ``Pool`` waited forever for the lost files.

    Args:
        workers: processes decoding in parallel; 0 decodes in this process (simplest, for tiny folders).
        chunksize: files handed to a worker at a time, and sent back as one message: the pool's result thread
            wakes once per message (56,000 small PNGs: 1.5 CPU seconds at 8, 0.8-0.9 at 32).
        window: files per window (at least ``chunksize``).
    """
    base = os.fspath(root)  # os.path.join, not pathlib: 0.6 instead of 3.1 us a file in the feeding thread
    tasks = ((p, os.path.join(base, p), image_size, resize) for p in paths)
    if workers <= 0:
        yield from map(decode_file, tasks)
        return
    windows = iter(lambda: list(itertools.islice(tasks, max(window, chunksize))), [])

    def submit(files: list) -> Iterator:  # a window, as chunks of ``chunksize`` files (one message each)
        return pool.map(decode_chunk, [files[i : i + chunksize] for i in range(0, len(files), chunksize)])

    pool = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_start_decoder)
    try:
        ahead = collections.deque(submit(w) for w in itertools.islice(windows, 2))
        while ahead:
            for chunk in ahead.popleft():
                yield from _unchunk(chunk)
            following = next(windows, None)
            if following is not None:
                ahead.append(submit(following))
    except BrokenProcessPool as exc:  # killed (out of memory, a signal) or crashed in a decoder
        raise DataError(
            "a decoding process died (out of memory, killed, or a decoder crashed on a file); run the same "
            "command again to resume, or --workers 0 to decode in this process and see which file"
        ) from exc
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
