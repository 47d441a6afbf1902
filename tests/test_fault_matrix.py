"""The fault matrix: every hostile file kind of :mod:`tests.fault_fixtures` through a real ``moco index`` run (a
subprocess with a timeout: a hang fails, it does not block), the decodable ones and the bad ones through uploads
to a real server, indexed files swapped after indexing, hostile requests (bodies over the limit, chunked or
declared; wrong methods; 8 elongated uploads at once), the Gradio UI's file route, files that change or vanish
while a run indexes them, and unreadable files (without root's override of permissions).

The kill points of an index run are in tests/test_index_build.py (test_index__sigkill_at_each_phase_...).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import lmdb
import pytest

from moco_retrieval.contracts.filenames import display_name, encode_name
from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.index_dir import IndexDirectory
from tests._serve_helpers import RunningServer
from tests.fault_fixtures import BAD_NAME, CASES, DEEP, NFC, NFD, NON_UTF8, encode, _pattern, write_fault_folder
from tests.index_fixtures import index_encoder  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]

# gradio's queue trips pandas deprecation warnings of its own; nothing this project can act on
pytestmark = pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")


def _faiss_ids(index) -> set[int]:
    """Every live id the generation's FAISS parts hold (base - removed + delta)."""
    return set(index.ids().tolist())


def _live(out: Path) -> dict[str, dict]:
    with IndexDirectory.open(out) as d:
        return {r["path"]: r for r in d.records(range(d.manifest.next_id)) if r is not None}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, index_encoder):
    """The fault folder indexed by a real `moco index` (one worker process, as on a real run)."""
    root = tmp_path_factory.mktemp("faults")
    images, out = root / "images", root / "index"
    write_fault_folder(images)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "index",
            str(images),
            "--model",
            str(index_encoder),
            "--out",
            str(out),
            "--workers",
            "1",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    return SimpleNamespace(
        images=images,
        out=out,
        report=report,
        live=_live(out),
        stdout=proc.stdout,
        stderr=proc.stderr,
        encoder=index_encoder,
    )


@pytest.mark.parametrize("case", CASES, ids=[ascii(c.path)[1:-1][:40] for c in CASES])
def test_fault_matrix__moco_index_gives_each_kind_its_outcome(matrix, case):
    skipped = {s["path"]: s["reason"] for s in matrix.report["skipped"]}
    if case.expect == "indexed":
        assert case.path in matrix.live and case.path not in skipped
    elif case.expect == "skipped":
        assert case.path not in matrix.live
        assert case.reason in skipped[case.path]
        assert "\n" not in skipped[case.path]
    else:
        assert case.path not in matrix.live and case.path not in skipped


def test_fault_matrix__index_is_consistent_and_names_are_lossless(matrix):
    live = matrix.live
    with IndexDirectory.open(matrix.out) as d:
        assert _faiss_ids(d.index) == {r["id"] for r in live.values()}  # FAISS ids == LMDB ids
        assert d.manifest.count == len(live) == sum(c.expect == "indexed" for c in CASES)
        assert d.id_of_path(DEEP) == live[DEEP]["id"]  # over LMDB's key limit: keyed by its hash
        assert live[NFC]["id"] != live[NFD]["id"]  # two names, two files
    # the name is stored as its bytes: the LMDB key of the Latin-1 name is exactly those bytes
    env = lmdb.open(str(matrix.out / "generations" / "g000001" / "meta.lmdb"), readonly=True, lock=False, max_dbs=8)
    with env.begin(db=env.open_db(b"paths", create=False)) as txn:
        assert json.loads(txn.get(b"caf\xe9.png")) == live[NON_UTF8]["id"]
    env.close()
    assert (matrix.images / NON_UTF8).read_bytes() and encode_name(NON_UTF8) == b"caf\xe9.png"
    # and round-trips through the JSON report
    assert BAD_NAME in {s["path"] for s in matrix.report["skipped"]}
    # shown readably: one line, undecodable bytes as \xNN, the newline as \n
    assert f"  {display_name(BAD_NAME)}: not a readable image" in matrix.stdout
    assert "bad\\xff\\nname.png" == display_name(BAD_NAME)
    assert "Traceback" not in matrix.stderr
    # records keep the file's own size: EXIF upright, a big JPEG decoded reduced but recorded whole
    assert (live["exif_rotated.jpg"]["width"], live["exif_rotated.jpg"]["height"]) == (40, 30)
    assert (live["huge_valid.jpg"]["width"], live["huge_valid.jpg"]["height"]) == (6000, 4000)
    same = [live[p] for p in ("copy_of_ok.png", "inner_link.png", "ok.png")]  # one content, three names
    assert len({r["sha256"] for r in same}) == 1
    assert [r["duplicate_of"] for r in same] == [None, same[0]["id"], same[0]["id"]]


