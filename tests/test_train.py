"""The training loop end to end on CPU: bad inputs, unreadable files, checkpoints and exact resume."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from moco_retrieval.app.cli import main
from moco_retrieval.contracts.errors import ArtifactError
from tests.conftest import ctrl_c_reaches_it, tiny_train_config
from moco_retrieval.trainer.checkpoint import load_checkpoint
from moco_retrieval.trainer.demo_data import write_demo_dataset
from moco_retrieval.trainer.train import train


def _cli(*args: str) -> list[str]:
    return [
        "train",
        *args,
        "--arch",
        "resnet18",
        "--image-size",
        "32",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--knn-every",
        "0",
    ]


def test_train__missing_folder_is_one_line_error_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(_cli(str(tmp_path / "nope"), "--out", str(out), "--batch-size", "16", "--queue-size", "64"))
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "image folder not found" in err
    assert not out.exists()


def test_train__empty_folder_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not an image")
    code = main(
        _cli(str(tmp_path / "empty"), "--out", str(tmp_path / "run"), "--batch-size", "16", "--queue-size", "64")
    )
    assert code == 3 and "no readable images" in capsys.readouterr().err


def test_train__fewer_images_than_a_batch_is_refused(shapes_dir, tmp_path, capsys):
    code = main(_cli(str(shapes_dir), "--out", str(tmp_path / "run"), "--batch-size", "128", "--queue-size", "256"))
    err = capsys.readouterr().err
    assert code == 3 and "fewer than one batch (128)" in err
    assert not (tmp_path / "run").exists()


def test_train__queue_not_multiple_of_batch_is_refused(shapes_dir, tmp_path, capsys):
    code = main(_cli(str(shapes_dir), "--out", str(tmp_path / "run"), "--batch-size", "16", "--queue-size", "100"))
    err = capsys.readouterr().err
    assert code == 2 and "--queue-size 100 is not a multiple of the global --batch-size 16" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_smallest_strided_map__resnet18_reads_1x1_up_to_16_px_with_the_imagenet_stem():
    from moco_retrieval.trainer.backbones import build_resnet, smallest_strided_map

    imagenet, _ = build_resnet("resnet18", "imagenet")
    small, _ = build_resnet("resnet18", "small")
    assert [smallest_strided_map(imagenet, s) for s in (16, 17, 32, 33)] == [1, 2, 2, 3]
    assert smallest_strided_map(small, 8) == 2  # the small stem keeps 8x the map: never 1x1 at our sizes
    assert imagenet.training  # the probe leaves the mode as it found it


def test_train__amp_on_a_cpu_where_a_strided_convolution_reads_1x1_is_refused_before_the_run_directory(
    shapes_dir, tmp_path, capsys
):
    """bf16 on the CPU (oneDNN) returns garbage weight gradients for a padded, strided convolution of a 1x1 map
    (measured: up to 1e38, now and then); MoCo v2 with --amp --small-crops 2 (16 px) ended with a NaN loss."""
    out = tmp_path / "run"
    argv = ["train", str(shapes_dir), "--out", str(out), "--amp", "--device", "cpu", "--batch-size", "16"]
    assert main([*argv, "--queue-size", "32", "--small-crops", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "at 16 px a strided convolution of resnet18 reads a 1x1 map" in err, err
    assert "at 17 px and more" in err and not out.exists()


def test_train__cuda_without_gpu_is_refused(shapes_dir, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "train",
            str(shapes_dir),
            "--out",
            str(tmp_path / "run"),
            "--device",
            "cuda",
            "--batch-size",
            "16",
            "--queue-size",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "moco: error: --device cuda requested but no CUDA GPU is usable here; use --device cpu"
    )
    assert not (tmp_path / "run").exists()


def test_train__unwritable_run_dir_is_refused(shapes_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code = main(_cli(str(shapes_dir), "--out", str(blocker / "run"), "--batch-size", "16", "--queue-size", "64"))
    err = capsys.readouterr().err
    assert code == 5 and "cannot write to run directory" in err and err.count("\n") == 1


def test_train__skips_unreadable_files_and_lists_them(tmp_path):
    data = write_demo_dataset(tmp_path / "data", per_class=4, size=32, classes=("circle", "square", "star", "ring"))
    (data / "circle" / "empty.jpg").write_bytes(b"")
    (data / "square" / "text.jpg").write_text("this is not a jpeg")
    good = (data / "star" / "star_00000.png").read_bytes()
    (data / "star" / "truncated.png").write_bytes(good[: len(good) // 2])
    result = train(tiny_train_config(data, tmp_path / "run", epochs=1, batch_size=8, queue_size=8))
    assert result.images == 16 and result.skipped == 3 and result.epochs_done == 1
    listed = (tmp_path / "run" / "skipped_files.txt").read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == [
        "circle/empty.jpg",
        "square/text.jpg",
        "star/truncated.png",
    ]


def test_train__writes_run_directory_artifacts(shapes_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny_train_config(shapes_dir, run, epochs=2, save_every=1, knn_every=1))
    names = {p.name for p in run.iterdir()}
    assert {
        "config.json",
        "checkpoint_last.pt",
        "checkpoint_0001.pt",
        "checkpoint_0002.pt",
        "metrics.jsonl",
        "metrics.png",
        "skipped_files.txt",
    } <= names
    assert not [n for n in names if ".tmp" in n]
    assert json.loads((run / "config.json").read_text())["arch"] == "resnet18"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2] and all(0 <= r["knn_acc"] <= 1 for r in epochs)
    assert all(r["knn_acc_whitened"] is None for r in epochs)  # 96 bank images: too few to fit a whitening
    assert len([r for r in rows if r["kind"] == "step"]) == 2 * (96 // 16)
    ckpt = load_checkpoint(run)
    assert ckpt["epoch"] == 2 and ckpt["step"] == 12 and "queue" in ckpt["model"] and "optimizer" in ckpt


def test_train__resume_gives_same_parameters_as_straight_run(shapes_dir, tmp_path):
    straight = train(tiny_train_config(shapes_dir, tmp_path / "straight", epochs=2))
    first = train(tiny_train_config(shapes_dir, tmp_path / "resumed", epochs=2), stop_at_epoch=1)
    assert first.epochs_done == 1 and load_checkpoint(tmp_path / "resumed")["step"] == 6
    resumed = train(tiny_train_config(shapes_dir, tmp_path / "resumed", epochs=2))  # picks up checkpoint_last.pt
    assert straight.steps == resumed.steps == 12
    a = load_checkpoint(tmp_path / "straight")
    b = load_checkpoint(tmp_path / "resumed")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert (
        a["config"]["run_id"] != ""
        and b["config"]["run_id"] == json.loads((tmp_path / "resumed" / "config.json").read_text())["run_id"]
    )


def test_train__small_crops_resume_exactly_and_a_changed_count_is_refused(shapes_dir, tmp_path):
    """Multi-crop's crops are drawn from each step's seeded generator, so a resumed run equals a straight one;
    their number is part of the objective, so a rerun with another is refused."""
    straight = train(tiny_train_config(shapes_dir, tmp_path / "straight", epochs=2, small_crops=2))
    train(tiny_train_config(shapes_dir, tmp_path / "resumed", epochs=2, small_crops=2), stop_at_epoch=1)
    resumed = train(tiny_train_config(shapes_dir, tmp_path / "resumed", epochs=2, small_crops=2))
    assert straight.steps == resumed.steps == 12
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["config"]["small_crops"] == 2
    with pytest.raises(Exception, match=r"was trained with small_crops=2 \(now 4\)"):
        train(tiny_train_config(shapes_dir, tmp_path / "resumed", epochs=3, small_crops=4))


def test_train__symmetric_trains_records_itself_and_a_rerun_without_it_is_refused(shapes_dir, tmp_path):
    """--symmetric is part of the objective: the run trains with it, config.json keeps it, and the same --out
    without it is refused rather than resumed as another loss."""
    result = train(tiny_train_config(shapes_dir, tmp_path / "run", epochs=2, symmetric=True), stop_at_epoch=1)
    assert result.steps == 6 and result.loss is not None and math.isfinite(result.loss)
    assert load_checkpoint(tmp_path / "run")["config"]["symmetric"] is True
    assert json.loads((tmp_path / "run" / "config.json").read_text())["symmetric"] is True
    with pytest.raises(Exception, match=r"was trained with symmetric=True \(now False\)"):
        train(tiny_train_config(shapes_dir, tmp_path / "run", epochs=2))


def test_train__resume_with_different_architecture_is_refused(shapes_dir, tmp_path):
    """The refusal says how to resume; --init cannot change the architecture, so it is not offered."""
    train(tiny_train_config(shapes_dir, tmp_path / "run", epochs=2), stop_at_epoch=1)
    with pytest.raises(Exception, match="was trained with arch='resnet18'") as refused:
        train(tiny_train_config(shapes_dir, tmp_path / "run", epochs=2, arch="resnet34"))
    assert str(refused.value).endswith("rerun with the same options to resume it, or use a new --out")
    with pytest.raises(Exception, match="was trained with arch='resnet18'") as refused:  # --resume into another --out
        train(tiny_train_config(shapes_dir, tmp_path / "other", epochs=2, arch="resnet34"), resume=tmp_path / "run")
    assert str(refused.value).endswith("resume it with the options it was trained with")


def test_train__rerun_of_the_same_command_resumes_when_the_recipe_capped_its_queue(shapes_dir, tmp_path):
    """An explicit --queue-size above half the images is capped by the recipe (64 -> 48 of 96 images); the
    checkpoint held 48, so the identical rerun, still asking for 64, used to be refused as a changed option."""
    cfg = tiny_train_config(shapes_dir, tmp_path / "run", epochs=2, queue_size=64)
    first = train(cfg, stop_at_epoch=1)
    saved = load_checkpoint(tmp_path / "run")["config"]
    assert first.steps == 6 and saved["queue_size"] == 48
    resumed = train(cfg)
    assert resumed.steps == 12 and load_checkpoint(tmp_path / "run")["config"]["queue_size"] == 48
    with pytest.raises(Exception, match=r"was trained with queue_size=48 \(now 80\)") as refused:  # another still is
        train(cfg.replace(queue_size=80))
    # a change of training, not of the model: the weights can go on in a new run (a longer --time-budget too)
    hint = f"or train on from its weights in a new run: --init {tmp_path / 'run'} --out NEW_DIR"
    assert str(refused.value).endswith(hint)


def test_train__resume_after_images_were_removed_below_its_queue_is_a_data_error(tmp_path):
    """96 images cap the recipe's queue at 48; with 76 left the recipe would cap it at 32, which the
    checkpoint's model cannot load (it was a size-mismatch traceback)."""
    from moco_retrieval.contracts.errors import DataError

    data = write_demo_dataset(tmp_path / "data", per_class=12, size=32, seed=1)
    cfg = tiny_train_config(data, tmp_path / "run", epochs=2, queue_size=None)
    train(cfg, stop_at_epoch=1)
    for path in sorted(data.glob("*/*.png"))[:20]:
        path.unlink()
    with pytest.raises(DataError, match=r"trained with queue_size=48 \(now 32\), which the 76 readable images"):
        train(cfg)


