"""Hostile requests to the Gradio UI of the real server (issue 18): a client may hand it uploads only, never a
path on the server; the development routes are gone; uploads do not pile up. Each attack is the raw HTTP
request an attacker would send, against one process and against ``moco serve --workers 2``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests._serve_helpers import free_port, serve_workers_process

pytest_plugins = ("tests._serve_fixtures",)
pytestmark = pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")

ROOT = Path(__file__).resolve().parents[1]
SECRET = "/etc/passwd"


def gradio_call(url: str, api_name: str, data: list, timeout: float = 30) -> tuple[str, str]:
    """``(event, data)`` of the last event of a Gradio ``/gradio_api/call/<api_name>`` request, as sent by any
    HTTP client (``event`` is ``"complete"`` or ``"error"``)."""
    with httpx.Client(base_url=url, timeout=timeout) as client:
        r = client.post(f"/gradio_api/call/{api_name}", json={"data": data})
        r.raise_for_status()
        event_id = r.json()["event_id"]
        last = ("", "")
        with client.stream("GET", f"/gradio_api/call/{api_name}/{event_id}") as stream:
            event = ""
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    last = (event, line.split(":", 1)[1].strip())
                    break
        return last


def server_file(path: str) -> dict:
    return {"path": path, "meta": {"_type": "gradio.FileData"}}


def assert_refuses_server_paths(url: str) -> None:
    """Naming a server file as the query image is refused quickly, copies nothing, and the server answers on."""
    before = set(_copies_of_the_secret())
    for path in (SECRET, "/dev/zero", "/proc/self/environ"):
        tic = time.monotonic()
        event, data = gradio_call(url, "search", [server_file(path), 10, -1, []])  # image, k, min score, labels
        assert event == "error" and "input values" not in (data or ""), (path, event, data)
        assert time.monotonic() - tic < 10, path  # refused before anything is read (/dev/zero never ends)
        assert httpx.get(url + "/api/health", timeout=10).status_code == 200
    # nothing of the secret reached a place the UI serves from: asked by name or by any cached copy
    assert httpx.get(f"{url}/gradio_api/file={SECRET}", timeout=10).status_code in (403, 404)
    assert set(_copies_of_the_secret()) == before


def _copies_of_the_secret() -> list[Path]:
    """Files in Gradio's upload folder holding the secret's bytes."""
    from gradio.utils import get_upload_folder

    secret, cache = Path(SECRET).read_bytes(), Path(get_upload_folder())
    return [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size == len(secret) and p.read_bytes() == secret]


def assert_uploads_still_work(url: str, image: Path) -> None:
    """The way a browser (and gradio_client) asks: upload first, then name the upload."""
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/gradio_api/upload", files={"files": (image.name, image.read_bytes(), "image/png")})
        r.raise_for_status()
        (uploaded,) = r.json()
    event, data = gradio_call(url, "search", [server_file(uploaded), 3, -1, []])
    assert event == "complete", data
    gallery = json.loads(data)[0]["value"]  # an update that also clears the gallery's selection
    assert len(gallery) == 3 and gallery[0]["caption"].startswith("1.000 · ")


def test_gradio__a_server_path_as_the_query_is_refused_and_the_server_answers_on(live_server, serve_corpus):
    assert_refuses_server_paths(live_server.url)
    assert_uploads_still_work(live_server.url, serve_corpus / "blue" / "blue_002.png")


def test_gradio__development_reload_route_is_gone(live_server):
    r = httpx.get(live_server.url + "/gradio_api/dev/reload", timeout=10)
    assert r.status_code == 404


def test_gradio__uploads_are_trimmed_oldest_first_to_the_cap(tmp_path):
    from moco_retrieval.app.gradio_app import trim_uploads

    files = set()
    for i in range(5):
        path = tmp_path / f"u{i}.png"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - 100 + i,) * 2)  # ctime follows: touched in order
        files.add(str(path))
        time.sleep(0.01)
    files.add(str(tmp_path / "gone.png"))  # deleted by someone else: forgotten, not an error
    freed = trim_uploads(files, max_bytes=2500)
    assert freed == 3000
    assert sorted(Path(f).name for f in files) == ["u3.png", "u4.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u3.png", "u4.png"]
    assert trim_uploads(files, max_bytes=2500) == 0


def test_gradio__two_workers_refuse_server_paths(served_index, serve_corpus):
    with serve_workers_process(served_index, 2) as url:
        for _ in range(2):  # connections are spread over the workers: ask each more than once
            assert_refuses_server_paths(url)
        assert httpx.get(url + "/gradio_api/dev/reload", timeout=10).status_code == 404


def test_gradio__unknown_paths_answer_404_in_the_projects_error_format(live_server):
    for path in ("/nope", "/gradio_api/nope", "/gradio_api/dev/reload", "/api/nope"):
        r = httpx.get(live_server.url + path, timeout=10)
        assert r.status_code == 404, path
        body = r.json()
        assert set(body) == {"error"} and "\n" not in body["error"], (path, body)


def test_serve__an_unwritable_upload_folder_is_one_line(served_index, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(served_index),
            "--port",
            str(free_port()),
            "--device",
            "cpu",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, GRADIO_TEMP_DIR=str(blocker / "gradio")),
    )
    assert proc.returncode == 5, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("moco: error:")]
    assert "GRADIO_TEMP_DIR" in line and "Traceback" not in proc.stderr
