"""Damaged index directories: the matrix of every file of a generation damaged in every way, through real
``moco`` processes, the way tests/test_fault_matrix.py keeps the hostile image files.

One small index (a 50 kB encoder, 16 images, two generations: ``g000002`` = ``g000001`` plus a delta, one
removed item) is built once per module. Each case copies it (``shutil.copytree``: hard links become copies, so
the damage stays in one file of one generation), damages one file, then runs ``moco search``, ``moco index
--verify`` and an update (``moco index``, which has one image to remove) in one child process: a signal
(SIGBUS, SIGSEGV) kills that process and fails the case. Each command must end with a return code of
:mod:`contracts.errors` and at most one error line, no traceback. Then nothing may be lost: the refused commands
left ``CURRENT`` and the generations as they were, and once the file is restored both generations answer
exactly what they answered before the damage.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.index_dir import IndexDirectory
from tests._serve_helpers import write_colour_corpus
from tests.index_fixtures import write_tiny_encoder

REPO = Path(__file__).resolve().parents[1]
LIVE, PREVIOUS = "g000002", "g000001"
GONE = "green/green_000.png"  # indexed by g000002, deleted from the folder: each case's update removes it

# A child process runs the commands one after the other through the CLI's main(), each with its own stdout and
# stderr (file descriptors 1 and 2, so that logging and C libraries are captured too), and writes one JSON line
# per command. A command that raises past main() is recorded as "traceback"; a signal ends the child.
_DRIVER = r"""
import json, os, sys, tempfile, traceback
from moco_retrieval.app.cli import main
commands, results = json.loads(sys.argv[1]), sys.argv[2]
for name, argv in commands:
    with open(results, "a") as f:
        f.write(json.dumps({"start": name}) + "\n")
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
    try:
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            rc = "traceback"
            traceback.print_exc()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
    with open(results, "a") as f:
        f.write(json.dumps({"name": name, "rc": rc, "stdout": texts[0], "stderr": texts[1]}) + "\n")
"""
_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) [\w.]+: ")  # the CLI's logging format


def run_commands(commands: list[tuple[str, list[str]]], work: Path) -> dict[str, dict]:
    """Run ``moco`` commands in one child process (see ``_DRIVER``): name -> {rc, stdout, stderr}."""
    results = work / "results.jsonl"
    results.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps([(n, list(map(str, a))) for n, a in commands]), str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    started = [line["start"] for line in lines if "start" in line]
    assert proc.returncode == 0, (
        f"the child died with {proc.returncode} during `moco {started[-1:]}`"
        f" (-7: SIGBUS, -11: SIGSEGV); stderr: {proc.stderr[-2000:]}"
    )
    return {line["name"]: line for line in lines if "name" in line}


def check_one_line(name: str, result: dict) -> str:
    """The command failed or succeeded cleanly: a MocoError code, at most one error line, no traceback.
    Returns its error line ("" on success)."""
    stderr = result["stderr"]
    assert "Traceback" not in stderr, f"{name}: {stderr}"
    assert result["rc"] in (0, 1, 2, 3, 4, 5, 6, 7), f"{name}: rc {result['rc']}: {stderr}"
    errors = [line for line in stderr.splitlines() if line.startswith("moco: error:")]
    others = [line for line in stderr.splitlines() if not line.startswith("moco: error:") and not _LOG_LINE.match(line)]
    assert not others, f"{name}: lines besides the error and the log: {others}"
    assert len(errors) == (0 if result["rc"] == 0 else 1), f"{name}: {stderr}"
    return errors[0] if errors else ""


# -- the module's index --------------------------------------------------------------------------------------
def snapshot(index: Path, generation: str) -> dict:
    """What a generation answers: every record, and the 5 nearest of every live item's stored vector."""
    with IndexDirectory(index, generation) as d:
        ids = [int(i) for i in d.index.ids()]
        xq = np.stack([d.index.reconstruct(i) for i in ids])
        D, I = d.index.search(xq, 5)
        return {"records": d.records(range(d.manifest.next_id)), "I": I.tolist(), "D": np.round(D, 5).tolist()}


