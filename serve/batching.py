"""Request micro-batching: concurrent queries are embedded and searched together by one worker thread.

Callers (HTTP handler threads) decode and resize their own image, then :meth:`MicroBatcher.submit` a job
and wait on its future. The worker takes the first waiting job, keeps collecting jobs for up to
``max_wait`` seconds or until ``max_batch`` rows (a job that would carry the batch past ``max_batch`` starts
the next batch; a job larger than ``max_batch`` runs whole, alone), and runs ``run(key, rows, k)`` once for
each group of jobs that share a ``key`` (the index generation they were decoded for, so one batch never mixes
two models), with ``k`` the largest any job of the group asked for.

One worker means the encoder session and the FAISS index are only ever used from one thread at a time
(FAISS GPU indexes are not thread-safe), while batching keeps the throughput of a larger batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

LOG = logging.getLogger(__name__)

_STOP = object()


@dataclass
class BatchOutput:
    """What one job gets back: its rows of the batch result plus how the batch went."""

    value: Any  # the job's slice of run()'s per-row result
    batch_rows: int  # rows embedded together with this job's rows (its own included)
    seconds: dict[str, float]  # phase -> seconds for the whole batch (as reported by run())
    queued: float  # seconds the job waited before its batch started


@dataclass
class _Job:
    key: Any
    rows: np.ndarray
    k: int
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


class MicroBatcher:
    """One worker thread running ``run`` over batches of concurrently submitted rows.

    Args:
        run: ``run(key, rows, k) -> (results, seconds)`` with ``rows`` the concatenated ``[N, ...]`` rows of
            the group, ``k`` the group's largest ``k``, ``results`` a sequence of N per-row results and
            ``seconds`` a dict of phase timings for the batch.
        max_batch: most rows per ``run`` call (a single larger job still runs whole, alone).
        max_wait: seconds the worker waits for more jobs after the first one arrived.
    """

    def __init__(
        self,
        run: Callable[[Any, np.ndarray, int], tuple[list, dict[str, float]]],
        max_batch: int,
        max_wait: float,
        name: str = "moco-batcher",
    ):
        self._run = run
        self.max_batch = max_batch
        self.max_wait = max_wait
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Jobs waiting for the worker (a moment's view: the metrics' queue depth)."""
        return self._queue.qsize()

    def submit(self, key: Any, rows: np.ndarray, k: int) -> Future:
        """Queue ``rows`` ``[n, ...]`` for ``key`` wanting ``k`` results each; resolves to a :class:`BatchOutput`."""
        if self._closed:
            raise RuntimeError("the batcher is closed")
        job = _Job(key, rows, k)
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Finish the queued jobs, then stop the worker."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout=30)

    def _collect(self, first: _Job) -> tuple[list[_Job], _Job | None, bool]:
        """``(the batch's jobs, a job taken that starts the next batch or None, whether close() was seen)``."""
        jobs, rows = [first], len(first.rows)
        deadline = time.perf_counter() + self.max_wait
        while rows < self.max_batch:
            timeout = deadline - time.perf_counter()
            try:
                job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                return jobs, None, True
            if rows + len(job.rows) > self.max_batch:  # (a queue cannot be peeked: keep it for the next batch)
                return jobs, job, False
            jobs.append(job)
            rows += len(job.rows)
        return jobs, None, False

    def _loop(self) -> None:
        held = None
        while True:
            first = held if held is not None else self._queue.get()
            if first is _STOP:
                break
            jobs, held, stop = self._collect(first)
            groups: dict[int, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(id(job.key), []).append(job)
            for group in groups.values():
                self._run_group(group)
            if stop:
                break

    def _run_group(self, jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not jobs:
            return
        started = time.perf_counter()
        try:
            rows = np.concatenate([job.rows for job in jobs]) if len(jobs) > 1 else jobs[0].rows
            results, seconds = self._run(jobs[0].key, rows, max(job.k for job in jobs))
        except BaseException as exc:  # handed to every waiting caller, who re-raises it in its own thread
            for job in jobs:
                job.future.set_exception(exc)
            return
        start = 0
        for job in jobs:
            n = len(job.rows)
            job.future.set_result(BatchOutput(results[start : start + n], len(rows), seconds, started - job.enqueued))
            start += n
