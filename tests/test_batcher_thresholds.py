"""Every limit of the query micro-batcher and of what feeds it, crossed cheaply (a lowered constructor parameter,
one-row inputs) and checked on both sides (issue 19): results identical to unbatched ones where a limit only
splits or joins work, the typed error and its HTTP status where a limit refuses.

One test per limit; each docstring's first line names it. No timing is asserted: the worker is held on a gate
(an Event) so that jobs queue up in a known order, and the one wait that ends by time is tens of ms. (The upload
byte budget of the HTTP API, ``ByteBudget``, has its both-sides test in ``tests/test_serve_http.py``.)"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from moco_retrieval.contracts.errors import BatchTooLargeError, ConfigError
from moco_retrieval.serve.answers import duplicates_answer, search_answer
from moco_retrieval.serve.batching import MicroBatcher
from tests._serve_helpers import RunningServer

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)


def _rows(*values: int) -> np.ndarray:
    """One row ``[v, v]`` per value: a job's rows, told apart by their value."""
    return np.array([[v, v] for v in values], dtype=np.float32)


def _per_row(key, rows: np.ndarray, k: int) -> list:
    """What ``run`` answers for each row (a pure function of the row: batched or not, the same)."""
    return [(key, float(r[0]) * 2, k) for r in rows]


class GatedRun:
    """A batcher ``run`` that records the rows of each call; the first call waits for :attr:`gate`, so that jobs
    submitted meanwhile queue up behind it in a known order."""

    def __init__(self):
        self.started, self.gate = threading.Event(), threading.Event()
        self.batches: list[list[float]] = []

    def __call__(self, key, rows, k):
        if not self.started.is_set():
            self.started.set()
            assert self.gate.wait(10), "the test never opened the gate"
        self.batches.append([float(r[0]) for r in rows])
        return _per_row(key, rows, k), {"run": 0.0}


def _check_unbatched(jobs: dict, futures: dict) -> None:
    for name, rows in jobs.items():
        out = futures[name].result(timeout=10)
        assert out.value == _per_row("g", rows, 4), name  # this job's slice of the batch, as if it ran alone


# -- MicroBatcher ------------------------------------------------------------------------------------------
def test_max_batch__queued_jobs_fill_a_batch_up_to_it_and_the_next_job_starts_a_new_one():
    """max_batch (serve/batching.py): rows per run call. At the limit, jobs run together; a job that would carry
    the batch past it starts the next batch (it used to join: 4 rows for a limit of 3); a job larger than the
    limit runs whole, alone. Each job gets exactly what it would get alone."""
    run = GatedRun()
    batcher = MicroBatcher(run, max_batch=3, max_wait=0)
    try:
        futures = {"blocker": batcher.submit("g", _rows(0), 4)}
        assert run.started.wait(10)
        jobs = {
            "a": _rows(1),
            "b": _rows(2, 3),  # a + b: 3 rows, the limit exactly
            "c": _rows(4),
            "d": _rows(5, 6, 7),  # c + d would be 4: d starts the next batch
            "e": _rows(8, 9, 10, 11, 12),  # larger than the limit: whole, alone
            "f": _rows(13),
        }
        futures |= {name: batcher.submit("g", rows, 4) for name, rows in jobs.items()}
        run.gate.set()
        _check_unbatched(jobs, futures)
        assert run.batches == [[0], [1, 2, 3], [4], [5, 6, 7], [8, 9, 10, 11, 12], [13]]
        assert [futures[n].result().batch_rows for n in "abcdef"] == [3, 3, 1, 3, 5, 1]
    finally:
        batcher.close()


def test_max_batch__close_runs_a_job_held_back_for_the_next_batch():
    """max_batch with close(): the job kept for the next batch when close() arrives still runs (none is lost)."""
    run = GatedRun()
    batcher = MicroBatcher(run, max_batch=2, max_wait=0)
    blocker = batcher.submit("g", _rows(0), 4)
    assert run.started.wait(10)
    jobs = {"a": _rows(1, 2), "b": _rows(3, 4)}  # b does not fit beside a: held back, then close() is queued
    futures = {name: batcher.submit("g", rows, 4) for name, rows in jobs.items()}
    run.gate.set()
    batcher.close()
    assert blocker.result(timeout=10).value == _per_row("g", _rows(0), 4)
    _check_unbatched(jobs, futures)
    assert run.batches == [[0], [1, 2], [3, 4]]


