"""The HTTP API on a real uvicorn server (loopback, free port) over a real index directory."""

from __future__ import annotations

import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        yield c


def _png_claiming(width: int, height: int) -> bytes:
    """A small valid PNG whose header claims ``width x height`` pixels (a decompression bomb's shape)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = 8  # signature, then the IHDR chunk: length(4) type(4) data(13) crc(4)
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4 : ihdr + 8 + 13]))
    data[ihdr + 21 : ihdr + 25] = struct.pack(">I", crc)
    return bytes(data)


def _upload(path_or_bytes, name="query.png"):
    data = path_or_bytes.read_bytes() if isinstance(path_or_bytes, Path) else path_or_bytes
    return {"image": (name, data, "image/png")}


def test_search__returns_neighbours_with_metadata_and_image_urls(client, serve_corpus):
    query = serve_corpus / "green" / "green_004.png"
    r = client.post("/api/search", params={"k": 5}, files=_upload(query))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["k"] == 5 and len(body["results"]) == 5
    top = body["results"][0]
    assert top["path"] == "green/green_004.png" and top["label"] == "green"
    assert top["score"] == pytest.approx(1.0, abs=1e-4)
    assert top["image_url"] == f"/api/items/{top['id']}/image"
    assert set(body["timings"]) >= {"decode", "embed", "search", "metadata"}
    image = client.get(top["image_url"])
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert image.content == query.read_bytes()


def test_classify__votes_the_label(client, serve_corpus):
    r = client.post(
        "/api/classify", params={"k": 10, "temperature": 0.1}, files=_upload(serve_corpus / "yellow" / "yellow_002.png")
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["label"] == "yellow" and len(body["neighbors"]) == 10
    assert sum(body["probabilities"].values()) == pytest.approx(1.0)


def test_items__record_neighbours_health_stats_and_docs(client, served_engine):
    item = client.get("/api/items/3").json()
    assert item["id"] == 3 and item["path"] and item["label"]
    near = client.get("/api/items/3/neighbors", params={"k": 4}).json()
    assert near["query"]["id"] == 3 and len(near["results"]) == 4 and 3 not in [h["id"] for h in near["results"]]
    health = client.get("/api/health").json()
    assert health == {"status": "ok", "generation": served_engine.generation, "items": 48}
    stats = client.get("/api/stats").json()
    assert stats["items"] == 48 and stats["labels"] == {"blue": 12, "green": 12, "red": 12, "yellow": 12}
    assert stats["model"]["arch"] == "resnet18" and stats["index"]["recall_at_10"] == 1.0
    paths = client.get("/openapi.json").json()["paths"]
    assert {
        "/api/search",
        "/api/classify",
        "/api/items/{item_id}",
        "/api/items/{item_id}/image",
        "/api/health",
        "/api/stats",
    } <= set(paths)
    import re

    import moco_retrieval

    assert client.get("/openapi.json").json()["info"]["version"] == moco_retrieval.__version__
    for page in ("/docs", "/redoc"):  # offline: every script and style sheet comes from this server
        html = client.get(page)
        assert html.status_code == 200, page
        assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', html.text)
        assert assets and all(url.startswith("/") for url in assets), (page, assets)
        assert all(client.get(url).status_code == 200 for url in assets), (page, assets)


@pytest.mark.parametrize(
    "case",
    [
        "not_an_image",
        "truncated",
        "enormous",
        "empty",
        "missing_field",
        "k_zero",
        "k_huge",
        "k_text",
        "temperature_zero",
        "too_large_upload",
    ],
)
def test_bad_input__answers_4xx_json_and_the_server_stays_up(client, serve_corpus, case):
    good = (serve_corpus / "red" / "red_001.png").read_bytes()
    post = {
        "not_an_image": lambda: client.post("/api/search", files=_upload(b"%PDF-1.4 hello", "doc.pdf")),
        "truncated": lambda: client.post("/api/search", files=_upload(good[: len(good) // 2])),
        "enormous": lambda: client.post("/api/search", files=_upload(_png_claiming(30000, 30000))),
        "empty": lambda: client.post("/api/search", files=_upload(b"")),
        "missing_field": lambda: client.post("/api/search", files={"file": ("x.png", good, "image/png")}),
        "k_zero": lambda: client.post("/api/search", params={"k": 0}, files=_upload(good)),
        "k_huge": lambda: client.post("/api/search", params={"k": 100000}, files=_upload(good)),
        "k_text": lambda: client.post("/api/search", params={"k": "ten"}, files=_upload(good)),
        "temperature_zero": lambda: client.post("/api/classify", params={"temperature": 0}, files=_upload(good)),
        "too_large_upload": lambda: client.post("/api/search", files=_upload(b"\0" * (33 << 20))),
    }
    expected = {"missing_field": 422, "k_text": 422, "too_large_upload": 413}.get(case, 400)
    r = post[case]()
    assert r.status_code == expected, r.text
    message = r.json()["error"]
    assert message and "Traceback" not in message and "\n" not in message
    if case == "enormous":
        assert "too large" in message
    assert client.get("/api/health").status_code == 200


@pytest.mark.parametrize(
    "path,status",
    [
        ("/api/items/999999", 404),
        ("/api/items/-5", 404),
        ("/api/items/99999999999999999999999", 404),
        ("/api/items/abc", 422),
        ("/api/items/999999/image", 404),
        ("/api/items/999999/neighbors", 404),
        ("/api/items/1/neighbors?k=0", 400),
        ("/api/nothing-here", 404),
    ],
)
def test_unknown_ids__answer_json_errors(client, path, status):
    r = client.get(path)
    assert r.status_code == status
    assert r.json()["error"]


def test_concurrent_requests__all_answered_correctly(client, serve_corpus):
    queries = sorted(serve_corpus.rglob("*.png"))[::3]  # 16 different images

    def ask(path: Path):
        r = client.post("/api/search", params={"k": 3}, files=_upload(path))
        return path, r

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(ask, queries * 3))
    assert len(answers) == 48
    for path, r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["path"] == str(path.relative_to(serve_corpus))


def test_upload_budget__requests_past_the_bytes_in_flight_wait_for_others():
    import asyncio

    from moco_retrieval.serve.http import ByteBudget

    async def scenario():
        budget, order = ByteBudget(100), []

        async def request(name: str, n: int, seconds: float):
            async with budget.hold(n):
                order.append(f"{name}+")
                assert budget.used <= 100 or budget.used == n  # over the budget only alone
                await asyncio.sleep(seconds)
                order.append(f"{name}-")

        await asyncio.gather(request("a", 60, 0.05), request("b", 60, 0.01), request("c", 30, 0.01))
        await asyncio.gather(request("big", 500, 0.01))  # larger than the whole budget: runs alone
        return order

    order = asyncio.run(scenario())
    assert order.index("b+") > order.index("a-")  # b waited until a let go of its 60 bytes
    assert order.index("c+") < order.index("a-")  # c fitted beside a
    assert order[-2:] == ["big+", "big-"]


def test_search_and_classify__the_cli_json_has_the_http_answers_schema(client, served_index, serve_corpus, capsys):
    import json

    from moco_retrieval.app.cli import main

    query = serve_corpus / "green" / "green_003.png"
    over_http = client.post("/api/search", params={"k": 4}, files=_upload(query)).json()
    assert main(["search", str(served_index), str(query), "-k", "4", "--json", "--device", "cpu"]) == 0
    on_cli = json.loads(capsys.readouterr().out)
    assert set(on_cli) - set(over_http) == {"image_root"} and not set(over_http) - set(on_cli) - {"query"}
    for cli_hit, http_hit in zip(on_cli["results"], over_http["results"], strict=True):
        assert set(cli_hit) == set(http_hit) and cli_hit["id"] == http_hit["id"]
        assert cli_hit["image_url"] == http_hit["image_url"] and cli_hit["score"] == pytest.approx(
            http_hit["score"], abs=1e-5
        )
    voted = client.post("/api/classify", files=_upload(query)).json()
    assert main(["classify", str(served_index), str(query), "--json", "--device", "cpu"]) == 0
    on_cli = json.loads(capsys.readouterr().out)
    assert set(on_cli) == set(voted) and on_cli["label"] == voted["label"] and on_cli["k"] == voted["k"]
    assert [set(h) for h in on_cli["neighbors"]] == [set(h) for h in voted["neighbors"]]


def test_serve__a_connection_without_a_request_head_in_time_is_closed(served_engine, monkeypatch):
    """Half-open connections and request heads sent a byte at a time were held forever (uvicorn times a
    connection out only after a response); now each gets HEAD_TIMEOUT_S to send its head."""
    import socket
    import time

    import moco_retrieval.app.http_protocol as http_protocol
    from moco_retrieval.app.server import make_app
    from tests._serve_helpers import RunningServer

    monkeypatch.setattr(http_protocol, "HEAD_TIMEOUT_S", 0.5)
    server = RunningServer(make_app(served_engine, ui=False))
    try:

        def closed_after(send_slowly: bool) -> float:
            tic = time.perf_counter()
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                if send_slowly:  # a request line and headers, a few bytes every 0.2 s
                    for piece in (b"GET /api/", b"health HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n") * 3:
                        try:
                            sock.sendall(piece)
                        except OSError:
                            break
                        time.sleep(0.2)
                try:
                    assert sock.recv(1024) == b""  # closed by the server, nothing answered
                except ConnectionResetError:  # closed with our bytes unread: a reset, as closed
                    pass
            return time.perf_counter() - tic

        assert closed_after(send_slowly=False) < 3
        assert closed_after(send_slowly=True) < 3
        with httpx.Client(base_url=server.url, timeout=10) as client:  # a whole request still gets its answer,
            assert client.get("/api/health").status_code == 200  # twice on one connection (kept alive)
            time.sleep(0.2)
            assert client.get("/api/health").status_code == 200
    finally:
        server.stop()