def test_fault_matrix__rerun_changes_nothing(matrix, tmp_path):
    """A second run reads the stored names back (hashed keys, skipped files) and finds nothing to do."""
    out = tmp_path / "index"
    shutil.copytree(matrix.out, out, symlinks=True)
    again = build_index_dir(
        IndexConfig(str(matrix.images), str(matrix.encoder), str(out), workers=0, progress=False, device="cpu")
    )
    assert not again.published and again.embedded == 0 and again.unchanged == len(matrix.live)


# -- through the server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(matrix):
    from moco_retrieval.app.server import make_app
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    engine = SearchEngine(matrix.out, EngineConfig(device="cpu", threads=1, poll_seconds=0))
    running = RunningServer(make_app(engine))
    with httpx.Client(base_url=running.url, timeout=30) as client:
        yield SimpleNamespace(client=client, engine=engine, url=running.url)
    running.stop()
    engine.close()


UPLOADS = [c for c in CASES if c.upload is not None]


@pytest.mark.parametrize("case", UPLOADS, ids=[c.path for c in UPLOADS])
def test_fault_matrix__upload_of_each_kind_answers_its_status(server, matrix, case):
    data = (matrix.images / case.path).read_bytes()
    r = server.client.post("/api/search", params={"k": 3}, files={"image": ("q.png", data, "image/png")})
    assert r.status_code == case.upload, r.text
    if case.upload == 200:
        assert len(r.json()["results"]) == 3
    else:
        assert case.message in r.json()["error"] and "\n" not in r.json()["error"]


def test_fault_matrix__names_are_shown_readably_and_served(server, matrix):
    for path in (NON_UTF8, NFD, "new\nline.png", DEEP):
        item = matrix.live[path]
        record = server.client.get(f"/api/items/{item['id']}").json()
        assert record["path"] == display_name(path)
        image = server.client.get(record["image_url"])
        assert image.status_code == 200 and image.content == (matrix.images / path).read_bytes()
    assert server.client.get(f"/api/items/{matrix.live[NON_UTF8]['id']}").json()["path"] == "caf\\xe9.png"


def test_fault_matrix__ui_serves_no_file_of_the_image_folder(server, matrix):
    for name in (".hidden.png", "notes.txt", "ok.png", ".hidden_folder/x.png"):
        r = server.client.get(f"/gradio_api/file={matrix.images / name}")
        assert r.status_code in (403, 404), (name, r.status_code)
    from gradio_client import Client, handle_file

    client = Client(server.url + "/", verbose=False)
    try:
        update, _, _ = client.predict(handle_file(str(matrix.images / "ok.png")), 2, -1, api_name="/search")
    finally:
        client.close()  # its heartbeat stream would hold the server's shutdown
    gallery = update["value"]  # results still show, as cached copies
    assert len(gallery) == 2 and "\nok.png\nid " in gallery[0]["caption"], gallery[0]["caption"]


def test_fault_matrix__eight_elongated_uploads_at_once_are_refused_quickly(server, matrix):
    data = (matrix.images / "line_1x250000.png").read_bytes()
    assert len(data) < 600

    def post(_):
        return server.client.post("/api/search", files={"image": ("q.png", data, "image/png")})

    tic = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    assert all(r.status_code == 400 and "too elongated" in r.json()["error"] for r in answers)
    assert time.monotonic() - tic < 20  # refused from the header, nothing allocated


