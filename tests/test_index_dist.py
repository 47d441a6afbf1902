"""``moco index`` over several processes: real ``torchrun`` launches (and hand-launched ranks with RANK /
WORLD_SIZE, to kill one), the real encoder, FAISS and LMDB. Ranks meet through files in INDEX_DIR/work/."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.ranks import part_of_plan, plan_digest
from tests.index_fixtures import index_encoder  # noqa: F401 (fixture)

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _index_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "index",
        str(data),
        "--model",
        str(model),
        "--out",
        str(out),
        "--workers",
        "0",
        "--device",
        "cpu",
        "--no-progress",
        *extra,
    ]


def _torchrun(args: list[str], ranks: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            "-m",
            "moco_retrieval",
            *args,
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _single(data: Path, model: Path, out: Path, **kw):
    values = dict(workers=0, batch_size=8, progress=False, shard_size=8, device="cpu")
    values.update(kw)
    return build_index_dir(IndexConfig(str(data), str(model), str(out), **values))


def _same_index(a: Path, b: Path) -> None:
    with IndexDirectory.open(a) as x, IndexDirectory.open(b) as y:
        ids = x.index.ids()
        np.testing.assert_array_equal(ids, y.index.ids())
        assert [x.record(i) for i in ids] == [y.record(i) for i in ids]  # same paths get the same ids
        np.testing.assert_allclose(
            np.stack([x.index.reconstruct(i) for i in ids]), np.stack([y.index.reconstruct(i) for i in ids]), atol=1e-5
        )
        assert x.manifest.count == y.manifest.count and x.manifest.labels == y.manifest.labels


def test_part_of_plan__chunks_dealt_round_robin_cover_everything_once():
    entries = list(range(23))
    parts = [part_of_plan(entries, r, 3, chunk=4) for r in range(3)]
    assert parts[0] == [0, 1, 2, 3, 12, 13, 14, 15] and parts[2] == [8, 9, 10, 11, 20, 21, 22]
    assert sorted(sum(parts, [])) == entries
    assert part_of_plan(entries, 0, 1, chunk=4) == entries


def test_index_ranks__two_torchrun_ranks_equal_one_process(shapes_dir, index_encoder, tmp_path):
    proc = _torchrun(_index_args(shapes_dir, index_encoder, tmp_path / "two", "--shard-size", "8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 of 2: embedded" in proc.stdout and "images in index       96" in proc.stdout
    assert re.search(r"^ranks\s+2 \(waited", proc.stdout, re.M)
    _single(shapes_dir, index_encoder, tmp_path / "one")
    _same_index(tmp_path / "two", tmp_path / "one")
    assert not (tmp_path / "two" / "work").exists()
    # an update under torchrun: only rank 0 sees a change to publish
    second = _torchrun(_index_args(shapes_dir, index_encoder, tmp_path / "two", "--shard-size", "8"))
    assert second.returncode == 0 and "unchanged, still live" in second.stdout


def _launch_rank(rank: int, args: list[str]) -> subprocess.Popen:
    env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
    return subprocess.Popen(
        [sys.executable, "-m", "moco_retrieval", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_index_ranks__a_killed_rank_resumes_on_rerun(shapes_dir, index_encoder, tmp_path):
    out = tmp_path / "killed"
    args = _index_args(shapes_dir, index_encoder, out, "--shard-size", "2", "--batch-size", "2", "--rank-timeout", "3")
    rank0, rank1 = _launch_rank(0, args), _launch_rank(1, args)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and rank1.poll() is None:
            if len(list(out.glob("work/*/shard_001_*.done"))) >= 2:
                break
            time.sleep(0.005)
        assert rank1.poll() is None, "rank 1 finished before it could be killed"
        rank1.send_signal(signal.SIGKILL)
        _, err = rank0.communicate(timeout=120)
    finally:
        for proc in (rank0, rank1):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert rank0.returncode == 7, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("moco: error:")]
    assert len(errors) == 1 and "rank 1 of 2 made no progress" in errors[0] and "rerun" in errors[0]
    assert not (out / "CURRENT").exists()  # nothing was published
    finished = len(list(out.glob("work/*/shard_001_*.done")))

    proc = _torchrun(_index_args(shapes_dir, index_encoder, out, "--shard-size", "2", "--batch-size", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [line for line in proc.stdout.splitlines() if line.startswith("rank 1 of 2")]
    assert resumed and f"(+{2 * finished} resumed)" in resumed[0]
    _single(shapes_dir, index_encoder, tmp_path / "whole")
    _same_index(out, tmp_path / "whole")


def test_rendezvous__a_stale_marker_of_the_same_work_counts(tmp_path):
    from moco_retrieval.contracts.launch import WorldInfo
    from moco_retrieval.indexer.ranks import Rendezvous
    from moco_retrieval.contracts.images import FoundFile

    entries = [FoundFile(f"{i}.png", None, i, i) for i in range(10)]
    peer = Rendezvous(tmp_path, WorldInfo(1, 1, 2, 2))
    peer.mark_done(plan_digest(part_of_plan(entries, 1, 2, 3)), 4)
    rank0 = Rendezvous(tmp_path, WorldInfo(0, 0, 2, 2), timeout_s=0.5)
    rank0.wait_for_peers({1: plan_digest(part_of_plan(entries, 1, 2, 3))})  # returns at once
    from moco_retrieval.contracts.errors import IndexBuildError

    with pytest.raises(IndexBuildError, match="rank 1 of 2 made no progress"):
        rank0.wait_for_peers({1: plan_digest(part_of_plan(entries[:-1], 1, 2, 3))})  # other work: waits, gives up