def _build(images: Path, encoder: Path, out: Path):
    return build_index_dir(IndexConfig(str(images), str(encoder), str(out), workers=0, progress=False, device="cpu"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """``g000001`` (16 images) and ``g000002`` (one removed, one added: a delta index, a delta store, removed
    ids), built once; then ``GONE`` is deleted from the folder."""
    root = tmp_path_factory.mktemp("damage")
    encoder = write_tiny_encoder(root / "encoder.onnx")
    images = write_colour_corpus(root / "images", 4, seed=21)
    index = root / "index"
    _build(images, encoder, index)
    (images / "red" / "red_000.png").unlink()
    write_colour_corpus(root / "more", 1, seed=22)
    shutil.copyfile(root / "more" / "blue" / "blue_000.png", images / "blue" / "blue_new.png")
    assert _build(images, encoder, index).generation == LIVE
    (images / GONE).unlink()
    return SimpleNamespace(
        root=root,
        images=images,
        encoder=encoder,
        index=index,
        query=images / "blue" / "blue_new.png",
        snapshots={g: snapshot(index, g) for g in (PREVIOUS, LIVE)},
    )


# -- damages -------------------------------------------------------------------------------------------------
def _garble(at: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        start = max(0, min(at(len(data)), len(data) - 64))
        for i in range(start, min(len(data), start + 64)):
            data[i] ^= 0xA5
        path.write_bytes(bytes(data))

    return damage


DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "emptied": lambda path: path.write_bytes(b""),
    "deleted": lambda path: path.unlink(),
    "garbled-head": _garble(lambda n: 0),
    "garbled-middle": _garble(lambda n: n // 2),
    "garbled-tail": _garble(lambda n: n),
}


@dataclass(frozen=True)
class Case:
    target: str  # the damaged file, relative to the index directory
    damage: Callable[[Path], None]
    named: str  # what the error lines must name
    id: str
    search: frozenset  # the return codes `moco search` may end with
    update: frozenset  # ... and the update (`moco index --verify` always refuses: 4)


REFUSED, ANSWERS, EITHER = frozenset({4}), frozenset({0}), frozenset({0, 4})


def _current(content: bytes | None) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        if content is None:
            path.unlink()
        else:
            path.write_bytes(content)

    return damage


CURRENT_CASES = [
    Case("CURRENT", _current(content), "CURRENT", f"CURRENT-{kind}", REFUSED, REFUSED)
    for kind, content in (
        ("deleted", None),
        ("emptied", b""),
        ("garbage", b"\x00\xffnot a name\n"),
        ("dotdot", b"../..\n"),
        ("absent-generation", b"g000007\n"),
    )
]
SIZE_OR_HEADER = ("truncated", "emptied", "deleted", "garbled-head")  # found by every open
GENERATION_FILES = {  # file of the live generation -> (what an error about it must name, (search, update) codes)
    "manifest.json": ("manifest.json", lambda kind: (REFUSED, REFUSED)),
    # the base, shared with the predecessor: its size and headers are checked at every open, its bytes by
    # --verify and compactions; a search may answer over damage inside it, but only with scores in [-1, 1]
    "vectors.faiss": ("vectors.faiss", lambda kind: (REFUSED,) * 2 if kind in SIZE_OR_HEADER else (EITHER,) * 2),
    "meta.lmdb/data.mdb": ("meta.lmdb", lambda kind: (REFUSED,) * 2 if kind in SIZE_OR_HEADER else (EITHER,) * 2),
    # the delta layer: what an update reads and copies, hashed by every update
    "delta.faiss": ("delta.faiss", lambda kind: (REFUSED if kind in SIZE_OR_HEADER else EITHER, REFUSED)),
    "removed.npy": ("removed.npy", lambda kind: (REFUSED if kind in SIZE_OR_HEADER else EITHER, REFUSED)),
    "delta.lmdb/data.mdb": ("delta.lmdb", lambda kind: (REFUSED if kind in SIZE_OR_HEADER else EITHER, REFUSED)),
    # its sha256 is checked at every open; an update copies --model, whose sha256 it knows, instead
    "encoder.onnx": ("encoder.onnx", lambda kind: (REFUSED, ANSWERS)),
}
# the base's rows and the ids of the rows the update added: a flat index searches without them; an update
# carries them forward (their sizes checked), a compaction and --verify hash them
BLOCK_FILES = ("g000001.vec.npy", "g000002.ids.npy")
FILE_CASES = [
    Case(f"generations/{LIVE}/{name}", damage, named, f"{name}-{kind}", *expect(kind))
    for name, (named, expect) in GENERATION_FILES.items()
    for kind, damage in DAMAGES.items()
]
BLOCK_CASES = [
    Case(
        f"vectors/{name}",
        damage,
        name.split(".")[0],
        f"{name}-{kind}",
        ANSWERS,
        REFUSED if kind in ("truncated", "emptied", "deleted") else ANSWERS,
    )
    for name in BLOCK_FILES
    for kind, damage in DAMAGES.items()
]
CASES = CURRENT_CASES + FILE_CASES + BLOCK_CASES


def _copy_index(src: Path, dst: Path, case: Case) -> None:
    """A copy whose files are all its own, except the encoders where they are not damaged: hard links to the
    fixture's (nothing writes an encoder in place) keep each case's copy small."""

    def copy(s, d):
        if Path(s).name == "encoder.onnx" and not case.target.endswith("encoder.onnx"):
            os.link(s, d)
        else:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=copy)


def _commands(pristine, index: Path) -> list[tuple[str, list]]:
    return [
        ("search", ["search", index, pristine.query, "-k", "3", "--json"]),
        ("verify", ["index", "--verify", "--out", index]),
        (
            "update",
            ["index", pristine.images, "--model", pristine.encoder, "--out", index, "--workers", "0", "--no-progress"],
        ),
    ]


@pytest.fixture(scope="module")
def answers(pristine, tmp_path_factory):
    """What the three commands answer on the undamaged index (a copy: the update changes it)."""
    work = tmp_path_factory.mktemp("undamaged")
    shutil.copytree(pristine.index, work / "index")
    results = run_commands(_commands(pristine, work / "index"), work)
    assert [results[name]["rc"] for name in ("search", "verify", "update")] == [0, 0, 0], results
    return results


def _answer(stdout: str) -> dict:
    """A `moco search --json` answer without its timings (which differ between any two runs)."""
    answer = json.loads(stdout)
    answer.pop("timings", None)
    return answer


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_damaged_index__one_line_errors_and_nothing_lost(case, pristine, answers, tmp_path):
    from moco_retrieval.contracts.errors import ArtifactError
    from moco_retrieval.indexer.integrity import verify_index_dir

    index = tmp_path / "index"
    _copy_index(pristine.index, index, case)
    case.damage(index / case.target)
    damaged = (index / case.target).read_bytes() if (index / case.target).exists() else None
    results = run_commands(_commands(pristine, index), tmp_path)
    errors = {name: check_one_line(name, result) for name, result in results.items()}
    for name, expected in (("search", case.search), ("verify", REFUSED), ("update", case.update)):
        assert results[name]["rc"] in expected, (
            f"{name}: rc {results[name]['rc']}, expected {set(expected)}: {errors[name]}"
        )
        if results[name]["rc"]:
            assert case.named in errors[name], f"{name}: {errors[name]}"
    if case in CURRENT_CASES:
        assert "g000001, g000002" in errors["search"] and "--rebuild" in errors["search"]
    if case.search == ANSWERS:  # a file the search does not read: the same answer
        assert _answer(results["search"]["stdout"]) == _answer(answers["search"]["stdout"])
    if results["update"]["rc"] == 0:  # it published a generation that opens, and carried no damage in silence
        with IndexDirectory(index, "g000003") as d:
            assert d.index.ntotal == d.manifest.count
        if case.target.endswith("encoder.onnx"):  # the damaged copy was replaced by --model's bytes
            assert (index / "generations" / "g000003" / "encoder.onnx").read_bytes() == pristine.encoder.read_bytes()
        else:  # its record is the undamaged file's, so --verify still finds the damage it shares
            with pytest.raises(ArtifactError, match=re.escape(case.named)):
                verify_index_dir(index)
    else:  # nothing lost: the refused update changed nothing
        assert sorted(p.name for p in (index / "generations").iterdir()) == [PREVIOUS, LIVE]
        assert ((index / case.target).read_bytes() if (index / case.target).exists() else None) == damaged
        if case in CURRENT_CASES:  # refused before anything was scanned, embedded or written
            assert not (index / "work").exists()
    # ... and once the file is restored, both generations (the previous one where a publish kept it) answer
    # exactly as before
    shutil.copy2(pristine.index / case.target, index / case.target)
    for generation in (PREVIOUS, LIVE):
        if (index / "generations" / generation).is_dir():
            assert snapshot(index, generation) == pristine.snapshots[generation]


def test_damaged_current__rebuild_starts_over_after_the_newest_generation(pristine, tmp_path):
    index = tmp_path / "index"
    shutil.copytree(pristine.index, index)
    (index / "CURRENT").write_text("../..\n")
    with IndexDirectory(index, LIVE) as d:
        next_id = d.manifest.next_id
    result = build_index_dir(
        IndexConfig(
            str(pristine.images),
            str(pristine.encoder),
            str(index),
            workers=0,
            progress=False,
            device="cpu",
            rebuild=True,
        )
    )
    assert result.generation == "g000003" and (index / "CURRENT").read_text() == "g000003\n"
    assert sorted(p.name for p in (index / "generations").iterdir()) == [LIVE, "g000003"]
    with IndexDirectory.open(index) as d:
        assert min(int(i) for i in d.index.ids()) >= next_id  # ids continue: none is reused


# -- full disks ------------------------------------------------------------------------------------------------
def _names(start: int, stop: int) -> list[str]:
    return [f"c{i % 3}/f{i:04d}.png" for i in range(start, stop)]


def _synthetic_index(tmp_path: Path):
    """An index of 200 synthetic vectors (no model runs) and 50 more files for an update."""
    from tests.index_fixtures import SyntheticEmbedder, touch_files

    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model", d=64)
    touch_files(data, _names(0, 200))
    cfg = IndexConfig(str(data), str(emb.encoder.path), str(out), workers=0, progress=False, shard_size=64)
    build_index_dir(cfg, embedder=emb)
    touch_files(data, _names(200, 250))
    return cfg, emb, out


def _assert_untouched(out: Path, generation: str = PREVIOUS) -> None:
    assert (out / "CURRENT").read_text() == f"{generation}\n"
    assert sorted(p.name for p in (out / "generations").iterdir()) == [generation]  # no staging left behind
    assert {p.name.split(".")[0] for p in (out / "vectors").iterdir()} == {generation}  # no half-written block
    with IndexDirectory.open(out) as d:
        assert d.index.ntotal == d.manifest.count == 200


def test_disk_full__while_writing_the_vector_block_is_one_line_and_keeps_the_live_generation(tmp_path, monkeypatch):
    import errno

    from moco_retrieval.contracts.errors import OutputError
    from moco_retrieval.indexer import vectors

    cfg, emb, out = _synthetic_index(tmp_path)

    class FullDisk:  # a file on a disk that fills up after the block's header and a few rows
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(memoryview(data).cast("B"))
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def close(self):
            self.f.close()

    monkeypatch.setattr(vectors, "open", lambda *a, **k: FullDisk(open(*a, **k)), raising=False)
    with pytest.raises(OutputError, match=r"^disk full while writing .*vectors/g000002\.vec\.npy; free some space"):
        build_index_dir(cfg, embedder=emb)
    _assert_untouched(out)
    monkeypatch.undo()
    assert build_index_dir(cfg, embedder=emb).generation == LIVE  # and the rerun publishes, from the shards
    assert emb.calls[-1] == 0


def test_disk_full__when_the_faiss_file_is_closed_is_one_line_and_nothing_on_stderr(tmp_path, monkeypatch, capfd):
    """FAISS's own file writer reported a failed close only by printing "close error" to stderr from a destructor
    (the last buffered bytes never reached a full disk, and no exception said so); written through Python's I/O,
    the close raises the one-line OutputError."""
    import errno

    import faiss

    from moco_retrieval.contracts.errors import OutputError
    from moco_retrieval.indexer import faiss_index

    class FullAtClose(io.FileIO):
        def close(self):
            if not self.closed:
                super().close()
                raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(faiss_index, "open", lambda path, mode: FullAtClose(path, "w"), raising=False)
    index = faiss.IndexFlatIP(8)
    index.add(np.ones((4, 8), dtype="float32"))
    with pytest.raises(OutputError, match=r"^disk full while writing .*x\.faiss; free some space") as info:
        faiss_index.write_index(index, str(tmp_path / "x.faiss"))
    assert "\n" not in str(info.value)
    assert capfd.readouterr().err == ""


def test_disk_full__free_space_is_checked_before_the_block_is_written(tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    from moco_retrieval.contracts import atomic
    from moco_retrieval.contracts.errors import OutputError

    cfg, emb, out = _synthetic_index(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 2048, 2048))
    with pytest.raises(OutputError, match=r"^disk full: vector block .*g000002\.vec\.npy needs 0\.0 MB"):
        build_index_dir(cfg, embedder=emb)
    monkeypatch.setattr(atomic.shutil, "disk_usage", shutil_module.disk_usage)
    _assert_untouched(out)


def _unshare_prefix() -> list[str] | None:
    """The command that runs the rest in a mount namespace of its own (where a tmpfs may be mounted without
    touching the machine's mounts), or None where this machine does not allow it."""
    if shutil.which("unshare") is None:
        return None
    # private propagation said, not left to unshare's default: no mount made inside may reach the machine's
    # own; and the probe mounts over an empty folder of its own, never over /tmp or /mnt
    prefix = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    with tempfile.TemporaryDirectory(prefix="moco-unshare-probe-") as target:
        probe = subprocess.run(
            prefix + ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", target], capture_output=True, timeout=30
        )
    return prefix if probe.returncode == 0 else None


def test_disk_full__a_small_tmpfs_at_every_fill_level_gives_one_line_never_a_signal(pristine, tmp_path):
    """A first build into a tmpfs too small for it, at sizes that run out in each of its writers in turn
    (shards, metadata, vector block, FAISS, encoder copy, manifest): each run ends with exit 5 and one line,
    never with SIGBUS, and nothing is published half."""
    prefix = _unshare_prefix()
    if prefix is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no mount namespace can be made for a small tmpfs (unshare --mount)")
        pytest.skip("no mount namespace here for a small tmpfs; the ENOSPC injection tests above cover the writer")
    encoder = write_tiny_encoder(tmp_path / "encoder.onnx", d=256)
    images = write_colour_corpus(tmp_path / "images", 60, seed=23)  # 240 images: 240 kB of vectors per copy
    full = tmp_path / "full"
    argv = [
        sys.executable,
        "-m",
        "moco_retrieval",
        "index",
        str(images),
        "--model",
        str(encoder),
        "--workers",
        "0",
        "--no-progress",
        "--out",
    ]
    subprocess.run(argv + [str(full)], cwd=REPO, check=True, capture_output=True, timeout=120)
    needed = sum(p.stat().st_size for p in full.rglob("*") if p.is_file()) + (len(list(full.rglob("*"))) << 12)
    disk = tmp_path / "disk"
    disk.mkdir()
    outcomes = []
    for fraction in (0.1, 0.25, 0.4, 0.55, 0.75):  # measured: shards, block (free space), block, FAISS, encoder
        size_kb = max(64, int(needed * fraction) >> 10)
        script = 'mount -t tmpfs -o size="$1"k tmpfs "$2" && shift 2 && exec "$@"'
        proc = subprocess.run(
            prefix + ["sh", "-c", script, "sh", str(size_kb), str(disk)] + argv + [str(disk / "i")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode in (0, 5), f"{size_kb} kB: exit {proc.returncode} (-7: SIGBUS): {proc.stderr[-1500:]}"
        error = check_one_line(f"{size_kb} kB", {"rc": proc.returncode, "stderr": proc.stderr})
        assert proc.returncode == 0 or "disk full" in error or "cannot write" in error, error
        outcomes.append(proc.returncode)
    assert outcomes.count(5) >= 4, outcomes


# -- damage the checks at open cannot see: scores, compactions, --verify ---------------------------------------
def _rewrite_base(index: Path, change: Callable) -> None:
    """Rewrite the live base's vectors.faiss in place with ``change(codes [n, d] float32, ids [n] int64)`` applied:
    the same size, other bytes (what damage inside the file looks like to every check but a hash)."""
    import faiss

    path = index / "generations" / LIVE / "vectors.faiss"
    size = path.stat().st_size
    base = faiss.read_index(str(path))
    inner = faiss.downcast_index(base.index)
    codes = faiss.vector_to_array(inner.codes).view(np.float32).reshape(base.ntotal, base.d).copy()
    ids = faiss.vector_to_array(base.id_map).copy()
    change(codes, ids)
    faiss.copy_array_to_vector(codes.view(np.uint8).ravel(), inner.codes)
    faiss.copy_array_to_vector(ids, base.id_map)
    faiss.write_index(base, str(path))
    assert path.stat().st_size == size


def _scaled(value: float):
    def change(codes, ids):
        codes[ids == 1] = value  # item 1: every query's best match, at a score of ~1e36 (or NaN)

    return change


def _foreign_id(codes, ids):
    ids[ids == 1] = 10**12  # an id no run ever gave out


@pytest.mark.parametrize(
    "change, message",
    [(_scaled(1e35), "at a score of"), (_foreign_id, "the id 1000000000000, which it never gave out")],
    ids=["score-1e36", "foreign-id"],
)
def test_engine__refuses_a_result_only_damage_makes_and_logs_it_once(change, message, pristine, tmp_path, caplog):
    from moco_retrieval.contracts.errors import ArtifactError
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    index = tmp_path / "index"
    shutil.copytree(pristine.index, index)
    _rewrite_base(index, change)
    with SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0)) as engine:  # sizes match
        for _ in range(2):
            with pytest.raises(ArtifactError, match=f"{message}.*moco index --verify"):
                engine.search([pristine.query], k=3)
        with pytest.raises(ArtifactError, match=message):
            engine.search_by_id(0, k=3)
        with pytest.raises(ArtifactError, match="at a score of nan"):  # FAISS drops NaN codes; re-ranking may not
            engine._current._check_results(np.array([[np.nan]], dtype=np.float32), np.array([[0]]))
    assert [r.levelname for r in caplog.records if "refused a search result" in r.getMessage()] == ["ERROR"]


def test_api__a_damaged_result_answers_409_in_one_line(pristine, tmp_path):
    import httpx

    from moco_retrieval.app.server import make_app
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine
    from tests._serve_helpers import RunningServer

    index = tmp_path / "index"
    shutil.copytree(pristine.index, index)
    _rewrite_base(index, _scaled(1e35))
    with SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0)) as engine:
        server = RunningServer(make_app(engine, ui=False))
        try:
            r = httpx.post(
                server.url + "/api/search",
                files={"image": ("q.png", pristine.query.read_bytes())},
                params={"k": 3},
                timeout=30,
            )
            assert r.status_code == 409 and "outside [-1, 1]" in r.json()["error"] and "\n" not in r.json()["error"]
            assert httpx.get(server.url + "/api/health", timeout=10).status_code == 200  # and it still serves
        finally:
            server.stop()


