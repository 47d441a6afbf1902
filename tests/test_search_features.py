"""Threshold search (min_score) and batches, on real generations with a delta and removed items (Flat, HNSW, IVF,
IVF-PQ), checked against exact brute force; and the HTTP API's batch and min_score routes and errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from moco_retrieval.contracts.errors import BatchTooLargeError, ConfigError, DataError
from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.encoder import read_encoder_metadata
from moco_retrieval.indexer.index_dir import IndexDirectory
from tests.index_fixtures import SyntheticEmbedder, touch_files, write_tiny_encoder

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)

D = 16
BASE, ADDED, REMOVED = 400, 60, 30


def _names(start: int, stop: int) -> list[str]:
    return [f"c{i % 5}/f{i:05d}.png" for i in range(start, stop)]


def _tiny_embedder(folder: Path) -> SyntheticEmbedder:
    """A SyntheticEmbedder whose "encoder" is a real tiny ONNX model, so a SearchEngine can open the index."""
    emb = SyntheticEmbedder(folder, d=D)
    path = write_tiny_encoder(folder / "tiny.onnx", d=D)
    emb.encoder = SimpleNamespace(
        path=path,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        embedding_dim=D,
        provider="synthetic",
        metadata=read_encoder_metadata(path),
    )
    return emb


def _cfg(data: Path, emb, out: Path, index_type: str) -> IndexConfig:
    kw = {"index_type": "ivfpq", "max_index_memory": 1000} if index_type == "ivfpq-disk" else {"index_type": index_type}
    return IndexConfig(
        str(data), str(emb.encoder.path), str(out), workers=0, batch_size=8, progress=False, shard_size=64, **kw
    )


def _layered_generation(tmp: Path, kind: str, seed: int = 0) -> SimpleNamespace:
    """``(engine, live ids, their exact vectors, kind)`` over a generation with a base, removed base items and a
    delta; ``seed`` draws other (fixed) vectors. Close ``engine``."""
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    data, out = tmp / "images", tmp / "index"
    emb = _tiny_embedder(tmp / "model")
    _touch_at_fixed_times(data, _names(0, BASE), seed)
    build_index_dir(_cfg(data, emb, out, kind), embedder=emb)
    for name in _names(0, BASE)[:: BASE // REMOVED][:REMOVED]:
        (data / name).unlink()
    _touch_at_fixed_times(data, _names(BASE, BASE + ADDED), seed)
    result = build_index_dir(_cfg(data, emb, out, kind), embedder=emb)
    assert result.mode == "update" and (result.added, result.removed) == (ADDED, REMOVED)
    with IndexDirectory.open(out) as d:
        assert d.manifest.delta_count == ADDED and len(d.index.removed) == REMOVED
        ids = d.index.ids()
        xb = np.stack([emb.vector(f"{r['path']}:{r['mtime_ns']}") for r in d.records(ids.tolist())])
    engine = SearchEngine(out, EngineConfig(device="cpu", threads=1, poll_seconds=0))
    return SimpleNamespace(engine=engine, ids=ids, xb=xb, kind=kind)


@pytest.fixture(scope="module", params=["flat", "hnsw", "ivf", "ivfpq"])
def layered(request, tmp_path_factory):
    """:func:`_layered_generation` of each index type."""
    gen = _layered_generation(tmp_path_factory.mktemp(f"threshold_{request.param}"), request.param)
    yield gen
    gen.engine.close()


def _touch_at_fixed_times(root, names, seed: int = 0) -> None:
    """The files with mtimes fixed by name and ``seed``: the synthetic vectors (seeded by path and mtime) are then
    the same on every run."""
    touch_files(root, names)
    for name in names:
        ns = 1_700_000_000_000_000_000 + seed * 1_000_000_000 + int(name.split("/f")[1].split(".")[0])
        os.utime(root / name, ns=(ns, ns))


def _exact_above(xb: np.ndarray, ids: np.ndarray, q: np.ndarray, min_score: float) -> dict[int, float]:
    scores = xb @ q
    return {int(i): float(s) for i, s in zip(ids, scores) if s >= min_score}


def test_min_score__returns_exactly_the_items_above_the_score(layered):
    rng = np.random.default_rng(0)
    picks = rng.choice(len(layered.ids), size=6, replace=False)
    xq = layered.xb[picks]
    recall = [0, 0]  # found, wanted (IVF, IVF-PQ)
    for q in xq:
        ranked = np.sort(layered.xb @ q)[::-1]
        for rank in (5, 40, 150):  # thresholds met by a few, by more than the first k fetched, by a third
            min_score = float(ranked[rank]) - 1e-4
            (res,) = layered.engine.search_vectors(q[None], min_score=min_score)
            got = {h["id"]: h["score"] for h in res.hits}
            want = _exact_above(layered.xb, layered.ids, q, min_score)
            assert all(s >= min_score for s in got.values())
            assert set(got) <= set(layered.ids.tolist())  # nothing removed comes back
            scores = [h["score"] for h in res.hits]
            assert scores == sorted(scores, reverse=True)
            if layered.kind in ("flat", "hnsw"):  # exact scans (HNSW: over its flat storage)
                assert set(got) == set(want), (layered.kind, rank)
                assert [got[i] for i in want] == pytest.approx(list(want.values()), abs=1e-5)
            elif rank <= 40:  # IVF (and IVF-PQ, re-ranked with a growing k) probe the lists their nprobe was tuned
                # to: recall@10's target holds for the first tens above a threshold, not for a third of the corpus
                # (IVF-PQ re-ranks with float16 blocks: a score within their rounding of the threshold may fall
                # on either side of it)
                near = sum(1 for i in set(want) - set(got) if abs(want[i] - min_score) < 2e-3)
                recall[0] += len(set(got) & set(want)) + near
                recall[1] += len(want)
    if recall[1]:  # over all queries (one query's few lists may miss more; the target is the index's average)
        assert recall[0] >= 0.9 * recall[1], (layered.kind, recall)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["ivf", "ivfpq", "hnsw-grown"])
def test_min_score__ivf_finds_the_first_tens_above_a_threshold_as_exact_search_does(tmp_path, kind, seed, monkeypatch):
    """nprobe is tuned for recall@10; a threshold search that reaches tens of items probes deeper (issue 24: at the
    tuned nprobe the recall of these thresholds was 0.84-0.93 on these generations, 0.83 over random draws).
    ``hnsw-grown``: an HNSW base over ``HNSW_SCAN_MAX`` (lowered here) is not scanned but searched with a growing k
    and efSearch raised the same way."""
    from moco_retrieval.indexer import searcher

    if kind == "hnsw-grown":
        monkeypatch.setattr(searcher, "HNSW_SCAN_MAX", 0)
        kind = "hnsw"
    gen = _layered_generation(tmp_path, kind, seed)
    assert gen.engine._current.can_range_search == (kind == "ivf")
    rng = np.random.default_rng(seed)
    found = wanted = 0
    try:
        for q in gen.xb[rng.choice(len(gen.ids), size=8, replace=False)]:
            ranked = np.sort(gen.xb @ q)[::-1]
            for rank in (10, 20, 40, 80):  # thresholds met by the first 11 to 81 items
                min_score = float(ranked[rank]) - 1e-4
                (res,) = gen.engine.search_vectors(q[None], min_score=min_score)
                got = {h["id"] for h in res.hits}
                want = _exact_above(gen.xb, gen.ids, q, min_score)
                assert all(h["score"] >= np.float32(min_score) for h in res.hits)  # (compared in float32)
                # (IVF-PQ re-ranks with float16 blocks: a score within their rounding may fall on either side)
                near = sum(1 for i in set(want) - got if abs(want[i] - min_score) < 2e-3)
                found, wanted = found + len(got & set(want)) + near, wanted + len(want)
    finally:
        gen.engine.close()
    assert found >= 0.95 * wanted, (kind, seed, found / wanted)


def test_min_score__caps_at_k_and_refuses_values_outside_minus_one_to_one(layered):
    q = layered.xb[0]
    (res,) = layered.engine.search_vectors(q[None], k=7, min_score=-1.0)
    assert len(res.hits) == 7
    for bad in (1.5, -1.01, float("nan"), "0.5", True):
        with pytest.raises(ConfigError, match="min_score must be a number from -1 to 1"):
            layered.engine.search_vectors(q[None], min_score=bad)


def test_search_by_ids__a_batch_equals_the_single_requests(layered):
    ids = [int(i) for i in layered.ids[[0, 17, -1, 5]]]  # base and delta items, in no particular order
    batch = layered.engine.search_by_ids(ids, k=6)
    singles = [layered.engine.search_by_id(i, k=6) for i in ids]
    assert [r.query["id"] for r in batch] == ids
    for b, s in zip(batch, singles):
        assert [h["id"] for h in b.hits] == [h["id"] for h in s.hits]
        assert [h["score"] for h in b.hits] == pytest.approx([h["score"] for h in s.hits])
    with pytest.raises(DataError, match="no query ids given"):
        layered.engine.search_by_ids([])
    limit = layered.engine.config.max_queries
    with pytest.raises(BatchTooLargeError, match=f"the limit is {limit}"):
        layered.engine.search_by_ids([ids[0]] * (limit + 1))


# -- the HTTP API ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def test_http_search__several_images_answer_in_request_order_as_the_single_requests(client, serve_corpus):
    queries = [
        serve_corpus / "red" / "red_001.png",
        serve_corpus / "blue" / "blue_004.png",
        serve_corpus / "red" / "red_001.png",
        serve_corpus / "yellow" / "yellow_009.png",
    ]
    files = [("image", (q.name, q.read_bytes(), "image/png")) for q in queries]
    r = client.post("/api/search", params={"k": 4}, files=files)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["k"] == 4 and len(body["responses"]) == len(queries)
    for q, answer in zip(queries, body["responses"]):
        single = client.post("/api/search", params={"k": 4}, files={"image": (q.name, q.read_bytes(), "image/png")})
        assert single.status_code == 200
        assert [h["id"] for h in answer["results"]] == [h["id"] for h in single.json()["results"]]
        assert answer["results"][0]["path"] == f"{q.parent.name}/{q.name}"


def test_http_search_ids__answers_in_the_order_of_the_ids(client):
    r = client.post("/api/search/ids", params={"k": 3}, json={"ids": [7, 2, 30]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [a["query"]["id"] for a in body["responses"]] == [7, 2, 30]
    for answer in body["responses"]:
        single = client.get(f"/api/items/{answer['query']['id']}/neighbors", params={"k": 3}).json()
        assert [h["id"] for h in answer["results"]] == [h["id"] for h in single["results"]]
    assert client.post("/api/search/ids", json={"ids": [7, 10**6]}).status_code == 404


def test_http_batches__empty_or_over_the_limit_are_refused_naming_the_limit(client, serve_corpus, served_engine):
    limit = served_engine.config.max_queries
    r = client.post("/api/search/ids", json={"ids": []})
    assert r.status_code == 400 and f"send 1 to {limit}" in r.json()["error"]
    r = client.post("/api/search/ids", json={"ids": [1] * (limit + 1)})
    assert r.status_code == 413 and f"the limit is {limit}" in r.json()["error"]
    png = (serve_corpus / "red" / "red_001.png").read_bytes()
    r = client.post("/api/search", files=[("image", ("q.png", png, "image/png"))] * (limit + 1))
    assert r.status_code == 413 and f"the limit is {limit}" in r.json()["error"]


def test_http_min_score__every_route_filters_by_score_and_refuses_out_of_range(client, serve_corpus, served_engine):
    query = serve_corpus / "green" / "green_004.png"
    upload = {"image": (query.name, query.read_bytes(), "image/png")}
    everything = client.post("/api/search", params={"k": 48}, files=upload).json()["results"]
    threshold = everything[9]["score"]
    r = client.post("/api/search", params={"min_score": threshold}, files=upload)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["min_score"] == threshold and body["k"] == served_engine.config.max_k
    assert [h["id"] for h in body["results"]] == [h["id"] for h in everything if h["score"] >= threshold]
    item = everything[0]["id"]
    r = client.get(f"/api/items/{item}/neighbors", params={"min_score": threshold})
    assert r.status_code == 200 and all(h["score"] >= threshold for h in r.json()["results"])
    r = client.post("/api/search/ids", params={"min_score": threshold}, json={"ids": [item]})
    assert r.status_code == 200 and all(h["score"] >= threshold for h in r.json()["responses"][0]["results"])
    for route in ("search", "neighbors", "ids"):
        if route == "search":
            r = client.post("/api/search", params={"min_score": 1.5}, files=upload)
        elif route == "neighbors":
            r = client.get(f"/api/items/{item}/neighbors", params={"min_score": -2})
        else:
            r = client.post("/api/search/ids", params={"min_score": 3}, json={"ids": [item]})
        assert r.status_code == 400 and "min_score must be a number from -1 to 1" in r.json()["error"], route


# -- the command line ----------------------------------------------------------------------------------------
def test_search_cli__a_folder_writes_one_csv_row_per_image_equal_to_single_searches(
    served_index, serve_corpus, served_engine, tmp_path, capsys
):
    import csv
    import shutil

    from moco_retrieval.app.cli import main

    folder = tmp_path / "queries"
    shutil.copytree(serve_corpus / "blue", folder / "blue")
    (folder / "blue" / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "neighbours.csv"
    assert main(["search", str(served_index), str(folder), "-k", "3", "--out", str(out), "--device", "cpu"]) == 0
    assert "13 queries answered" in capsys.readouterr().out
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [Path(r["query"]).name for r in rows] == sorted(p.name for p in (folder / "blue").iterdir())
    broken = next(r for r in rows if r["query"].endswith("broken.png"))
    assert broken["error"] and not broken["ids"]  # one bad image is its own row, not the end of the run
    for row in rows:
        if row is broken:
            continue
        (single,) = served_engine.search([row["query"]], 3)
        assert row["ids"] == ";".join(str(h["id"]) for h in single.hits)
        assert row["paths"].split(";")[0] == f"blue/{Path(row['query']).name}"
        assert [float(s) for s in row["scores"].split(";")] == pytest.approx(
            [h["score"] for h in single.hits], abs=1e-5
        )


def test_classify_cli__several_images_print_jsonl_with_the_label_and_its_share(
    served_index, serve_corpus, served_engine, capsys
):
    import json

    from moco_retrieval.app.cli import main

    queries = [serve_corpus / "red" / "red_002.png", serve_corpus / "green" / "green_003.png"]
    assert main(["classify", str(served_index), *map(str, queries), "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["label"] for r in rows] == ["red", "green"]
    for row, q in zip(rows, queries):
        (single,) = served_engine.classify([str(q)])
        assert len(row["neighbors"]) == served_engine.config.knn_k  # the one default k of the CLI and the API
        assert row["share"] == pytest.approx(single.probabilities[single.label], abs=1e-5)


def test_search_cli__min_score_and_a_bad_output_name_are_one_line(
    served_index, serve_corpus, served_engine, tmp_path, capsys
):
    import json

    from moco_retrieval.app.cli import main

    query = serve_corpus / "yellow" / "yellow_005.png"
    assert main(["search", str(served_index), str(query), "--min-score", "0.99", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["results"]
    (ref,) = served_engine.search([str(query)], 48)
    assert [h["id"] for h in hits] == [h["id"] for h in ref.hits if h["score"] >= 0.99]
    assert main(["search", str(served_index), str(query), "--min-score", "2"]) == 2
    assert "min_score must be a number from -1 to 1" in capsys.readouterr().err
    assert main(["search", str(served_index), str(query), "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "name it .csv or .jsonl" in err


# -- filters -------------------------------------------------------------------------------------------------
def _exact_filtered(layered, q, keep, k):
    scores = layered.xb @ q
    order = [i for i in np.argsort(-scores) if keep(int(layered.ids[i]))][:k]
    return [int(layered.ids[i]) for i in order]


@pytest.mark.parametrize("exact_max", [None, 0])  # scored exactly (few kept), or the selector with raised depth
def test_filters__return_only_allowed_items_and_match_exact_filtered_search(layered, exact_max, monkeypatch):
    from moco_retrieval.indexer import filters, searcher
    from moco_retrieval.serve.engine import SearchFilter

    from moco_retrieval.serve import generation

    if exact_max is not None:  # (and HNSW over its exact-answer size, so that it takes the selector too)
        monkeypatch.setattr(filters, "EXACT_FILTER_MAX", exact_max)
        monkeypatch.setattr(searcher, "HNSW_SCAN_MAX", exact_max)
        # and a label / prefix bitmap cache of one: each filter evicts the one before, and a later query of an
        # evicted label reads it again (the cache's size limit, crossed)
        monkeypatch.setattr(generation, "FILTER_CACHE", 1)
    engine = layered.engine
    engine._current._filter_bits.clear()  # (the module fixture's engine: earlier parameters filled it)
    records = {r["id"]: r for r in engine._current.directory.records(layered.ids.tolist())}
    excluded = tuple(int(i) for i in layered.ids[::7])
    cases = [
        (SearchFilter(labels=("c1",)), lambda r: r["label"] == "c1"),
        (SearchFilter(labels=("c0", "c3")), lambda r: r["label"] in ("c0", "c3")),
        (SearchFilter(path_prefix="c2/f001"), lambda r: r["path"].startswith("c2/f001")),
        (SearchFilter(labels=("c4",), exclude=excluded), lambda r: r["label"] == "c4" and r["id"] not in excluded),
        (SearchFilter(exclude=excluded), lambda r: r["id"] not in excluded),
    ]
    found = wanted = 0
    for flt, allowed in cases:
        for q in layered.xb[[3, 150, -2]]:
            (res,) = engine.search_vectors(q[None], k=10, flt=flt)
            got = [h["id"] for h in res.hits]
            assert all(allowed(records[i]) for i in got), flt
            want = _exact_filtered(layered, q, lambda i: allowed(records[i]), 10)
            assert len(got) == len(want), (flt, len(got), len(want))
            if layered.kind == "flat" or exact_max is None:
                # exact scores (float16 blocks for IVF-PQ: ties within their rounding may swap)
                assert len(set(got) & set(want)) >= len(want) - (1 if layered.kind == "ivfpq" else 0), flt
            found, wanted = found + len(set(got) & set(want)), wanted + len(want)
    assert found >= 0.9 * wanted, (layered.kind, found, wanted)  # the index's recall target, filtered
    cached = engine._current._filter_bits
    assert len(cached) == (1 if exact_max is not None else 5), list(cached)  # c1, c0, c3, c2/f001, c4: the last


def test_depth_factor__the_inverse_of_the_share_kept_over_the_measured_slack():
    from moco_retrieval.indexer.filters import (
        DEPTH_SLACK,
        EXACT_FILTER_MAX,
        MAX_DEPTH_FACTOR,
        answered_exactly,
        depth_factor,
        filtered_params,
    )

    n = 1_000_000
    # 50% needs no raise, 5% x5 (the full inverse, x20, cost HNSW 8x its queries/s for 0.7 points), 1% x25
    assert [depth_factor(int(n * f), n) for f in (1, 0.5, 0.05, 0.01)] == [1, 1, 5, 25]
    assert depth_factor(int(n * 0.01), n) == 100 // DEPTH_SLACK
    assert depth_factor(1, n) == depth_factor(0, n) == MAX_DEPTH_FACTOR  # capped; the exact path answers these
    # exact: at most EXACT_FILTER_MAX kept, or under 1/128 of the items (a raise past x32); the selector between
    assert answered_exactly(EXACT_FILTER_MAX, n) and not answered_exactly(EXACT_FILTER_MAX + 1, 10**5)
    assert answered_exactly(7_812, n) and not answered_exactly(7_813, n)
    assert depth_factor(7_813, n) == 32
    assert filtered_params({"nprobe": 4}, 25, nlist=64) == {"nprobe": 64}
    assert filtered_params({"efSearch": 128}, 5) == {"efSearch": 640}
    assert filtered_params({"efSearch": 16}, 6, min_ef=227) == {"efSearch": 227}  # the beam holds k / share kept


def test_filters__neighbors_of_an_item_size_range_and_unknown_labels(layered):
    from moco_retrieval.serve.engine import SearchFilter

    engine = layered.engine
    item = int(layered.ids[10])
    res = engine.search_by_id(item, k=5, flt=SearchFilter(labels=("c2",)))
    assert len(res.hits) == 5 and all(h["label"] == "c2" for h in res.hits) and item not in [h["id"] for h in res.hits]
    assert engine.search_by_id(item, k=5, flt=SearchFilter(min_width=33)).hits == []  # every image is 32 x 32
    assert len(engine.search_by_id(item, k=5, flt=SearchFilter(max_width=32, max_height=32)).hits) == 5
    with pytest.raises(ConfigError, match=r"unknown label 'shoes'; the labels of this index: c0, c1, c2, c3, c4"):
        engine.search_by_id(item, flt=SearchFilter(labels=("shoes",)))
    with pytest.raises(ConfigError, match="min_width .* is larger than max_width"):
        SearchFilter(min_width=10, max_width=5)
    res = engine.search_by_id(item, k=4, min_score=0.0, flt=SearchFilter(labels=("c1",)))
    assert all(h["label"] == "c1" and h["score"] >= 0 for h in res.hits)


def test_filters__an_index_without_the_label_database_opens_and_refuses_label_filters_in_one_line(
    tmp_path, monkeypatch
):
    from moco_retrieval.contracts.errors import ArtifactError
    from moco_retrieval.indexer import metadata
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine, SearchFilter

    data, out = tmp_path / "images", tmp_path / "index"
    emb = _tiny_embedder(tmp_path / "model")
    touch_files(data, _names(0, 60))
    with monkeypatch.context() as m:  # the format before label filters: no "labels" database, no flag
        m.setattr(metadata, "_OPTIONAL_DBS", ())
        build_index_dir(_cfg(data, emb, out, "flat"), embedder=emb)
    touch_files(data, _names(60, 70))
    build_index_dir(_cfg(data, emb, out, "flat"), embedder=emb)  # an update by this code: still incomplete
    with SearchEngine(out, EngineConfig(device="cpu", threads=1, poll_seconds=0)) as engine:
        assert len(engine.search_by_id(0, k=3).hits) == 3
        assert engine.search_by_id(0, k=3, flt=SearchFilter(path_prefix="c1/")).hits  # prefixes need no new data
        with pytest.raises(ArtifactError, match=r"built before label filters; rebuild it with `moco index --rebuild`"):
            engine.search_by_id(0, flt=SearchFilter(labels=("c1",)))


def test_http_filters__label_as_query_or_form_field_prefix_and_unknown_labels(client, serve_corpus):
    query = serve_corpus / "green" / "green_004.png"
    upload = {"image": (query.name, query.read_bytes(), "image/png")}
    r = client.post("/api/search", params={"k": 8, "label": ["red", "blue"]}, files=upload)
    assert r.status_code == 200, r.text
    assert {h["label"] for h in r.json()["results"]} <= {"red", "blue"} and len(r.json()["results"]) == 8
    r = client.post("/api/search", params={"k": 5}, data={"label": "yellow"}, files=upload)
    assert r.status_code == 200 and {h["label"] for h in r.json()["results"]} == {"yellow"}
    r = client.get("/api/items/3/neighbors", params={"k": 4, "path_prefix": "red/", "exclude": [30, 31]})
    assert r.status_code == 200
    hits = r.json()["results"]
    assert len(hits) == 4 and all(h["path"].startswith("red/") and h["id"] not in (30, 31) for h in hits)
    r = client.post("/api/search/ids", params={"label": "blue", "k": 3}, json={"ids": [0, 20]})
    assert r.status_code == 200 and all(h["label"] == "blue" for a in r.json()["responses"] for h in a["results"])
    r = client.post("/api/search", params={"label": "sneaker"}, files=upload)
    assert r.status_code == 400
    assert r.json()["error"] == "unknown label 'sneaker'; the labels of this index: blue, green, red, yellow"
    r = client.get("/api/items/3/neighbors", params={"min_width": 50, "max_width": 10})
    assert r.status_code == 400 and "larger than max_width" in r.json()["error"]


# -- near-duplicates -------------------------------------------------------------------------------------------
def _photo(rng, size: int = 64):
    from PIL import Image

    img = np.zeros((size, size, 3)) + rng.uniform(0, 255, 3)
    for _ in range(6):
        w, h = rng.integers(8, 40, 2)
        x, y = rng.integers(0, size - w), rng.integers(0, size - h)
        img[y : y + h, x : x + w] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 10, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def duplicate_index(tmp_path_factory, encoder_onnx):
    """8 photos, each with a JPEG re-encode, a crop (resized back) and a downscaled copy, plus 4 loners."""
    from tests._serve_helpers import build_index

    root = tmp_path_factory.mktemp("dupes")
    photos = root / "photos"
    (photos / "set").mkdir(parents=True)
    rng = np.random.default_rng(5)
    groups = []
    for i in range(8):
        im = _photo(rng)
        names = [f"set/p{i}.png", f"set/p{i}_q80.jpg", f"set/p{i}_crop.png", f"set/p{i}_small.png"]
        im.save(photos / names[0])
        im.save(photos / names[1], "JPEG", quality=80)
        im.crop((3, 3, 61, 61)).resize((64, 64)).save(photos / names[2])
        im.resize((48, 48)).save(photos / names[3])
        groups.append(sorted(names))
    for i in range(4):
        _photo(rng).save(photos / "set" / f"alone{i}.png")
    out = root / "index"
    build_index(photos, encoder_onnx, out)
    return out, sorted(groups)


def test_duplicates_cli__groups_re_encodes_crops_and_resizes_as_json_and_csv(duplicate_index, tmp_path, capsys):
    import csv
    import json

    from moco_retrieval.app.cli import main

    index, groups = duplicate_index
    assert main(["duplicates", str(index), "--threshold", "0.985"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["threshold"] == 0.985 and len(body["groups"]) == 8
    assert sorted(sorted(item["path"] for item in g["items"]) for g in body["groups"]) == groups
    assert all(p[2] >= 0.985 for g in body["groups"] for p in g["pairs"])
    out = tmp_path / "dupes.csv"
    assert main(["duplicates", str(index), "--threshold", "0.985", "--out", str(out)]) == 0
    assert "8 groups (32 items)" in capsys.readouterr().out
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    by_group: dict = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row["path"])
    assert sorted(sorted(v) for v in by_group.values()) == groups
    assert main(["duplicates", str(index), "--threshold", "1.5"]) == 2
    assert "--threshold must be from -1 to 1" in capsys.readouterr().err


def test_duplicates_of_an_item__are_its_group(duplicate_index):
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    index, groups = duplicate_index
    with SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0)) as engine:
        for group in groups[:3]:
            item = engine._current.directory.id_of_path(group[0])
            res = engine.duplicates(item, 0.985)
            assert sorted(h["path"] for h in res.hits) == group[1:] and res.query["path"] == group[0]


def test_http_duplicates__route_and_its_threshold_check(client, served_engine):
    r = client.get("/api/items/5/duplicates", params={"threshold": 0.99})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["query"]["id"] == 5 and all(h["score"] >= 0.99 and h["id"] != 5 for h in body["duplicates"])
    r = client.get("/api/items/5/duplicates", params={"threshold": 2})
    assert r.status_code == 400 and "from -1 to 1" in r.json()["error"]
    assert client.get("/api/items/999999/duplicates").status_code == 404