def test_max_wait__jobs_arriving_within_it_join_the_batch_which_runs_once_full():
    """max_wait (serve/batching.py), inside it: jobs submitted while the worker waits join the first one's batch,
    and a full batch runs at once (a wait of 60 s that ended early: this test would otherwise take a minute)."""
    run = GatedRun()
    run.gate.set()
    batcher = MicroBatcher(run, max_batch=3, max_wait=60)
    try:
        jobs = {"a": _rows(1), "b": _rows(2), "c": _rows(3)}
        futures = {name: batcher.submit("g", rows, 4) for name, rows in jobs.items()}
        _check_unbatched(jobs, futures)
        assert run.batches == [[1, 2, 3]]
    finally:
        batcher.close()


def test_max_wait__past_it_a_batch_runs_with_the_jobs_it_has():
    """max_wait past its end: a lone job does not wait for a batch to fill (max_wait 20 ms, then 0)."""
    for max_wait in (0.02, 0):
        run = GatedRun()
        run.gate.set()
        batcher = MicroBatcher(run, max_batch=8, max_wait=max_wait)
        try:
            future = batcher.submit("g", _rows(7), 4)
            assert future.result(timeout=10).value == _per_row("g", _rows(7), 4)
            assert future.result().batch_rows == 1 and run.batches == [[7]]
        finally:
            batcher.close()


# -- the engine around it ----------------------------------------------------------------------------------------
def _engine(index, **kw):
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    return SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0, **kw))


