"""``moco serve --workers 2``: two real uvicorn worker processes on one port, each with its own engine over
one memory-mapped index directory, both answering and both switching to a newly published generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests._serve_helpers import build_index_in_subprocess, free_port, write_colour_corpus

pytest_plugins = ("tests._serve_fixtures",)

ROOT = Path(__file__).resolve().parents[1]


def _ask(url: str, query: bytes) -> tuple[str, str]:
    """(worker pid, generation) of one search on a fresh connection."""
    with httpx.Client(timeout=30) as client:
        r = client.post(url + "/api/search", files={"image": ("q.png", query)}, params={"k": 3})
        r.raise_for_status()
        return r.headers["x-moco-worker"], r.json()["generation"]


def _until(predicate, url: str, query: bytes, timeout: float = 90) -> dict[str, set[str]]:
    """Search in parallel until ``predicate(pid -> generations seen last round)`` holds."""
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(8) as pool:
        while time.monotonic() < deadline:
            for pid, generation in pool.map(lambda _: _ask(url, query), range(16)):
                seen.setdefault(pid, set()).add(generation)
            if predicate(seen):
                return seen
            seen = {pid: set() for pid in seen}
    pytest.fail(f"workers never got there: {seen}")


def _parent(pid: str) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_serve_workers__two_processes_answer_and_both_hot_swap(private_index, encoder_onnx, tmp_path):
    corpus, index = private_index
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(index),
            "--port",
            str(port),
            "--workers",
            "2",
            "--no-ui",
            "--device",
            "cpu",
            "--poll-seconds",
            "0.2",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"127.0.0.1:{port}/ with 2 workers" in line, (line, proc.stderr.read() if proc.poll() else "")
        url = f"http://127.0.0.1:{port}"
        query = (corpus / "red" / "red_003.png").read_bytes()
        seen = _until(lambda s: len(s) == 2, url, query)
        workers = sorted(seen)
        assert all(_parent(pid) == _parent(workers[0]) for pid in workers)  # siblings under one supervisor
        (old,) = set.union(*seen.values())
        for pid in workers:  # the index is mapped from its file, not copied into each worker
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert f"generations/{old}/vectors.faiss" in maps

        write_colour_corpus(tmp_path / "more", 2, seed=99)
        for path in (tmp_path / "more").rglob("*.png"):
            target = corpus / path.relative_to(tmp_path / "more")
            target.with_name("new_" + target.name).write_bytes(path.read_bytes())
        build_index_in_subprocess(corpus, encoder_onnx, index)
        new = (index / "CURRENT").read_text().strip()
        assert new != old
        _until(lambda s: set(s) >= set(workers) and all(s[p] == {new} for p in workers), url, query)
    finally:
        _interrupt(proc)


def _interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C: the supervisor stops its workers and exits."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("moco serve --workers 2 did not stop on Ctrl-C") from None


def test_serve_workers__a_bad_index_fails_once_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(tmp_path / "nope"),
            "--workers",
            "2",
            "--port",
            str(free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4
    assert proc.stderr.strip().startswith("moco: error: index directory not found") and "\n" not in proc.stderr.strip()
