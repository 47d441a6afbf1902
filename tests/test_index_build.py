"""``moco index`` end to end on real exported encoders, real FAISS and real LMDB: bad files, self-retrieval,
incremental updates, resume after SIGKILL, model mismatch, CLI errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.encoder import OnnxEncoder
from moco_retrieval.indexer.index_dir import IndexDirectory, current_generation
from moco_retrieval.indexer.manifest import file_sha256
from tests.index_fixtures import index_encoder, other_encoder, write_corpus  # noqa: F401 (fixtures)
from moco_retrieval.trainer.demo_data import draw_shape

REPO = Path(__file__).resolve().parents[1]


def _cfg(data: Path, model: Path, out: Path, **kw) -> IndexConfig:
    values = dict(workers=0, batch_size=8, progress=False, shard_size=8)
    values.update(kw)
    return IndexConfig(str(data), str(model), str(out), **values)


def _faiss_ids(index) -> set[int]:
    """Every live id the generation's FAISS parts hold (base - removed + delta)."""
    return set(index.ids().tolist())


def _live(d: IndexDirectory) -> dict[str, int]:
    """path -> id of every live record (walking ids 0..next_id)."""
    recs = [r for r in d.records(range(d.manifest.next_id)) if r is not None]
    return {r["path"]: r["id"] for r in recs}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus") / "images"
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def built(corpus, index_encoder, tmp_path_factory):
    data, info = corpus
    out = tmp_path_factory.mktemp("built") / "index"
    result = build_index_dir(_cfg(data, index_encoder, out, workers=1))  # real worker processes here
    return out, result


def test_index__count_is_readable_images_and_bad_files_are_reported(built, corpus):
    out, result = built
    _, info = corpus
    assert result.count == len(info["good"]) and result.added == len(info["good"])
    assert [s["path"] for s in result.skipped] == info["bad"]
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    assert "empty" in reasons["circle/empty.png"] and "too large" in reasons["ring/bomb.png"]
    assert "truncated" in reasons["circle/truncated.png"] and "not a readable image" in reasons["square/notes.jpg"]
    import json

    report = json.loads((out / "report.json").read_text())
    assert [s["path"] for s in report["skipped"]] == info["bad"]
    with IndexDirectory.open(out) as d:
        assert d.index.ntotal == d.manifest.count == len(info["good"])
        assert sorted(_live(d)) == info["good"]
        assert d.labels()["star"] == 4  # 3 generated + the duplicate copy


def test_index__every_faiss_id_has_a_record_and_back(built):
    out, _ = built
    with IndexDirectory.open(out) as d:
        ids = _faiss_ids(d.index)
        assert set(_live(d).values()) == ids
        for rec in d.records(sorted(ids)):
            assert rec is not None and d.id_of_path(rec["path"]) == rec["id"]
            assert (d.image_path(rec["id"])).is_file()
            assert rec["width"] == rec["height"] == 32 and len(rec["sha256"]) == 64


def test_index__exact_duplicate_is_recorded(built, corpus):
    out, _ = built
    original, copy = corpus[1]["duplicate"]
    with IndexDirectory.open(out) as d:
        a, b = d.record(d.id_of_path(original)), d.record(d.id_of_path(copy))
        assert a["sha256"] == b["sha256"] and a["duplicate_of"] is None and b["duplicate_of"] == a["id"]
        assert d.manifest.duplicates == 1


def test_index__directory_is_self_sufficient(built, index_encoder):
    out, _ = built
    with IndexDirectory.open(out) as d:
        assert d.encoder_path.read_bytes() == Path(index_encoder).read_bytes()
        assert d.manifest.model_sha256 == OnnxEncoder(d.encoder_path, device="cpu").sha256
        assert current_generation(out) == d.generation == "g000001"


@pytest.mark.parametrize(
    "index_type,factory_prefix", [("flat", "IDMap2,Flat"), ("hnsw", "IDMap2,HNSW"), ("ivf", "IVF")]
)
def test_index__query_image_finds_itself(index_type, factory_prefix, corpus, index_encoder, tmp_path):
    data, info = corpus
    result = build_index_dir(_cfg(data, index_encoder, tmp_path / "idx", index_type=index_type))
    assert result.factory.startswith(factory_prefix)
    encoder = OnnxEncoder(index_encoder, device="cpu", threads=1)
    with IndexDirectory.open(tmp_path / "idx") as d:
        assert 0.0 < d.manifest.recall_at_10 <= 1.0
        assert d.manifest.recall_at_10 == result.recall_at_10
        queries = info["good"][1::5]
        D, I = d.index.search(encoder.embed_images([data / p for p in queries]), 2)
        for path, scores, ids in zip(queries, D, I):
            assert (
                d.record(ids[0])["path"] == path or d.record(ids[0])["sha256"] == d.record(d.id_of_path(path))["sha256"]
            )
            assert scores[0] == pytest.approx(1.0, abs=1e-4)


