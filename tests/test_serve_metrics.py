"""``GET /metrics``: Prometheus text of one server process, and of all workers under ``--workers 2``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests._serve_helpers import serve_workers_process

pytest_plugins = ("tests._serve_fixtures",)
pytestmark = pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")


def samples(text: str) -> dict[tuple, float]:
    """``{(name, ((label, value), ...)): value}`` of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in found.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_metrics__requests_phases_queue_generation_and_encoder(live_server, serve_corpus, served_engine):
    url = live_server.url
    before = samples(httpx.get(url + "/metrics", timeout=10).text)
    query = (serve_corpus / "red" / "red_001.png").read_bytes()
    for _ in range(3):
        assert httpx.post(url + "/api/search", files={"image": ("q.png", query)}, timeout=30).status_code == 200
    assert httpx.get(url + "/api/items/1", timeout=10).status_code == 200
    assert httpx.get(url + "/api/nope", timeout=10).status_code == 404
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = samples(r.text)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("moco_http_requests_total", route="/api/search", method="POST", status="200") == 3
    assert grew("moco_http_requests_total", route="/api/items/{item_id}", method="GET", status="200") == 1
    assert grew("moco_http_requests_total", route="other", method="GET", status="404") == 1
    assert grew("moco_http_request_seconds_count", route="/api/search", method="POST") == 3
    for phase in ("decode", "embed", "search", "metadata"):
        assert grew("moco_query_phase_seconds_count", phase=phase) == 3, phase
    assert value(after, "moco_index_items") == 48 and value(after, "moco_batcher_queue_depth") == 0
    assert value(after, "moco_index_generation") == int(served_engine.generation.lstrip("g"))
    assert value(after, "moco_encoder_info", provider="CPUExecutionProvider", arch="resnet18") == 1


def test_metrics__two_workers_report_every_workers_requests(served_index, serve_corpus):
    query = (serve_corpus / "blue" / "blue_001.png").read_bytes()

    def search(_) -> str:
        with httpx.Client(timeout=30) as client:  # a new connection each: the kernel hands it to either worker
            r = client.post(url + "/api/search", files={"image": ("q.png", query)})
            assert r.status_code == 200
            return r.headers["x-moco-worker"]

    with serve_workers_process(served_index, 2, "--no-ui") as url:
        pids, sent = set(), 0
        deadline = time.monotonic() + 90
        with ThreadPoolExecutor(8) as pool:  # in parallel: one busy worker leaves the next accept to the other
            while len(pids) < 2 and time.monotonic() < deadline:
                pids.update(pool.map(search, range(16)))
                sent += 16
        assert len(pids) == 2, pids
        for _ in range(4):  # whichever worker answers the scrape reports both workers' requests
            with httpx.Client(timeout=30) as client:
                found = samples(client.get(url + "/metrics").text)
            assert value(found, "moco_http_requests_total", route="/api/search", status="200") == sent
            assert {dict(ls).get("pid") for (n, ls) in found if n == "moco_index_items"} >= pids