def test_compaction__over_a_damaged_vector_block_is_refused_and_publishes_nothing(tmp_path):
    from moco_retrieval.contracts.errors import ArtifactError

    cfg, emb, out = _synthetic_index(tmp_path)
    block = out / "vectors" / "g000001.vec.npy"
    _garble(lambda n: n // 2)(block)  # same size: only its sha256 tells (the update itself checks sizes)
    with pytest.raises(ArtifactError, match=r"g000001\.vec\.npy is damaged: its sha256 is .*rebuild"):
        build_index_dir(dataclasses.replace(cfg, compact="now"), embedder=emb)
    assert (out / "CURRENT").read_text() == "g000002\n"  # the update published; its compaction did not
    assert sorted(p.name for p in (out / "generations").iterdir()) == [PREVIOUS, LIVE]
    with IndexDirectory.open(out) as d:
        assert d.index.ntotal == d.manifest.count == 250


def test_verify__before_an_update_finds_damage_only_a_hash_sees(tmp_path):
    from moco_retrieval.contracts.errors import ArtifactError

    cfg, emb, out = _synthetic_index(tmp_path)
    _garble(lambda n: n // 2)(out / "generations" / PREVIOUS / "vectors.faiss")
    with pytest.raises(ArtifactError, match=r"vectors\.faiss is damaged"):
        build_index_dir(dataclasses.replace(cfg, verify=True), embedder=emb)
    _assert_untouched(out)


def test_manifest__version_2_without_checksums_still_opens_verifies_and_updates(pristine, tmp_path):
    """A generation written before checksums were recorded: it opens and serves unverified, --verify says so,
    and the next update records them (hashing the shared base once)."""
    from moco_retrieval.indexer.integrity import verify_index_dir

    index = tmp_path / "index"
    shutil.copytree(pristine.index, index)
    for generation in (PREVIOUS, LIVE):
        path = index / "generations" / generation / "manifest.json"
        raw = json.loads(path.read_text())
        del raw["files"], raw["block_files"]
        assert raw["format_version"] == 2
        path.write_text(json.dumps(raw))
    assert snapshot(index, LIVE) == pristine.snapshots[LIVE]
    assert not verify_index_dir(index).recorded
    results = run_commands(
        [
            ("verify", ["index", "--verify", "--out", index]),
            (
                "update",
                [
                    "index",
                    pristine.images,
                    "--model",
                    pristine.encoder,
                    "--out",
                    index,
                    "--workers",
                    "0",
                    "--no-progress",
                ],
            ),
        ],
        tmp_path,
    )
    assert results["verify"]["rc"] == 0 and "records no checksums" in results["verify"]["stdout"]
    assert results["update"]["rc"] == 0, results["update"]["stderr"]
    verified = verify_index_dir(index)
    assert verified.generation == "g000003" and verified.recorded and verified.checked.hashed == 10


def test_serve__refuses_to_start_on_a_damaged_index_in_one_line(pristine, tmp_path):
    """With a truncated delta.lmdb the server used to start and die on its first search (SIGBUS)."""
    index = tmp_path / "index"
    shutil.copytree(pristine.index, index)
    DAMAGES["truncated"](index / "generations" / LIVE / "delta.lmdb" / "data.mdb")
    for workers in ("1", "2"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "moco_retrieval",
                "serve",
                str(index),
                "--port",
                "0",
                "--workers",
                workers,
                "--device",
                "cpu",
                "--no-ui",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        error = check_one_line(f"serve --workers {workers}", {"rc": proc.returncode, "stderr": proc.stderr})
        assert proc.returncode == 4 and "delta.lmdb/data.mdb has" in error and "(truncated or replaced)" in error


def test_engine__keeps_serving_when_a_damaged_generation_is_published_and_says_so_once(pristine, tmp_path, caplog):
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    index = tmp_path / "index"
    shutil.copytree(pristine.index, index)
    with SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0)) as engine:
        before = engine.search([pristine.query], k=3)[0].hits
        shutil.copytree(index / "generations" / LIVE, index / "generations" / "g000003")
        DAMAGES["truncated"](index / "generations" / "g000003" / "delta.lmdb" / "data.mdb")
        (index / "CURRENT").write_text("g000003\n")
        assert not engine.refresh() and not engine.refresh()
        assert engine.generation == LIVE and engine.search([pristine.query], k=3)[0].hits == before
        (index / "CURRENT").write_text("")
        assert not engine.refresh() and not engine.refresh()
        assert engine.search([pristine.query], k=3)[0].hits == before
    logged = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert len([m for m in logged if "not switching to generation g000003" in m]) == 1
    assert len([m for m in logged if "CURRENT is empty" in m]) == 1


@pytest.mark.parametrize("name", ["trained.faiss", "vectors.ivfdata"])
def test_ivfpq_on_disk__its_trained_and_list_files_are_checked_too(name, tmp_path):
    """The files only IVF indexes have: truncated, an open refuses them; garbled, --verify (and every update,
    for the trained lists it copies) does."""
    from moco_retrieval.contracts.errors import ArtifactError
    from moco_retrieval.indexer.integrity import verify_index_dir
    from tests.index_fixtures import SyntheticEmbedder, touch_files

    data, out = tmp_path / "images", tmp_path / "index"
    emb = SyntheticEmbedder(tmp_path / "model", d=32)
    touch_files(data, _names(0, 600))
    cfg = IndexConfig(
        str(data),
        str(emb.encoder.path),
        str(out),
        workers=0,
        progress=False,
        shard_size=256,
        index_type="ivfpq",
        max_index_memory=1000,
    )
    build_index_dir(cfg, embedder=emb)
    path = out / "generations" / PREVIOUS / name
    assert path.is_file() and verify_index_dir(out).checked.hashed == 7  # 5 files, the block's 2
    pristine = path.read_bytes()
    _garble(lambda n: n // 2)(path)
    with pytest.raises(ArtifactError, match=f"{re.escape(name)} is damaged: its sha256"):
        verify_index_dir(out)
    if name == "trained.faiss":
        touch_files(data, _names(600, 610))
        with pytest.raises(ArtifactError, match=f"{re.escape(name)} is damaged"):
            build_index_dir(cfg, embedder=emb)
    path.write_bytes(pristine[: len(pristine) // 2])
    with pytest.raises(ArtifactError, match=f"{re.escape(name)} has {len(pristine) // 2:,} bytes"):
        IndexDirectory.open(out)
    path.write_bytes(pristine)
    with IndexDirectory.open(out) as d:
        assert d.index.ntotal == 600