def _queries(serve_corpus, n: int) -> list[bytes]:
    paths = sorted(serve_corpus.rglob("*.png"))
    return [p.read_bytes() for p in paths[:: max(1, len(paths) // n)][:n]]


def _same_hits(a, b) -> None:
    assert [h["id"] for h in a.hits] == [h["id"] for h in b.hits]
    assert [h["score"] for h in a.hits] == pytest.approx([h["score"] for h in b.hits], abs=1e-5)


def test_max_batch__engine_answers_equal_unbatched_ones_below_at_and_past_it(served_index, serve_corpus):
    """EngineConfig.max_batch (2 here) through the engine: a request of 1, 2 (the limit) or 5 images (past it,
    one job run whole) and concurrent single requests answer exactly what each image alone answers."""
    images = _queries(serve_corpus, 5)
    with _engine(served_index, max_batch=1) as alone:
        singles = [alone.search([img], k=5)[0] for img in images]
    with _engine(served_index, max_batch=2) as engine:
        for n in (1, 2, 5):
            results = engine.search(images[:n], k=5)
            assert [r.batch_size for r in results] == [n] * n
            for res, single in zip(results, singles):
                _same_hits(res, single)
        with ThreadPoolExecutor(5) as pool:
            concurrent = list(pool.map(lambda img: engine.search([img], k=5)[0], images))
        assert all(r.batch_size <= 2 for r in concurrent)
        for res, single in zip(concurrent, singles):
            _same_hits(res, single)


def test_max_queries__at_the_limit_answered_one_more_refused_with_413(served_index, serve_corpus):
    """EngineConfig.max_queries (3 here): 3 images or ids are answered as 3 single requests; 4 raise
    BatchTooLargeError, 413 over HTTP naming the limit, before anything is decoded or searched."""
    from moco_retrieval.serve.http import create_app

    images = _queries(serve_corpus, 4)
    with _engine(served_index, max_queries=3) as engine:
        ids = [1, 5, 9, 13]
        batch = engine.search_by_ids(ids[:3], k=4)
        for res, item in zip(batch, ids):
            _same_hits(res, engine.search_by_id(item, k=4))
        with pytest.raises(BatchTooLargeError, match="4 query ids in one request; the limit is 3"):
            engine.search_by_ids(ids, k=4)
        server = RunningServer(create_app(engine, metrics=False))
        try:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                files = [("image", (f"q{i}.png", img, "image/png")) for i, img in enumerate(images)]
                r = client.post("/api/search", params={"k": 4}, files=files[:3])
                assert r.status_code == 200, r.text
                for answer, img in zip(r.json()["responses"], images):
                    single = client.post("/api/search", params={"k": 4}, files={"image": ("q.png", img, "image/png")})
                    assert [h["id"] for h in answer["results"]] == [h["id"] for h in single.json()["results"]]
                r = client.post("/api/search", params={"k": 4}, files=files)
                assert r.status_code == 413 and "the limit is 3" in r.json()["error"]
                assert client.post("/api/search/ids", json={"ids": ids[:3]}).status_code == 200
                r = client.post("/api/search/ids", json={"ids": ids})
                assert r.status_code == 413 and "the limit is 3" in r.json()["error"]
        finally:
            server.stop()
        assert engine.queries == 3 + 3 + 3 + 3 + 3  # the refused batches searched nothing (3 ids by id above)


def test_max_k__at_the_limit_answered_one_more_refused_and_a_threshold_search_capped(served_index, serve_corpus):
    """EngineConfig.max_k (5 here): k = 5 answers 5 hits; k = 6 raises ConfigError (400 over HTTP, see
    tests/test_serve_http.py); a min_score search without k returns at most 5."""
    (img,) = _queries(serve_corpus, 1)
    with _engine(served_index, max_k=5, knn_k=5) as engine, _engine(served_index) as unlimited:
        (res,) = engine.search([img], k=5)
        assert len(res.hits) == 5
        _same_hits(res, unlimited.search([img], k=5)[0])
        with pytest.raises(ConfigError, match="k must be an integer from 1 to 5, got 6"):
            engine.search([img], k=6)
        (res,) = engine.search([img], min_score=-1.0)
        assert len(res.hits) == 5
        _same_hits(res, unlimited.search([img], k=5)[0])
        # the answer says when the limit cut it: more items may score above min_score
        assert search_answer(res, 5, -1.0)["capped"] is True
        (few,) = engine.search([img], min_score=0.9999)
        assert len(few.hits) < 5 and search_answer(few, 5, 0.9999)["capped"] is False
        assert search_answer(engine.search([img], k=5)[0], 5, None)["capped"] is False  # k asked, nothing cut
        top = res.hits[0]["id"]
        assert duplicates_answer(engine.duplicates(top, -1.0), -1.0, 5)["capped"] is True
        assert duplicates_answer(engine.duplicates(top, 0.9999), 0.9999, 5)["capped"] is False


def test_ui_duplicates_shown__the_panel_shows_at_most_that_many_and_says_how_many_were_found(served_index, monkeypatch):
    """UI_DUPLICATES_SHOWN (app/gradio_app.py; 3 here) under max_k (5): the panel's gallery holds the 3 best of
    the 5 found and its line says "at least 5" (the limit cut the answer) and "the 3 most similar shown"; a
    threshold that finds fewer than 3 shows them all and says neither."""
    from moco_retrieval.app import gradio_app

    monkeypatch.setattr(gradio_app, "UI_DUPLICATES_SHOWN", 3)
    with _engine(served_index, max_k=5, knn_k=5) as engine:
        ui = gradio_app.build_ui(engine)
        (duplicates,) = [f.fn for f in ui.fns.values() if f.api_name == "duplicates"]
        want = engine.duplicates(1, -1.0).hits
        items, summary = duplicates(1, -1.0)
        assert len(items) == 3 and [caption.split("id ")[-1] for _, caption in items] == [
            str(h["id"]) for h in want[:3]
        ]
        assert summary.startswith("at least 5 near-duplicates of item 1") and "the 3 most similar shown" in summary
        items, summary = duplicates(1, 0.9999)
        assert len(items) < 3 and "at least" not in summary and "shown" not in summary


def test_decode_slots__at_most_that_many_decodes_run_at_once(served_index, serve_corpus, monkeypatch):
    """EngineConfig.decode_slots: with 2 slots two decodes run together (they meet at a barrier); with 1, never
    two (a 20 ms decode seen by a counter); the answers are those of unconstrained decoding either way."""
    from moco_retrieval.serve import engine as engine_module

    images = _queries(serve_corpus, 4)
    with _engine(served_index) as free:
        want = [free.search([img], k=4)[0] for img in images]
    real_decode = engine_module.decode_image
    for slots in (2, 1):
        inside, most, lock = [0], [0], threading.Lock()
        meet = threading.Barrier(2, timeout=10)

        def decode(data, target_size=None, slots=slots, inside=inside, most=most, lock=lock, meet=meet):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            try:
                if slots == 2:
                    meet.wait()  # returns only when a second decode is inside too
                else:
                    threading.Event().wait(0.02)  # long enough for a second caller to try its decode
                return real_decode(data, target_size=target_size)
            finally:
                with lock:
                    inside[0] -= 1

        monkeypatch.setattr(engine_module, "decode_image", decode)
        with _engine(served_index, decode_slots=slots) as engine:
            with ThreadPoolExecutor(len(images)) as pool:
                got = list(pool.map(lambda img: engine.search([img], k=4)[0], images))
        assert most[0] == slots, (slots, most[0])
        for res, single in zip(got, want):
            _same_hits(res, single)