def test_api__wrong_method_answers_405_with_allow(server):
    for method, path, allow in (
        ("GET", "/api/search", "POST"),
        ("GET", "/api/classify", "POST"),
        ("POST", "/api/items/1", "GET"),
        ("DELETE", "/api/stats", "GET"),
    ):
        r = server.client.request(method, path)
        assert r.status_code == 405, (method, path, r.status_code)
        assert allow in r.headers["allow"] and r.json()["error"].startswith(f"{method} is not allowed on {path}")
    assert server.client.get("/api/nothing-here").status_code == 404


# -- files swapped after indexing -----------------------------------------------------------------------------
@pytest.fixture
def swappable(tmp_path, index_encoder):
    """A small index whose files a test may replace, with a server over it."""
    from moco_retrieval.app.server import make_app
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    images = tmp_path / "images"
    images.mkdir()
    for i in range(6):
        (images / f"img{i}.png").write_bytes(encode(_pattern(seed=20 + i), "PNG"))
    build_index_dir(
        IndexConfig(str(images), str(index_encoder), str(tmp_path / "index"), workers=0, progress=False, device="cpu")
    )
    engine = SearchEngine(tmp_path / "index", EngineConfig(device="cpu", threads=1, poll_seconds=0))
    running = RunningServer(make_app(engine, ui=False))
    ids = {r["path"]: r["id"] for r in _live(tmp_path / "index").values()}
    with httpx.Client(base_url=running.url, timeout=10) as client:
        yield SimpleNamespace(images=images, client=client, ids=ids, root=tmp_path)
    running.stop()
    engine.close()


def test_item_image__served_only_while_it_is_the_indexed_file(swappable):
    s = swappable
    assert s.client.get(f"/api/items/{s.ids['img0.png']}/image").status_code == 200
    (s.images / "img0.png").unlink()
    os.symlink("/etc/hostname", s.images / "img0.png")  # swapped for a link out of the folder
    (s.images / "img1.png").unlink()  # deleted
    (s.images / "img2.png").unlink()
    os.mkfifo(s.images / "img2.png")  # replaced by a FIFO (must not hang)
    (s.images / "img3.png").write_bytes(encode(_pattern(seed=99), "PNG"))  # other content
    (s.images / "img4.png").unlink()
    os.symlink(s.images / "img5.png", s.images / "img4.png")  # a link to another indexed file
    outside = s.root / "outside"
    outside.mkdir()
    shutil.move(str(s.images / "img5.png"), outside / "img5.png")
    os.symlink(outside / "img5.png", s.images / "img5.png")  # moved out, linked back in
    expected = {
        "img0.png": "outside the image folder",
        "img1.png": "no longer on disk",
        "img2.png": "no longer a regular file",
        "img3.png": "changed since it was indexed",
        "img4.png": "outside the image folder",
        "img5.png": "outside the image folder",
    }
    for name, reason in expected.items():
        r = s.client.get(f"/api/items/{s.ids[name]}/image")
        assert r.status_code == 410, (name, r.status_code)
        assert reason in r.json()["error"] and "\n" not in r.json()["error"], (name, r.json())
    assert s.client.get("/api/items/999/image").status_code == 404


# -- hostile request bodies -----------------------------------------------------------------------------------
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def small_limit_server(server):
    from moco_retrieval.serve.http import create_app

    running = RunningServer(create_app(server.engine, max_upload_bytes=LIMIT))
    yield running
    running.stop()


def test_upload_limit__chunked_body_is_refused_at_the_limit(small_limit_server):
    host, port = "127.0.0.1", small_limit_server.port
    boundary = "xyz"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="q.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()
    chunk = b"\0" * (64 << 10)
    sent, answer = 0, b""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            (
                f"POST /api/search HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
            ).encode()
        )
        try:
            for i in range(64 * 16):  # up to 64 MiB, 64 times the limit
                piece = head + chunk if i == 0 else chunk
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                sock.setblocking(False)
                try:
                    answer += sock.recv(65536)
                except BlockingIOError:
                    pass
                sock.setblocking(True)
                if answer:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(10)
        while b"}" not in answer:  # the status line, the headers and the JSON body
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"larger than 1 MiB" in answer
    assert sent < 16 * LIMIT  # the server stopped reading at the limit (plus socket buffers)


