"""Training faults (issue 18): a second ``moco train`` on one run directory, temporary files a killed
checkpoint write left, and full disks while writing a checkpoint or an export. Each is one line with its exit
code, and the run directory keeps what was done: the identical command resumes."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from moco_retrieval.app.cli import main
from moco_retrieval.contracts import atomic
from moco_retrieval.contracts.errors import ArtifactError, OutputError
from moco_retrieval.contracts.locks import directory_lock
from moco_retrieval.trainer.checkpoint import load_checkpoint, save_atomic, write_random_init_checkpoint
from moco_retrieval.trainer.demo_data import write_demo_dataset
from moco_retrieval.trainer.run_dir import RunDirLock
from tests.conftest import tiny_train_config
from tests.test_index_damage import _unshare_prefix, check_one_line

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """16 images: 2 steps an epoch at batch 8."""
    return write_demo_dataset(
        tmp_path_factory.mktemp("small") / "data", per_class=4, size=32, classes=("circle", "square", "star", "ring")
    )


def _argv(data: Path, out: Path, epochs: int) -> list[str]:
    return [
        "train",
        str(data),
        "--out",
        str(out),
        "--arch",
        "resnet18",
        "--stem",
        "imagenet",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--queue-size",
        "8",
        "--epochs",
        str(epochs),
        "--workers",
        "0",
        "--device",
        "cpu",
        "--knn-every",
        "0",
        "--log-every",
        "1",
        "--no-amp",
    ]


def _temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# -- one writer per run directory -----------------------------------------------------------------------------
def test_train__a_second_process_on_the_same_out_is_refused_in_one_line(small_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()  # a rerun's directory: the first process locks it before it scans
    argv = [sys.executable, "-m", "moco_retrieval"] + _argv(small_dir, run, 1000)
    first = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in first.stderr:  # the cache's line comes after the lock is taken
            if "image cache" in line:
                break
        else:
            pytest.fail(f"the first run ended with {first.wait()}")
        second = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 4, second.stderr[-2000:]
    assert second.stderr.strip() == f"moco: error: another `moco train` is writing {run}; wait for it to finish"


def test_train__refused_while_another_holds_the_lock_and_writes_nothing(small_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with directory_lock(run, "moco train"):
        assert main(_argv(small_dir, run, 1)) == 4
    assert "another `moco train` is writing" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def test_run_dir_lock__is_taken_once_and_released_at_the_end(tmp_path):
    with RunDirLock(tmp_path) as lock:
        lock.acquire()
        lock.acquire()  # held: nothing to do
        with pytest.raises(ArtifactError, match="another `moco train` is writing"):
            with directory_lock(tmp_path, "moco train"):
                pass
    with directory_lock(tmp_path, "moco train"):  # released
        pass


def test_run_dir_lock__only_rank_0_holds_it_and_every_rank_hears_the_refusal(tmp_path, monkeypatch):
    from moco_retrieval.trainer import run_dir

    monkeypatch.setattr(run_dir.dist, "rank", lambda: 1)
    with directory_lock(tmp_path, "moco train"), RunDirLock(tmp_path) as lock:
        lock.acquire()  # rank 1 takes nothing, so rank 0's lock does not refuse it
        assert not lock.held
        monkeypatch.setattr(run_dir.dist, "broadcast_object", lambda obj: "another `moco train` is writing X; wait")
        with pytest.raises(ArtifactError, match="another `moco train` is writing X"):
            lock.acquire_if_present()  # what rank 0 found, broadcast


# -- temporary files of killed writes ---------------------------------------------------------------------------
def test_run_dir_lock__removes_the_temporary_files_killed_writes_left_and_only_those(tmp_path, caplog):
    (tmp_path / "checkpoint_last.pt").write_bytes(b"the intact checkpoint")
    fd, name = tempfile.mkstemp(dir=tmp_path, prefix=".checkpoint_last.pt.", suffix=".tmp")  # as atomic_path
    os.close(fd)
    stale = [Path(name)]
    stale[0].write_bytes(b"x" * 100_000)
    stale += [
        tmp_path / ".checkpoint_0003.pt.a1b2c3d4.tmp",
        tmp_path / ".metrics.png.zz_9yy8x.tmp",
        tmp_path / ".config.json.abcdefgh.tmp",
    ]
    for path in stale[1:]:
        path.write_bytes(b"x")
    others = [
        tmp_path / ".encoder.onnx.abcdefgh.tmp",  # an export writing into the run directory meanwhile
        tmp_path / "notes.tmp",
        tmp_path / ".checkpoint_last.pt.short.tmp",
    ]
    for path in others:
        path.write_bytes(b"y")
    with caplog.at_level("WARNING"), RunDirLock(tmp_path) as lock:
        lock.acquire()
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in others)
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == b"the intact checkpoint"
    assert "removed 4 temporary files (0.1 MB) that a killed run left" in caplog.text


# -- metrics.jsonl after a kill -----------------------------------------------------------------------------------
def _steps(run: Path) -> list[int]:
    return [
        json.loads(line)["step"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in line
    ]


def test_train__a_torn_metrics_line_and_rows_of_a_run_killed_before_its_checkpoint_are_not_kept(small_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "step", "epoch": 0, "step": 1, "loss": 9.0}\n{"kind": "st')
    assert main(_argv(small_dir, run, 1)) == 0  # no checkpoint: a new run, which logs its own rows only
    assert _steps(run) == [1, 2] and '"loss": 9.0' not in (run / "metrics.jsonl").read_text()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "epoch": 1, "ste')  # killed while appending
    assert main(_argv(small_dir, run, 2)) == 0  # resumes from epoch 1
    assert _steps(run) == [1, 2, 3, 4]


# -- full disks ---------------------------------------------------------------------------------------------------
def _full_disk_after(monkeypatch, limit: int, names: str = ".checkpoint_last.pt.") -> None:
    """Atomic writes of ``names*`` get ENOSPC once ``limit`` bytes are written (in atomic's ``open``)."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += len(data)
            if self.n > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if Path(path).name.startswith(names) else f

    monkeypatch.setattr(atomic, "open", fake_open, raising=False)


def test_save_atomic__disk_full_is_one_output_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "checkpoint_last.pt"
    save_atomic({"step": 1, "w": torch.zeros(10)}, path)
    _full_disk_after(monkeypatch, 1000)
    with pytest.raises(
        OutputError,
        match=r"^disk full while writing .*checkpoint_last\.pt; free some space "
        r"\([\d,.]+ MB free there\) and rerun the same command",
    ):
        save_atomic({"step": 2, "w": torch.zeros(100_000)}, path)
    assert torch.load(path, weights_only=True)["step"] == 1 and _temp_files(tmp_path) == []


def test_train__disk_full_at_a_checkpoint_is_one_line_and_the_same_command_resumes(
    small_dir, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    assert main(_argv(small_dir, run, 1)) == 0
    capsys.readouterr()
    _full_disk_after(monkeypatch, 1 << 20)
    assert main(_argv(small_dir, run, 2)) == 5
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("moco: error:")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert f"disk full while writing {run / 'checkpoint_last.pt'}; free some space (" in errors[0]
    assert load_checkpoint(run)["epoch"] == 1 and _temp_files(run) == []
    monkeypatch.undo()
    assert main(_argv(small_dir, run, 2)) == 0
    assert load_checkpoint(run)["epoch"] == 2 and load_checkpoint(run)["step"] == 4
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "step"' in line]
    assert len(steps) == 4  # the steps after the kept checkpoint were logged once


def test_export__disk_full_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    import onnx

    run = write_random_init_checkpoint(tiny_train_config(tmp_path / "data", tmp_path / "run"), tmp_path / "run")
    out = tmp_path / "out" / "encoder.onnx"
    real_save = onnx.save

    def full(model, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx, "save", full)
    assert main(["export", str(run), "--out", str(out)]) == 5
    err = capsys.readouterr().err
    assert err.startswith(f"moco: error: disk full while writing {out}; free some space (") and err.count("\n") == 1
    assert list(out.parent.iterdir()) == []
    monkeypatch.setattr(onnx, "save", real_save)


@pytest.mark.slow  # two training processes: ~40 s on 2 busy cores
def test_disk_full__a_small_tmpfs_for_a_checkpoint_and_an_export_gives_one_line(small_dir, tmp_path):
    """The real thing where a mount namespace is allowed. A run of one epoch (a 138 MB ResNet-18 checkpoint) is
    continued on a 200 MB tmpfs: the second epoch's checkpoint does not fit. Its encoder (45 MB) is exported
    to a 24 MB one. Each is exit 5 and one line naming the file and the free space, with no temporary file
    left and the previous checkpoint byte for byte; with room made, the same command finishes the run."""
    prefix = _unshare_prefix()
    if prefix is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no mount namespace can be made for a small tmpfs (unshare --mount)")
        pytest.skip("no mount namespace here for a small tmpfs; the ENOSPC injection tests above cover the writers")
    source = tmp_path / "source"
    assert main(_argv(small_dir, source, 1)) == 0
    disk, small = tmp_path / "disk", tmp_path / "small"
    disk.mkdir()
    small.mkdir()
    moco = [sys.executable, "-m", "moco_retrieval"]
    train = shlex.join(moco + _argv(small_dir, disk / "run", 2))
    export = shlex.join(moco + ["export", str(source), "--out", str(small / "encoder.onnx")])
    w, source_q = shlex.quote(str(tmp_path)), shlex.quote(str(source))
    disk_q, small_q = shlex.quote(str(disk)), shlex.quote(str(small))
    script = (
        f"mount -t tmpfs -o size=200m tmpfs {disk_q} && mount -t tmpfs -o size=24m tmpfs {small_q} || exit 99; "
        f"cp -a {source_q} {disk_q}/run && sha256sum {disk_q}/run/checkpoint_last.pt >{w}/before; "
        f"{train} 2>{w}/train; echo $? >{w}/train.rc; sha256sum {disk_q}/run/checkpoint_last.pt >{w}/after; "
        f"{export} 2>{w}/export; echo $? >{w}/export.rc; ls -a {disk_q}/run {small_q} >{w}/ls; "
        f"mount -o remount,size=400m {disk_q} && {train} 2>{w}/rerun; echo $? >{w}/rerun.rc; "
        f"ls {disk_q}/run >{w}/ls.after"
    )
    proc = subprocess.run(prefix + ["sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, file in (("train", "checkpoint_last.pt"), ("export", "encoder.onnx")):
        rc, stderr = int((tmp_path / f"{name}.rc").read_text()), (tmp_path / name).read_text()
        assert rc == 5, f"{name}: exit {rc}: {stderr[-2000:]}"
        error = check_one_line(name, {"rc": rc, "stderr": stderr})
        assert "disk full while writing" in error and file in error and "MB free there" in error, error
    assert (tmp_path / "before").read_text() == (tmp_path / "after").read_text()  # the previous checkpoint
    listing = (tmp_path / "ls").read_text()
    assert ".tmp" not in listing and "encoder.onnx" not in listing
    assert (tmp_path / "rerun.rc").read_text().strip() == "0", (tmp_path / "rerun").read_text()[-2000:]
    assert "checkpoint_0002.pt" in (tmp_path / "ls.after").read_text()