def test_load_checkpoint__foreign_and_corrupt_files_are_artifact_errors(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "foreign.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"\x00garbage")
    with pytest.raises(ArtifactError, match="not a moco-retrieval checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(ArtifactError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "corrupt.pt")
    with pytest.raises(ArtifactError, match="no checkpoint at"):
        load_checkpoint(tmp_path)


def test_fit_queue_to_data__caps_queue_at_half_the_images():
    from moco_retrieval.contracts.errors import DataError
    from moco_retrieval.trainer.recipes import fit_queue_to_data

    assert fit_queue_to_data(256, 64, 10_000) == (256, None)  # small queue: unchanged
    assert fit_queue_to_data(65536, 64, 1000)[0] == 448  # half of 1000, down to a multiple of 64
    with pytest.raises(DataError, match="too few for MoCo v2"):
        fit_queue_to_data(65536, 64, 100)


def test_train__ctrl_c_saves_mid_epoch_and_rerun_finishes_the_same_schedule(shapes_dir, tmp_path):
    import signal
    import time

    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "moco_retrieval",
        "train",
        str(shapes_dir),
        "--out",
        str(run),
        "--arch",
        "resnet18",
        "--stem",
        "imagenet",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--queue-size",
        "16",
        "--epochs",
        "1",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--knn-every",
        "0",
        "--log-every",
        "1",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until some steps of the 12-step epoch are done, then press Ctrl-C
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; completed work is saved" in err
    ckpt = load_checkpoint(run)
    assert ckpt["epoch"] == 0 and 0 < ckpt["batch_in_epoch"] < 12 and ckpt["step"] == ckpt["batch_in_epoch"]
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    final = load_checkpoint(run)
    assert final["epoch"] == 1 and final["batch_in_epoch"] == 0 and final["step"] == 12  # no batch lost or repeated
    saved_at = re.search(r"interrupted: saved \S+ at (step .*)", err).group(1)
    resumed_at = re.search(r"resuming \S+ at (step .*)", rerun.stderr).group(1)
    assert saved_at == resumed_at == f"step {ckpt['step']} (epoch 1, {ckpt['step']} of 12 batches done)"


def test_position_text__a_finished_epoch_reads_as_the_next_one_with_no_batch_done():
    """The interrupt and the resume say a run's position through this one function (they once differed by an
    epoch for the same checkpoint)."""
    from moco_retrieval.trainer.train import Progress, position_text

    def at(epoch, batch, step):
        return position_text(Progress(None, None, None, {}, epoch=epoch, batch_in_epoch=batch, step=step), 6)

    assert at(5, 0, 30) == at(4, 6, 30) == "step 30 (epoch 6, 0 of 6 batches done)"
    assert at(5, 3, 33) == "step 33 (epoch 6, 3 of 6 batches done)"


def test_train__ctrl_c_between_epochs_keeps_the_finished_epoch(shapes_dir, tmp_path, monkeypatch):
    """A Ctrl-C during an epoch's end (metrics, evaluation, plot) used to lose every step since the last
    checkpoint (checkpoints are written at most once a minute)."""
    import moco_retrieval.trainer.train as train_module

    real_append = train_module._append_jsonl

    def interrupt_at_first_epoch_row(path, row):
        real_append(path, row)
        if row.get("kind") == "epoch" and row.get("epoch") == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_append_jsonl", interrupt_at_first_epoch_row)
    cfg = tiny_train_config(shapes_dir, tmp_path / "run", epochs=3, batch_size=8, queue_size=16)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt["epoch"] == 1 and ckpt["batch_in_epoch"] == 0 and ckpt["step"] == 12


def test_train__numbered_checkpoints_thin_out_past_the_kept_count(shapes_dir, tmp_path, monkeypatch):
    import moco_retrieval.trainer.recipes as recipes

    monkeypatch.setattr(recipes, "SAVE_EVERY_EPOCHS", 1)  # lowered: every epoch, ...
    monkeypatch.setattr(recipes, "KEPT_CHECKPOINTS", 2)  # ... but only about 2 per run
    run = tmp_path / "run"
    train(tiny_train_config(shapes_dir, run, epochs=4, batch_size=32, queue_size=64))
    assert sorted(p.name for p in run.glob("checkpoint_0*.pt")) == ["checkpoint_0002.pt", "checkpoint_0004.pt"]
    assert json.loads((run / "config.json").read_text())["save_every"] == 2


def test_train__save_every_steps_writes_mid_epoch_checkpoints(shapes_dir, tmp_path):
    result = train(
        tiny_train_config(shapes_dir, tmp_path / "run", epochs=2, batch_size=8, queue_size=16, save_every_steps=5),
        stop_at_epoch=1,
    )
    assert result.steps == 12
    ckpt = load_checkpoint(tmp_path / "run")  # epoch end overwrites the mid-epoch one
    assert ckpt["epoch"] == 1 and ckpt["batch_in_epoch"] == 0
    # what a kill after step 10 leaves behind (mid-epoch saves at steps 5 and 10)
    ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["step"] = 0, 10, 10
    torch.save(ckpt, tmp_path / "run" / "checkpoint_last.pt")
    resumed = train(
        tiny_train_config(shapes_dir, tmp_path / "run", epochs=2, batch_size=8, queue_size=16, save_every_steps=5)
    )
    assert resumed.steps == 10 + 2 + 12  # the 2 remaining batches of epoch 1, then epoch 2


class _MakesAFolder:
    """A pickle payload that creates a folder when unpickled (what a crafted checkpoint could do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_load_checkpoint__refuses_a_crafted_file_without_running_it(tmp_path, capsys):
    target = tmp_path / "created-by-unpickling"
    torch.save(
        {"format": "moco-retrieval/checkpoint", "format_version": 2, "payload": _MakesAFolder(target)},
        tmp_path / "evil.pt",
    )
    with pytest.raises(ArtifactError, match="refusing to load it"):
        load_checkpoint(tmp_path / "evil.pt")
    code = main(["export", str(tmp_path / "evil.pt"), "--out", str(tmp_path / "e.onnx")])
    assert code == 4 and "refusing to load it" in capsys.readouterr().err
    assert not target.exists()


def test_load_checkpoint__format_1_checkpoints_with_numpy_rng_state_still_load(tmp_path):
    import random

    import numpy as np

    old = {
        "format": "moco-retrieval/checkpoint",
        "format_version": 1,
        "torch_version": torch.__version__,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    torch.save(old, tmp_path / "old.pt")
    ckpt = load_checkpoint(tmp_path / "old.pt")
    assert ckpt["format_version"] == 1 and ckpt["rng"]["numpy"][0] == "MT19937"
    from moco_retrieval.trainer.checkpoint import set_rng_state

    set_rng_state(ckpt["rng"])  # the old tuple form is still understood


def test_train_summary__counts_epochs_with_their_fraction(tmp_path, capsys):
    from moco_retrieval.app.cmd_train import _print_train_result
    from moco_retrieval.trainer.train import TrainResult

    # a budgeted run of 70,000 images stopped inside its second epoch printed "517 steps (1 epochs, ...)"
    result = TrainResult(tmp_path, 1, 517, 3.5, None, 70_000, 0, stopped_by="time budget", steps_per_epoch=273)
    assert result.epochs_done == 1 and abs(result.epochs_trained - 1.894) < 1e-3
    _print_train_result(result)
    assert "trained 517 steps (1.9 epochs, stopped by time budget) on 70000 images" in capsys.readouterr().out
