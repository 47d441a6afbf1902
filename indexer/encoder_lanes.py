"""Keeping an encoder busy from a Python loop: its batches run on ``lanes`` threads, results come back in order.

ONNX Runtime releases the GIL in ``session.run`` and a session may be run from several threads at once, so the
loop that decodes, batches and stores (``moco index``) or searches and writes rows (``moco search`` /
``moco classify`` over a folder) works while the encoder runs, instead of taking turns with it.

On the CPU two lanes of ``cores / 2`` intra-op threads each beat one lane of all the cores: one run's threads
no longer wait at every operator for a thread the decode process has taken the core from, and one run fills
the gaps of the other. 56,000 Fashion-MNIST PNGs, the embed phase of ``moco index`` in one process on 2 cores
(ResNet-18 at 32 px, batches of 64, one decode process), six alternated rounds: 1.085x the images/s of one
lane of 2 threads (median; 1.04-1.13x, every round faster), while one lane of 2 threads on a thread of its
own gained nothing (1.00x).
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from moco_retrieval.indexer.encoder import available_cores

Tag = TypeVar("Tag")

CPU_LANES = 2  # encoder runs in flight on the CPU (see the module docstring)


def lane_threads(lanes: int, cores: int | None = None) -> int:
    """Intra-op threads of each of ``lanes`` CPU runs sharing ``cores`` (default: the usable cores): at least 1."""
    return max(1, (cores or available_cores()) // max(1, lanes))


def embed_in_order(
    embed: Callable[[np.ndarray], np.ndarray],
    batches: Iterable[tuple[Tag, np.ndarray | None]],
    lanes: int,
) -> Iterator[tuple[Tag, np.ndarray | None, float]]:
    """``(tag, embed(pixels), seconds)`` of each ``(tag, pixels)`` of ``batches``, in their order.

    Up to ``lanes`` calls of ``embed`` run at once on threads of their own, and one more batch waits for a free
    lane, so the lanes stay busy while the caller handles a result (``batches`` is read in the caller's thread,
    one batch ahead). ``pixels`` may be ``None`` (a batch of only unreadable files): it comes back as ``None``.

    Args:
        embed: uint8 ``[N, H, W, 3]`` -> float32 ``[N, D]`` (``OnnxEncoder.embed``); safe to call from threads.
        lanes: calls in flight (at least 1).

    Yields:
        ``seconds``: how long that call of ``embed`` ran (0 for ``None``).

    Raises:
        whatever ``embed`` raised, when its batch's turn comes. Closing the iterator cancels the batches not
        started and waits for the running ones (at most ``lanes``).
    """

    def timed(pixels: np.ndarray) -> tuple[np.ndarray, float]:
        tic = time.perf_counter()
        return embed(pixels), time.perf_counter() - tic

    nothing: Future = Future()
    nothing.set_result((None, 0.0))
    ahead: collections.deque = collections.deque()
    pool = ThreadPoolExecutor(max(1, lanes), thread_name_prefix="encoder")
    try:
        for tag, pixels in batches:
            ahead.append((tag, nothing if pixels is None else pool.submit(timed, pixels)))
            if len(ahead) > lanes:
                tag, done = ahead.popleft()
                yield (tag, *done.result())
        while ahead:
            tag, done = ahead.popleft()
            yield (tag, *done.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
