"""``moco search``, ``moco classify`` and ``moco serve`` from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from moco_retrieval.app.cli import main
from tests._serve_helpers import free_port

pytest_plugins = ("tests._serve_fixtures",)  # the shared serving fixtures (index, engine, server)

ROOT = Path(__file__).resolve().parents[1]


def test_search_cli__prints_neighbours_as_json_and_table(served_index, serve_corpus, capsys):
    query = serve_corpus / "red" / "red_009.png"
    assert main(["search", str(served_index), str(query), "-k", "3", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [h["path"] for h in out["results"]][0] == "red/red_009.png" and len(out["results"]) == 3
    assert main(["search", str(served_index), str(query), "-k", "2"]) == 0
    table = capsys.readouterr().out
    assert "red/red_009.png" in table and "rank" in table


def test_classify_cli__prints_the_voted_label(served_index, serve_corpus, capsys):
    assert main(["classify", str(served_index), str(serve_corpus / "green" / "green_010.png"), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split(":")[1].split()[0] == "green"
    assert main(["classify", str(served_index), str(serve_corpus / "green" / "green_010.png"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] == "green"


def test_search_cli__bad_image_or_k_is_a_one_line_error(served_index, tmp_path, capsys):
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"definitely not a jpeg")
    assert main(["search", str(served_index), str(junk)]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("moco: error:") and "\n" not in err
    assert main(["search", str(served_index), str(junk), "-k", "0"]) == 2
    assert main(["search", str(tmp_path / "no-index"), str(junk)]) == 4


def test_serve_cli__serves_until_interrupted_and_refuses_a_busy_port(served_index, serve_corpus):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(served_index),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once uvicorn listens
        assert f"http://127.0.0.1:{port}/" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/api/health", timeout=10).json()["status"] == "ok"
        query = serve_corpus / "blue" / "blue_003.png"
        r = httpx.post(url + "/api/search", files={"image": ("q.png", query.read_bytes())}, timeout=30)
        assert r.json()["results"][0]["path"] == "blue/blue_003.png"
        assert httpx.get(url + "/", timeout=10).status_code == 200  # the Gradio page
        busy = subprocess.run(
            [sys.executable, "-m", "moco_retrieval", "serve", str(served_index), "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert busy.returncode == 2 and "already in use" in busy.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("moco serve did not stop on Ctrl-C")
    assert proc.returncode in (0, 130)


def test_demo_cli__serves_at_the_end_unless_no_serve():
    from moco_retrieval.app.cli import build_parser

    assert build_parser().parse_args(["demo"]).serve is True
    args = build_parser().parse_args(["demo", "--no-serve", "--port", "9000"])
    assert args.serve is False and args.port == 9000


def test_cli__version_and_loudness_flags_in_any_position(served_index, serve_corpus, capsys):
    import logging

    import moco_retrieval
    from moco_retrieval.app.cli import split_loudness

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"moco-retrieval {moco_retrieval.__version__}"
    assert split_loudness(["search", "I", "q.png", "-v"]) == (logging.DEBUG, ["search", "I", "q.png"])
    assert split_loudness(["-q", "index", "D", "--", "-v"]) == (logging.WARNING, ["index", "D", "--", "-v"])
    query = serve_corpus / "red" / "red_009.png"
    assert main(["search", str(served_index), str(query), "-k", "1", "--json", "-v"]) == 0  # -v after the command
    assert json.loads(capsys.readouterr().out)["results"][0]["path"] == "red/red_009.png"
    assert logging.getLogger("PIL").getEffectiveLevel() >= logging.INFO  # -v does not flood with PIL's chunks


_WITHOUT_TORCH = """
import sys
class Absent:  # an install without the [train] extra
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision", "timm", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
from moco_retrieval.app.cli import main
code = main(sys.argv[1:])
assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
sys.exit(code)
"""


def test_cli__without_the_train_extra_search_works_and_train_says_what_to_install(served_index, serve_corpus, tmp_path):
    query = str(next(serve_corpus.rglob("*.png")))
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _WITHOUT_TORCH, *a], capture_output=True, text=True, timeout=120
    )
    found = run("search", str(served_index), query, "-k", "3", "--json", "--device", "cpu")
    assert found.returncode == 0, found.stderr
    assert len(json.loads(found.stdout)["results"]) == 3
    for command in (["train", str(serve_corpus), "--out", str(tmp_path / "run")], ["export", "x", "--out", "y"]):
        refused = run(*command)
        assert refused.returncode == 2 and refused.stderr.strip() == (
            f"moco: error: `moco {command[0]}` needs torch, which this install lacks: "
            "pip install 'moco-retrieval[train]'"
        )


def test_cli__a_reader_that_leaves_early_gets_no_traceback(served_index, serve_corpus):
    query = str(next(serve_corpus.rglob("*.png")))
    gone = (
        "import os, sys\nr, w = os.pipe()\nos.close(r)\nos.dup2(w, 1)  # stdout: a pipe nobody reads (`| head`)\n"
        "from moco_retrieval.app.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", gone, "search", str(served_index), query, "--device", "cpu", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 141 and proc.stderr == ""


def test_cli__without_faiss_and_onnxruntime_says_to_choose_cpu_or_gpu(served_index, serve_corpus):
    absent = _WITHOUT_TORCH.replace('("torch", "torchvision", "timm", "matplotlib")', '("faiss", "onnxruntime")')
    query = str(next(serve_corpus.rglob("*.png")))
    proc = subprocess.run(
        [sys.executable, "-c", absent, "search", str(served_index), query], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "which this install lacks: pip install 'moco-retrieval[cpu]' (or '[gpu]' on a machine with a GPU)"
    )