def test_index__incremental_add_delete_modify_then_unchanged(corpus, index_encoder, tmp_path):
    src, info = corpus
    data = tmp_path / "images"
    shutil.copytree(src, data)
    out = tmp_path / "idx"
    first = build_index_dir(_cfg(data, index_encoder, out))
    with IndexDirectory.open(out) as d:
        before = _live(d)
    rng = np.random.default_rng(7)
    added = ["ring/new_0.png", "ring/new_1.png", "cross/new_2.png"]
    for p in added:
        draw_shape(p.split("/")[0], rng, 32).save(data / p)
    removed = [info["good"][2], info["good"][5]]
    for p in removed:
        (data / p).unlink()
    modified = info["good"][8]
    draw_shape("checker", rng, 32).save(data / modified)
    st = (data / modified).stat()
    os.utime(data / modified, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    second = build_index_dir(_cfg(data, index_encoder, out))
    assert (second.added, second.removed, second.updated) == (3, 2, 1)
    assert second.unchanged == first.count - 3 and second.embedded == 4
    assert second.count == first.count + 1 and second.generation == "g000002"
    with IndexDirectory.open(out) as d:
        after = _live(d)
        assert sorted(after) == sorted(set(info["good"]) - set(removed) | set(added))
        assert _faiss_ids(d.index) == set(after.values())
        for p in set(before) - set(removed) - {modified}:
            assert after[p] == before[p]  # unchanged files keep their ids
        assert after[modified] != before[modified] and d.record(before[modified]) is None
        assert min(after[p] for p in added + [modified]) >= first.count  # ids are never reused
        import hashlib

        assert d.record(after[modified])["sha256"] == hashlib.sha256((data / modified).read_bytes()).hexdigest()
        for p in removed:
            assert d.record(before[p]) is None

    third = build_index_dir(_cfg(data, index_encoder, out))
    assert third.embedded == 0 and not third.published and third.generation == "g000002"
    assert (third.added, third.removed, third.updated, third.unchanged) == (0, 0, 0, second.count)


def test_index__resume_after_sigkill_equals_uninterrupted_run(shapes_dir, index_encoder, tmp_path):
    killed = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "moco_retrieval",
        "index",
        str(shapes_dir),
        "--model",
        str(index_encoder),
        "--out",
        str(killed),
        "--workers",
        "0",
        "--batch-size",
        "2",
        "--shard-size",
        "2",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list((killed / "work").rglob("shard_*.done"))) >= 3:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "indexing finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (killed / "CURRENT").exists()  # nothing was published

    resumed = build_index_dir(_cfg(shapes_dir, index_encoder, killed))
    assert resumed.resumed >= 6 and resumed.embedded + resumed.resumed == 96
    build_index_dir(_cfg(shapes_dir, index_encoder, tmp_path / "whole"))
    assert not (killed / "work").exists()
    with IndexDirectory.open(killed) as a, IndexDirectory.open(tmp_path / "whole") as b:
        assert _live(a) == _live(b) and a.manifest.count == b.manifest.count == 96
        ids = sorted(_live(a).values())
        va = np.stack([a.index.reconstruct(i) for i in ids])
        vb = np.stack([b.index.reconstruct(i) for i in ids])
        np.testing.assert_allclose(va, vb, atol=1e-5)
        assert [a.record(i) for i in ids] == [b.record(i) for i in ids]


