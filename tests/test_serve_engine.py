"""The search engine on a real index directory (real ONNX encoder, FAISS index and LMDB store)."""

from __future__ import annotations

import math
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError
from moco_retrieval.indexer.encoder import OnnxEncoder
from moco_retrieval.serve.engine import EngineConfig, SearchEngine, UnknownItemError, knn_vote
from tests._serve_helpers import (
    build_index,
    build_index_in_subprocess,
    export_random_encoder,
    write_colour_corpus,
)

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)


def _images(root: Path) -> list[Path]:
    return sorted(root.rglob("*.png"))


def _exact_top_k(served_index: Path, corpus: Path, query: np.ndarray, k: int, engine: SearchEngine):
    """Reference: embed every corpus file with the index's encoder and rank by inner product in numpy."""
    enc = OnnxEncoder(served_index / "generations" / engine.generation / "encoder.onnx", device="cpu", threads=1)
    files = _images(corpus)
    xb = enc.embed_images([str(p) for p in files])
    scores = xb @ enc.embed_images([query])[0]
    order = np.argsort(-scores, kind="stable")[:k]
    return [str(files[i].relative_to(corpus)) for i in order], scores[order]


def test_search__matches_exact_search_and_finds_the_query_first(served_engine, served_index, serve_corpus):
    query = _images(serve_corpus)[5]
    (res,) = served_engine.search([query.read_bytes()], k=7)
    paths, scores = _exact_top_k(served_index, serve_corpus, query, 7, served_engine)
    assert [h["path"] for h in res.hits][0] == str(query.relative_to(serve_corpus))
    assert res.hits[0]["score"] == pytest.approx(1.0, abs=1e-4)
    # same neighbours as brute force (ties in score may swap places)
    assert sorted(h["path"] for h in res.hits) == sorted(paths)
    np.testing.assert_allclose([h["score"] for h in res.hits], scores, atol=1e-4)
    assert all(a["score"] >= b["score"] for a, b in zip(res.hits, res.hits[1:]))
    assert {"id", "label", "width", "height", "sha256", "duplicate_of"} <= set(res.hits[0])
    assert set(res.timings) == {"decode", "queue", "embed", "search", "metadata", "total"}
    assert res.generation == served_engine.generation


def test_search__k_larger_than_the_index_returns_every_item(served_engine, serve_corpus):
    (res,) = served_engine.search([_images(serve_corpus)[0]], k=500)
    assert len(res.hits) == len(_images(serve_corpus))
    assert len({h["id"] for h in res.hits}) == len(res.hits)


def test_search__refuses_bad_k_and_bad_images(served_engine, serve_corpus, tmp_path):
    image = _images(serve_corpus)[0]
    for k in (0, -3, 1001, 2.5, True):
        with pytest.raises(ConfigError, match="k must be"):
            served_engine.search([image], k=k)
    truncated = image.read_bytes()[: len(image.read_bytes()) // 2]
    for bad in (b"not an image at all", truncated, b""):
        with pytest.raises(DataError):
            served_engine.search([bad], k=3)
    with pytest.raises(DataError, match="no query image"):
        served_engine.search([], k=3)


def test_search_by_id__equals_searching_with_its_image_minus_itself(served_engine, serve_corpus):
    query = _images(serve_corpus)[17]
    (by_image,) = served_engine.search([query], k=6)
    item = by_image.hits[0]
    res = served_engine.search_by_id(item["id"], k=5)
    assert res.query["path"] == item["path"]
    assert item["id"] not in [h["id"] for h in res.hits]
    assert [h["id"] for h in res.hits] == [h["id"] for h in by_image.hits[1:]]
    with pytest.raises(UnknownItemError):
        served_engine.search_by_id(10**6, k=5)
    with pytest.raises(UnknownItemError):
        served_engine.item(-1)


def test_knn_vote__matches_the_closed_form():
    scores = np.array([0.9, 0.8, 0.5, 0.4])
    probs = knn_vote(scores, ["a", "b", None, "a"], temperature=0.1)
    wa, wb = math.exp(9) + math.exp(4), math.exp(8)
    assert list(probs) == ["a", "b"]  # most probable first; the unlabeled neighbour does not vote
    assert probs["a"] == pytest.approx(wa / (wa + wb))
    assert sum(probs.values()) == pytest.approx(1.0)
    assert knn_vote(scores, [None] * 4, 0.07) == {}


def test_classify__held_out_images_are_mostly_right(served_engine, held_out):
    files = _images(held_out)
    results = served_engine.classify([str(p) for p in files], k=20, temperature=0.07)
    correct = sum(r.label == p.parent.name for r, p in zip(results, files))
    assert correct / len(files) >= 0.9, f"{correct}/{len(files)} right"  # measured: all right; chance is 25%
    first = results[0]
    assert len(first.neighbors) == 20 and sum(first.probabilities.values()) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="temperature"):
        served_engine.classify([str(files[0])], k=20, temperature=0)