def test_upload_limit__declared_length_over_the_limit_is_refused_unread(small_limit_server):
    r = httpx.post(small_limit_server.url + "/api/search", files={"image": ("q.png", b"\0" * (2 * LIMIT), "image/png")})
    assert r.status_code == 413 and "larger than 1 MiB" in r.json()["error"]


def test_upload_limit__reads_no_more_than_the_limit_whatever_the_application_does():
    """The middleware alone, driven by hand: a 64 MiB chunked body, an application that reads it all."""
    import asyncio

    from moco_retrieval.serve.http import UploadLimit

    read = 0

    async def greedy_app(scope, receive, send):
        nonlocal read
        while True:
            message = await receive()
            read += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    chunks = iter([{"type": "http.request", "body": b"\0" * (64 << 10), "more_body": True}] * 1024)
    sent = []

    async def receive():
        return next(chunks)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/search", "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(UploadLimit(greedy_app, limit=LIMIT, message="too large")(scope, receive, send))
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"]) == {"error": "too large"}
    assert read <= LIMIT and next(chunks, None) is not None  # most of the body was never read


# -- files that change while a run indexes them, and unreadable files -----------------------------------------
def test_index__file_changed_or_deleted_after_the_scan(tmp_path, index_encoder, monkeypatch):
    import moco_retrieval.indexer.build as build

    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        (images / f"img{i}.png").write_bytes(encode(_pattern(seed=30 + i), "PNG"))
    scan = build.scan_folder

    def scan_then_change(*args, **kwargs):
        result = scan(*args, **kwargs)
        (images / "img0.png").unlink()  # deleted after the scan
        (images / "img1.png").write_bytes(encode(_pattern(40, 40, seed=77), "PNG"))  # rewritten after the scan
        return result

    monkeypatch.setattr(build, "scan_folder", scan_then_change)
    cfg = IndexConfig(str(images), str(index_encoder), str(tmp_path / "index"), workers=0, progress=False, device="cpu")
    result = build_index_dir(cfg)
    assert [s["path"] for s in result.skipped] == ["img0.png"] and "not found" in result.skipped[0]["reason"]
    live = _live(tmp_path / "index")
    assert sorted(live) == ["img1.png", "img2.png", "img3.png"] and live["img1.png"]["width"] == 40
    monkeypatch.setattr(build, "scan_folder", scan)
    again = build_index_dir(cfg)  # the next run sees the new mtime and the vanished file
    assert again.published and again.updated == 1 and not again.skipped
    assert sorted(_live(tmp_path / "index")) == ["img1.png", "img2.png", "img3.png"]


def _without_permission_override(cmd: list[str]) -> list[str]:
    """``cmd`` run so that file permissions apply to it: as root, without CAP_DAC_OVERRIDE/READ_SEARCH."""
    if os.geteuid() != 0:
        return cmd
    assert shutil.which("setpriv"), "running as root: the test needs setpriv (util-linux) to drop the override"
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", *cmd]


def test_index__unreadable_file_and_folder_are_skipped_not_fatal(tmp_path, index_encoder):
    images = tmp_path / "images"
    (images / "locked").mkdir(parents=True)
    for name in ("good.png", "unreadable.png", "locked/hidden_inside.png"):
        (images / name).write_bytes(encode(_pattern(seed=len(name)), "PNG"))
    os.chmod(images / "unreadable.png", 0)
    os.chmod(images / "locked", 0)
    out = tmp_path / "index"
    try:
        proc = subprocess.run(
            _without_permission_override(
                [
                    sys.executable,
                    "-m",
                    "moco_retrieval",
                    "index",
                    str(images),
                    "--model",
                    str(index_encoder),
                    "--out",
                    str(out),
                    "--workers",
                    "0",
                    "--no-progress",
                ]
            ),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.chmod(images / "locked", 0o755)
        os.chmod(images / "unreadable.png", 0o644)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert sorted(_live(out)) == ["good.png"]
    assert report["skipped"] == [{"path": "unreadable.png", "reason": "cannot read (Permission denied)"}]
    assert "cannot list" in proc.stderr and "locked" in proc.stderr  # the folder: a warning, the run goes on