# A `moco index` run SIGKILLed at a chosen point of each phase: the patches run in the child before its main().
_KILL_AT = {
    # the folder was scanned, nothing embedded yet
    "after_scan": "orig = build.scan_folder\nbuild.scan_folder = lambda *a, **k: (orig(*a, **k), die())[0]",
    # two shards finished, the third one being written
    "mid_embedding": "orig, calls = WorkShards.flush, [0]\n"
    "def flush(self):\n"
    "    calls[0] += 1\n"
    "    if calls[0] == 3: die()\n"
    "    orig(self)\n"
    "WorkShards.flush = flush",
    # staging store and vector block committed, the FAISS parts being built (an update adds a delta index)
    "mid_faiss_build": "faiss_index.build_index = update.update_faiss = lambda *a, **k: die()",
    # the generation renamed into place, CURRENT about to be replaced
    "at_publish": "orig = layout.write_text_atomic\n"
    "layout.write_text_atomic = lambda path, text: die() if path.name == 'CURRENT' else orig(path, text)",
}
_KILLED_RUN = """
import os, signal, sys
import moco_retrieval.indexer.build as build
import moco_retrieval.indexer.faiss_index as faiss_index
import moco_retrieval.indexer.layout as layout
import moco_retrieval.indexer.update as update
from moco_retrieval.indexer.shards import WorkShards
def die():
    os.kill(os.getpid(), signal.SIGKILL)
{patch}
from moco_retrieval.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _change_corpus(data: Path) -> None:
    """The update every kill-point run makes: 6 new files, one removed, one rewritten."""
    rng = np.random.default_rng(5)
    for i in range(6):
        draw_shape("ring", rng, 32).save(data / "ring" / f"added_{i}.png")
    sorted(data.rglob("*.png"))[0].unlink()
    changed = sorted(data.rglob("*.png"))[3]
    draw_shape("cross", rng, 32).save(changed)
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.fixture(scope="module")
def small_corpus(shapes_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("small") / "images"
    for path in sorted(shapes_dir.rglob("*.png"))[::8]:  # 12 images, every class
        (root / path.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, root / path.parent.name / path.name)
    for label in ("ring", "cross"):
        (root / label).mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="module")
def uninterrupted_update(small_corpus, index_encoder, tmp_path_factory):
    """The reference: the first build and the update, neither interrupted."""
    work = tmp_path_factory.mktemp("reference")
    data = work / "images"
    shutil.copytree(small_corpus, data)
    build_index_dir(_cfg(data, index_encoder, work / "index", shard_size=2))
    _change_corpus(data)
    build_index_dir(_cfg(data, index_encoder, work / "index", shard_size=2))
    return work / "index"


@pytest.mark.parametrize("phase", sorted(_KILL_AT))
def test_index__sigkill_at_each_phase_of_an_update_keeps_the_old_generation_and_recovers(
    phase, small_corpus, index_encoder, uninterrupted_update, tmp_path
):
    data, out = tmp_path / "images", tmp_path / "index"
    shutil.copytree(small_corpus, data)
    build_index_dir(_cfg(data, index_encoder, out, shard_size=2))
    _change_corpus(data)
    cmd = [
        sys.executable,
        "-c",
        _KILLED_RUN.format(patch=_KILL_AT[phase]),
        "index",
        str(data),
        "--model",
        str(index_encoder),
        "--out",
        str(out),
        "--workers",
        "0",
        "--batch-size",
        "2",
        "--shard-size",
        "2",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = {p.name for p in (out / "generations").iterdir()}
    done = len(list((out / "work").rglob("shard_*.done")))  # finished work shards (work/<model>/)
    assert {  # it died where it was meant to
        "after_scan": done == 0 and left == {"g000001"},
        "mid_embedding": done == 2 and left == {"g000001"},
        "mid_faiss_build": done == 4 and any(n.startswith(".tmp-") for n in left),
        "at_publish": done == 4 and left == {"g000001", "g000002"},
    }[phase], (done, left)
    assert current_generation(out) == "g000001"  # the old generation is still the live one, and whole
    with IndexDirectory.open(out) as d:
        assert _faiss_ids(d.index) == set(_live(d).values()) and d.index.ntotal == d.manifest.count

    recovered = build_index_dir(_cfg(data, index_encoder, out, shard_size=2))
    assert recovered.published and recovered.generation == "g000002"
    if phase in ("mid_faiss_build", "at_publish"):
        assert recovered.resumed == 7 and recovered.embedded == 0  # the finished shards were kept
    generations = sorted(p.name for p in (out / "generations").iterdir())
    assert generations == ["g000001", "g000002"] and not (out / "work").exists()  # no staging, no orphans
    with IndexDirectory.open(out) as got, IndexDirectory.open(uninterrupted_update) as want:
        assert _faiss_ids(got.index) == set(_live(got).values())
        assert _live(got) == _live(want)
        blocks = {p.name.split(".")[0] for p in (out / "vectors").iterdir()}
        assert blocks == set(got.manifest.vector_blocks)  # no vector block that no manifest lists
        ids = sorted(_live(got).values())
        np.testing.assert_allclose(
            np.stack([got.index.reconstruct(i) for i in ids]),
            np.stack([want.index.reconstruct(i) for i in ids]),
            atol=1e-5,
        )


def test_index__a_model_changed_while_embedding_is_refused_at_commit_and_nothing_is_published(
    corpus, index_encoder, other_encoder, tmp_path, monkeypatch
):
    # the commit copies --model into the generation on a thread of its own and checks it against the sha256
    # the run embedded with; its error comes out of the build, the staging folder goes, the shards stay
    import moco_retrieval.indexer.build as build

    data, _ = corpus
    model = tmp_path / "model.onnx"
    shutil.copyfile(index_encoder, model)
    embed_share = build._embed_share

    def embed_then_swap(run):
        embed_share(run)
        shutil.copyfile(other_encoder, model)  # the user replaces the file while the run still uses it

    monkeypatch.setattr(build, "_embed_share", embed_then_swap)
    out = tmp_path / "idx"
    with pytest.raises(ArtifactError, match="changed while this run embedded with it"):
        build_index_dir(_cfg(data, model, out))
    assert not (out / "CURRENT").exists() and not list((out / "generations").glob("*"))
    assert list((out / "work").rglob("shard_*.done"))  # the embedding is kept for the rerun


def test_index__other_model_is_refused_and_rebuild_starts_over(built, corpus, index_encoder, other_encoder, tmp_path):
    data, info = corpus
    out = tmp_path / "idx"
    first = build_index_dir(_cfg(data, index_encoder, out))
    with pytest.raises(ArtifactError, match="another model.*--rebuild"):
        build_index_dir(_cfg(data, other_encoder, out))
    assert current_generation(out) == "g000001"
    rebuilt = build_index_dir(_cfg(data, other_encoder, out, rebuild=True))
    assert rebuilt.added == first.count and rebuilt.embedded == first.count + len(info["bad"])  # bad ones retried
    with IndexDirectory.open(out) as d:
        assert d.manifest.model_sha256 == OnnxEncoder(other_encoder, device="cpu").sha256
        assert d.encoder_path.read_bytes() == Path(other_encoder).read_bytes()
        assert min(_live(d).values()) >= first.count  # new ids, old ones are not reused


def test_index__reader_of_old_generation_stays_valid_after_publish(corpus, index_encoder, tmp_path):
    src, info = corpus
    data = tmp_path / "images"
    shutil.copytree(src, data)
    out = tmp_path / "idx"
    build_index_dir(_cfg(data, index_encoder, out))
    old = IndexDirectory.open(out)
    gone = info["good"][0]
    gone_id = old.id_of_path(gone)
    (data / gone).unlink()
    build_index_dir(_cfg(data, index_encoder, out))
    assert current_generation(out) == "g000002"
    assert old.record(gone_id)["path"] == gone and old.index.ntotal == old.manifest.count
    with IndexDirectory.open(out) as new:
        assert new.record(gone_id) is None and new.index.ntotal == old.index.ntotal - 1
    old.close()


def _cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moco_retrieval", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_index_cli__builds_and_prints_summary_and_skipped(corpus, index_encoder, tmp_path):
    data, info = corpus
    proc = _cli("index", data, "--model", index_encoder, "--out", tmp_path / "idx", "--workers", "0", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert f"images in index       {len(info['good'])}" in proc.stdout
    for bad in info["bad"]:
        assert bad in proc.stdout


@pytest.mark.parametrize("case", ["missing", "empty", "only_bad_files", "out_is_file", "not_encoder"])
def test_index_cli__one_line_errors(case, index_encoder, corpus, tmp_path):
    data, model, out = corpus[0], index_encoder, tmp_path / "idx"
    if case == "missing":
        data = tmp_path / "nope"
    elif case == "empty":
        data = tmp_path / "empty"
        data.mkdir()
    elif case == "only_bad_files":
        data = tmp_path / "bad"
        data.mkdir()
        (data / "a.png").write_bytes(b"")
    elif case == "out_is_file":
        out = tmp_path / "file"
        out.write_text("x")
    else:
        model = tmp_path / "fake.onnx"
        model.write_bytes(b"not onnx")
    proc = _cli("index", data, "--model", model, "--out", out, "--workers", "0", "--no-progress")
    expected = {"missing": 3, "empty": 3, "only_bad_files": 3, "out_is_file": 5, "not_encoder": 4}[case]
    assert proc.returncode == expected, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moco: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr


def test_index__second_writer_is_refused_while_one_runs(corpus, index_encoder, tmp_path):
    import fcntl

    out = tmp_path / "idx"
    out.mkdir()
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ArtifactError, match="another `moco index` is writing"):
            build_index_dir(_cfg(corpus[0], index_encoder, out))


def test_index_cli__missing_model_or_folder_fails_before_anything_is_created(corpus, index_encoder, tmp_path):
    data, _ = corpus
    for args, code, words in (
        ((data, "--model", tmp_path / "missing.onnx"), 4, "missing.onnx"),
        ((tmp_path / "no-images", "--model", index_encoder), 3, "image folder not found"),
    ):
        out = tmp_path / "idx"
        proc = _cli("index", *args, "--out", out, "--workers", "0", "--no-progress")
        assert proc.returncode == code, proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not out.exists()  # no empty folder, no .lock left behind


def test_index__keeps_its_own_copy_of_the_model(corpus, index_encoder, other_encoder, tmp_path):
    data, _ = corpus
    model, out = tmp_path / "enc.onnx", tmp_path / "index"
    shutil.copyfile(index_encoder, model)
    build_index_dir(_cfg(data, model, out))
    with open(model, "r+b") as f:  # `cp other.onnx enc.onnx` rewrites the same inode
        f.write(Path(other_encoder).read_bytes())
        f.truncate()
    with IndexDirectory.open(out) as d:
        assert file_sha256(d.encoder_path) == d.manifest.model_sha256 == file_sha256(index_encoder)


def test_index__a_moved_folder_is_reattached_keeping_ids_and_vectors(corpus, index_encoder, tmp_path):
    data, moved, out = tmp_path / "photos", tmp_path / "photos2", tmp_path / "index"
    shutil.copytree(corpus[0], data)
    build_index_dir(_cfg(data, index_encoder, out))
    with IndexDirectory.open(out) as d:
        before = _live(d)
    data.rename(moved)  # mtimes kept, as `mv` keeps them
    with pytest.raises(ArtifactError, match="--reattach"):
        build_index_dir(_cfg(moved, index_encoder, out))
    result = build_index_dir(_cfg(moved, index_encoder, out, reattach=True))
    assert result.published and result.embedded == 0 and result.reattached == str(data)
    assert (result.added, result.updated, result.removed) == (0, 0, 0)
    with IndexDirectory.open(out) as d:
        assert _live(d) == before and d.manifest.image_root == str(moved)
        some = next(iter(before.values()))
        assert d.image_path(some).is_file() and str(d.image_path(some)).startswith(str(moved))
    again = build_index_dir(_cfg(moved, index_encoder, out, reattach=True))
    assert not again.published and again.mode == "unchanged"  # the same command again changes nothing


def test_index__counts_the_files_it_passes_over_by_extension(built):
    out, result = built
    assert result.not_images == {".txt": 1}  # square/readme.txt; .hidden.png is hidden, not counted
    assert json.loads((out / "report.json").read_text())["not_images"] == {".txt": 1}


def test_index__a_full_build_starts_the_decoders_server_before_its_scan(corpus, index_encoder, tmp_path, monkeypatch):
    # it boots on another core while this process scans and opens the encoder; an update (which may embed
    # nothing) and --workers 0 (no decode processes) do not start it
    from moco_retrieval.indexer import build, decode

    data, _ = corpus
    calls: list[str] = []
    monkeypatch.setattr(build, "start_decoder_server", lambda: calls.append("server") or decode.start_decoder_server())
    scan = build.scan_folder
    monkeypatch.setattr(build, "scan_folder", lambda *a, **k: calls.append("scan") or scan(*a, **k))
    out = tmp_path / "idx"
    build_index_dir(_cfg(data, index_encoder, out, workers=1))
    assert calls == ["server", "scan"]
    calls.clear()
    build_index_dir(_cfg(data, index_encoder, out, workers=1))  # an update of the same folder
    build_index_dir(_cfg(data, index_encoder, tmp_path / "idx0", workers=0))
    assert calls == ["scan", "scan"]
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None and os.waitpid(server, os.WNOHANG) == (0, 0)  # running, reused by each pool