def test_engine__refuses_a_model_that_did_not_build_the_index(served_index, tmp_path):
    other = export_random_encoder(tmp_path, seed=1)
    with pytest.raises(ArtifactError, match="was built with another model"):
        SearchEngine(served_index, EngineConfig(model=str(other), poll_seconds=0))
    tampered = tmp_path / "tampered"
    shutil.copytree(served_index, tampered)
    live = (tampered / "CURRENT").read_text().strip()
    shutil.copyfile(other, tampered / "generations" / live / "encoder.onnx")
    with pytest.raises(ArtifactError, match="was built with another model"):
        SearchEngine(tampered, EngineConfig(poll_seconds=0))
    with pytest.raises(ArtifactError, match="not found"):
        SearchEngine(tmp_path / "nowhere", EngineConfig(poll_seconds=0))


def test_engine__hot_swaps_to_a_new_generation_without_dropping_queries(private_index, encoder_onnx):
    corpus, index = private_index
    removed = corpus / "red" / "red_003.png"
    removed_bytes = removed.read_bytes()
    engine = SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0.1))
    first_gen = engine.generation
    old_id = engine.search([removed_bytes], k=1)[0].hits[0]["id"]
    errors, answered, stop = [], [0], threading.Event()
    probe = corpus / "blue" / "blue_000.png"

    def query_forever():  # a client that keeps querying during the re-index and the swap
        while not stop.is_set():
            try:
                (res,) = engine.search([probe], k=3)
                assert res.hits[0]["path"] == "blue/blue_000.png"
                answered[0] += 1
            except Exception as exc:  # noqa: BLE001 - any failure is what the test looks for
                errors.append(exc)

    thread = threading.Thread(target=query_forever)
    thread.start()
    try:
        removed.unlink()
        write_colour_corpus(corpus / "new", 3, seed=99)  # 12 new items under new/<colour>/
        build_index_in_subprocess(corpus, encoder_onnx, index)
        deadline = time.monotonic() + 20
        while engine.generation == first_gen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    try:
        assert engine.generation != first_gen, "the engine did not switch to the new generation"
        assert not errors, errors[:3]
        assert answered[0] > 0
        assert engine.stats()["items"] == 48 - 1 + 12
        new_item = corpus / "new" / "green" / "green_001.png"
        assert engine.search([new_item], k=1)[0].hits[0]["path"] == "new/green/green_001.png"
        # the removed image's id is tombstoned: never returned, unknown to item()
        hits = engine.search([removed_bytes], k=59)[0].hits
        assert old_id not in [h["id"] for h in hits] and len(hits) == 59
        with pytest.raises(UnknownItemError):
            engine.item(old_id)
        assert engine.swaps == 1
    finally:
        engine.close()


def test_search__skips_tombstoned_ids_that_the_faiss_index_still_holds(private_index, encoder_onnx):
    """A FAISS index that still holds removed ids (the previous generation's) never leaks them."""
    import faiss

    corpus, index = private_index
    old_index = faiss.read_index(str(index / "generations" / "g000001" / "vectors.faiss"))
    victims = sorted(corpus.rglob("red_00*.png"))[:4]
    victim_bytes = [p.read_bytes() for p in victims]
    for p in victims:
        p.unlink()
    build_index(corpus, encoder_onnx, index)
    with SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0)) as engine:
        engine._current.directory.index = old_index  # 48 vectors, 4 of them tombstoned in the new store
        for data in victim_bytes:
            (res,) = engine.search([data], k=10)
            assert len(res.hits) == 10
            assert not any(h["path"] in {f"red/{p.name}" for p in victims} for h in res.hits)
        (res,) = engine.search([victim_bytes[0]], k=44)
        assert len(res.hits) == 44  # every live item, found by searching deeper than k


def test_engine__batches_concurrent_queries_with_the_same_answers(served_index, serve_corpus):
    files = _images(serve_corpus)[:12]
    with SearchEngine(served_index, EngineConfig(device="cpu", threads=1, poll_seconds=0, max_wait_ms=50)) as engine:
        alone = [engine.search([p], k=4)[0] for p in files]
        together: list = [None] * len(files)
        barrier = threading.Barrier(len(files))

        def one(i):
            barrier.wait()
            together[i] = engine.search([files[i]], k=4)[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(files))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert max(r.batch_size for r in together) > 1
    for a, b in zip(alone, together):
        assert [h["id"] for h in a.hits] == [h["id"] for h in b.hits]
        np.testing.assert_allclose([h["score"] for h in a.hits], [h["score"] for h in b.hits], atol=1e-5)


def test_examples__spread_over_the_labels(served_engine):
    examples = served_engine.examples(4)
    assert len(examples) == 4
    assert {e["label"] for e in examples} == {"blue", "green", "red", "yellow"}


def test_engine__answers_a_clear_error_after_close(served_index, serve_corpus):
    engine = SearchEngine(served_index, EngineConfig(device="cpu", threads=1, poll_seconds=0))
    engine.close()
    with pytest.raises(ArtifactError, match="was closed"):
        engine.search([_images(serve_corpus)[0]], k=1)


def test_search_async__same_answer_as_search_and_a_cancelled_request_releases_its_generation(
    served_engine, serve_corpus
):
    import asyncio

    data = _images(serve_corpus)[7].read_bytes()
    (want,) = served_engine.search([data], k=5)
    gen = served_engine._current

    async def scenario():
        (got,) = await served_engine.search_async([data], k=5)
        task = asyncio.ensure_future(served_engine.search_async([data], k=5))
        await asyncio.sleep(0)  # started: its decode is on a decode thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the decode and the batch finish on their own threads, then let go
            if gen._refs == 0:
                break
            await asyncio.sleep(0.01)
        return got

    got = asyncio.run(scenario())
    assert [h["id"] for h in got.hits] == [h["id"] for h in want.hits]
    assert gen._refs == 0
    with pytest.raises(DataError, match="not a readable image"):
        asyncio.run(served_engine.search_async([b"not an image"], k=5))


def test_engine__a_bad_new_generation_is_logged_once_and_the_old_one_serves_on(private_index, caplog, monkeypatch):
    import logging
    import shutil

    corpus, index = private_index
    engine = SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0))
    try:
        old = engine.generation
        shutil.copytree(index / "generations" / old, index / "generations" / "g000099")
        (index / "CURRENT").write_text("g000099\n")

        def broken(reuse):  # whatever a damaged generation raises, not only MocoError
            raise ValueError("cannot reshape array of size 3\nsecond line")

        monkeypatch.setattr(engine, "_open", broken)
        with caplog.at_level(logging.WARNING, logger="moco_retrieval.serve.engine"):
            assert [engine.refresh() for _ in range(3)] == [False, False, False]
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(errors) == 1 and "g000099" in errors[0].getMessage() and errors[0].exc_info is None
        assert "\n" not in errors[0].getMessage() and "ValueError: cannot reshape" in errors[0].getMessage()
        assert engine.generation == old
        assert engine.search([corpus / "red" / "red_001.png"], k=1)[0].hits[0]["path"] == "red/red_001.png"
    finally:
        engine.close()
