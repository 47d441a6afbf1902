"""``moco eval knn`` / ``moco eval linear`` on generated labeled folders: the protocols against hand
computations, real checkpoints and a real exported ONNX encoder, the JSON they write, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from moco_retrieval.app.cli import main
from tests.conftest import tiny_train_config
from moco_retrieval.trainer.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, save_atomic
from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.evaluate import LinearProbeConfig, knn_top1, linear_probe
from moco_retrieval.trainer.train import train
from moco_retrieval.trainer.variants import build_model

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def _colour_folder(root: Path, per_class: int, seed: int) -> Path:
    """Three classes of noisy solid-colour 32 px images: any encoder, even a random one, separates them."""
    rng = np.random.default_rng(seed)
    for name, rgb in COLOURS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(np.array(rgb) + rng.normal(0, 25, size=(32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{name}_{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def colour_split(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("colours")
    return _colour_folder(root / "train", 10, seed=0), _colour_folder(root / "test", 5, seed=1)


def _random_init_checkpoint(path: Path, arch: str, moco_version: int) -> Path:
    """A real checkpoint file of a randomly initialised model (what ``moco train`` saves, minus optimizer state)."""
    cfg = TrainConfig(
        data_dir="-",
        out_dir=str(path.parent),
        arch=arch,
        moco_version=moco_version,
        image_size=32,
        stem="imagenet",
        dim=16,
        mlp_hidden=32,
        run_id="random-init",
    )
    torch.manual_seed(0)
    save_atomic(
        {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "run_id": cfg.run_id,
            "config": cfg.to_dict(),
            "model": build_model(cfg).state_dict(),
            "epoch": 0,
            "step": 0,
        },
        path,
    )
    return path


@pytest.fixture(scope="module")
def trained_run(shapes_dir, tmp_path_factory) -> Path:
    """A real run directory: ResNet-18 MoCo v2, one epoch on the shapes (about 10 s on CPU)."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("eval_run") / "run"
    train(tiny_train_config(shapes_dir, run, epochs=1))
    return run


def test_knn_top1__matches_hand_computed_vote():
    xb = np.array([[1, 0], [0.8, 0.6], [0, 1], [-1, 0]], dtype=np.float32)  # L2-normalised rows
    yb = np.array([0, 1, 1, 0])
    xq = np.array([[0.6, 0.8]], dtype=np.float32)
    # k = 2: neighbours 1 (s = 0.96) and 2 (s = 0.8), both class 1 -> correct for label 1
    # k = 4: class 0 gets exp(0.6/T) + exp(-0.6/T), class 1 gets exp(0.96/T) + exp(0.8/T) -> class 1
    rows = knn_top1(xb, yb, xq, np.array([1]), num_classes=2, ks=(2, 4, 10), temperature=0.07)
    assert [r["top1"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["k_used"] for r in rows] == [2, 4, 4]
    # with T large the vote is nearly a count: k = 4 ties 2-2 and the heavier class 1 still wins; k=1 only sees 1
    rows = knn_top1(xb, yb, xq, np.array([0]), num_classes=2, ks=(1,), temperature=0.07)
    assert rows[0]["top1"] == 0.0


def test_knn_top1__leave_one_out_never_lets_a_sample_vote_for_itself():
    xb = np.array([[1, 0], [0.99, 0.141], [0, 1], [0.141, 0.99]], dtype=np.float32)
    yb = np.array([0, 1, 0, 1])  # each sample's nearest other sample has the other class
    assert knn_top1(xb, yb, xb, yb, num_classes=2, ks=(1,))[0]["top1"] == 1.0  # finds itself: inflated
    rows = knn_top1(xb, yb, xb, yb, num_classes=2, ks=(1, 10), leave_one_out=True)
    assert [r["top1"] for r in rows][0] == 0.0 and [r["k_used"] for r in rows] == [1, 3]


def test_eval_knn__same_train_and_test_folder_is_measured_leave_one_out(colour_split, tmp_path, capsys, caplog):
    ckpt = _random_init_checkpoint(tmp_path / "random.pt", "resnet18", 2)
    folder = colour_split[0]
    with caplog.at_level("WARNING"):
        assert (
            main(
                [
                    "eval",
                    "knn",
                    "--train",
                    str(folder),
                    "--test",
                    str(folder) + "/",
                    str(ckpt),
                    "--out",
                    str(tmp_path / "knn.json"),
                    "--device",
                    "cpu",
                    "--batch-size",
                    "16",
                ]
            )
            == 0
        )
    doc = json.loads((tmp_path / "knn.json").read_text())
    assert doc["same_folder"] and doc["leave_one_out"]
    assert all(r["k_used"] < doc["train_images"] for r in doc["results"])
    assert "leave-one-out" in caplog.text


def test_linear_probe__separable_features_reach_full_accuracy():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 16)) * 3
    yb, yq = np.repeat(np.arange(4), 20), np.repeat(np.arange(4), 10)
    xb = (centres[yb] + rng.normal(size=(80, 16))).astype(np.float32)
    xq = (centres[yq] + rng.normal(size=(40, 16))).astype(np.float32)
    result = linear_probe(xb, yb, xq, yq, 4, LinearProbeConfig(epochs=30, batch_size=16))
    assert result["top1"] == 1.0 and result["train_top1"] == 1.0 and result["epochs"] == 30
    chance = linear_probe(xb, yb, xq, rng.permutation(yq), 4, LinearProbeConfig(epochs=30, batch_size=16))
    assert chance["top1"] < 0.6  # shuffled test labels: the probe cannot be right by construction


@pytest.mark.parametrize("arch, moco_version", [("resnet18", 2), ("vit_tiny", 3)])
def test_eval_knn__random_init_checkpoint_separates_colour_classes(arch, moco_version, colour_split, tmp_path, capsys):
    ckpt = _random_init_checkpoint(tmp_path / "random.pt", arch, moco_version)
    train_dir, test_dir = colour_split
    assert (
        main(
            [
                "eval",
                "knn",
                "--train",
                str(train_dir),
                "--test",
                str(test_dir),
                str(ckpt),
                "--device",
                "cpu",
                "--batch-size",
                "16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "k-NN top-1, k=20, T=0.07" in out and "k=200 (clipped to 30)" in out
    doc = json.loads((tmp_path / "eval_knn.json").read_text())  # default: next to the checkpoint
    assert doc["protocol"] == "knn" and doc["classes"] == ["blue", "green", "red"]
    assert (doc["train_images"], doc["test_images"]) == (30, 15)
    assert doc["model"]["model_kind"] == "checkpoint" and doc["model"]["arch"] == arch
    assert doc["model"]["moco_version"] == moco_version
    by_k = {r["k"]: r for r in doc["results"]}
    assert set(by_k) == {20, 200} and by_k[200]["k_used"] == 30
    assert by_k[20]["top1"] >= 0.9  # noisy solid colours: separable by any encoder, trained or not
    assert f"{100 * by_k[20]['top1']:.2f}%" in out


def test_eval_linear__random_init_checkpoint_writes_json_to_out(colour_split, tmp_path, capsys):
    ckpt = _random_init_checkpoint(tmp_path / "random.pt", "resnet18", 2)
    train_dir, test_dir = colour_split
    out = tmp_path / "results" / "linear.json"
    assert (
        main(
            [
                "eval",
                "linear",
                "--train",
                str(train_dir),
                "--test",
                str(test_dir),
                str(ckpt),
                "--device",
                "cpu",
                "--epochs",
                "30",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "linear probe top-1 (30 epochs)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    (result,) = doc["results"]
    assert result["metric"] == "linear_top1" and result["top1"] >= 0.9 and result["train_top1"] == 1.0


def test_eval__trained_run_directory_writes_json_into_the_run(trained_run, shapes_dir, capsys):
    assert (
        main(
            [
                "eval",
                "linear",
                "--train",
                str(shapes_dir),
                "--test",
                str(shapes_dir),
                str(trained_run),
                "--device",
                "cpu",
                "--epochs",
                "20",
            ]
        )
        == 0
    )
    capsys.readouterr()
    doc = json.loads((trained_run / "eval_linear.json").read_text())
    assert doc["model"]["epoch"] == 1 and doc["train_images"] == doc["test_images"] == 96
    assert 0.0 <= doc["results"][0]["top1"] <= 1.0 and len(doc["classes"]) == 8


def test_eval_knn__onnx_encoder_agrees_with_its_checkpoint(trained_run, colour_split, tmp_path, capsys):
    from moco_retrieval.trainer.export import export_encoder

    onnx_path = tmp_path / "encoder.onnx"
    export_encoder(trained_run, onnx_path)
    train_dir, test_dir = colour_split
    common = ["--train", str(train_dir), "--test", str(test_dir), "--device", "cpu", "--k", "5"]
    assert main(["eval", "knn", *common, str(onnx_path)]) == 0
    assert main(["eval", "knn", *common, str(trained_run), "--out", str(tmp_path / "ckpt.json")]) == 0
    capsys.readouterr()
    from_onnx = json.loads((tmp_path / "eval_knn.json").read_text())  # default: next to the ONNX file
    from_ckpt = json.loads((tmp_path / "ckpt.json").read_text())
    assert from_onnx["model"]["model_kind"] == "onnx" and from_onnx["model"]["arch"] == "resnet18"
    assert abs(from_onnx["results"][0]["top1"] - from_ckpt["results"][0]["top1"]) <= 1 / 15 + 1e-9  # one image
    # the features themselves agree: the ONNX path preprocesses and embeds as the checkpoint path does
    from moco_retrieval.app.cmd_eval import open_model

    paths = [str(p) for p in sorted(train_dir.rglob("*.png"))[:6]]
    onnx_x = open_model(str(onnx_path), "cpu", 16, 0).embed_images(paths)
    ckpt_x = open_model(str(trained_run), "cpu", 16, 0).embed_images(paths)
    assert onnx_x.shape == ckpt_x.shape == (6, 512)
    assert np.abs(onnx_x - ckpt_x).max() < 1e-3


def test_eval__unlabeled_or_missing_folders_are_one_line_errors(trained_run, colour_split, tmp_path, capsys):
    train_dir, _ = colour_split
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (32, 32)).save(flat / "a.png")
    assert main(["eval", "knn", "--train", str(train_dir), "--test", str(flat), str(trained_run)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--test folder" in err and "class subfolders" in err
    assert main(["eval", "knn", "--train", str(train_dir), "--test", str(train_dir), str(tmp_path / "nope")]) == 4
    assert "no checkpoint at" in capsys.readouterr().err


def test_eval_knn_pixels__raw_pixel_rows_the_margin_and_leave_one_out(colour_split, tmp_path, capsys):
    """``--pixels`` adds plain L2 k-NN on the model's input crops (k = 1, 5, 20), equal to a numpy vote on the
    PNGs themselves (32 px files at a 32 px model: the crop is the file), and the model's margin over them."""
    ckpt = _random_init_checkpoint(tmp_path / "random.pt", "resnet18", 2)
    train_dir, test_dir = colour_split
    # a harder test set: the colours averaged with grey, so pixels and model can both miss
    hard = tmp_path / "hard"
    for path in sorted(test_dir.rglob("*.png")):
        (hard / path.parent.name).mkdir(parents=True, exist_ok=True)
        pixels = np.asarray(Image.open(path)).astype(np.float32)
        Image.fromarray((0.35 * pixels + 0.65 * 128).astype(np.uint8)).save(hard / path.parent.name / path.name)
    out = tmp_path / "knn.json"
    common = ["--device", "cpu", "--batch-size", "16", "--k", "5", "--pixels", "--out", str(out)]
    assert main(["eval", "knn", "--train", str(train_dir), "--test", str(hard), str(ckpt), *common]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = {r["k"]: r for r in doc["results"] if r["metric"] == "pixel_knn_top1"}
    assert sorted(rows) == [1, 5, 20] and all(r["distance"] == "l2" for r in rows.values())

    def load(folder):
        paths = sorted(folder.rglob("*.png"))
        x = np.stack([np.asarray(Image.open(p), dtype=np.float64).ravel() for p in paths])
        return x, np.array([sorted(COLOURS).index(p.parent.name) for p in paths])

    (xb, yb), (xq, yq) = load(train_dir), load(hard)
    order = ((xq[:, None, :] - xb[None, :, :]) ** 2).sum(-1).argsort(1, kind="stable")
    for k in (1, 5, 20):
        votes = np.stack([np.bincount(yb[row[:k]], minlength=3) for row in order])
        assert rows[k]["top1"] == pytest.approx(float((votes.argmax(1) == yq).mean()))
    model_best = max(r["top1"] for r in doc["results"] if r["metric"] == "knn_top1")
    assert doc["over_pixels"]["points"] == pytest.approx(
        100 * (model_best - max(r["top1"] for r in rows.values())), abs=0.01
    )
    assert "raw pixels, L2 k-NN top-1, k=20" in printed and "points against raw pixels' best" in printed

    # the same folder twice: leave-one-out for the pixels too (k clipped to the other 29 images)
    assert main(["eval", "knn", "--train", str(train_dir), "--test", str(train_dir), str(ckpt), *common]) == 0
    doc = json.loads(out.read_text())
    loo = {r["k"]: r for r in doc["results"] if r["metric"] == "pixel_knn_top1"}
    assert loo[1]["top1"] == 1.0 and loo[20]["k_used"] == 20  # noisy solid colours: each one's nearest is its own


def test_pixel_knn__l2_majority_vote_for_each_k_and_leave_one_out():
    from moco_retrieval.trainer.knn import pixel_knn_accuracy

    train = torch.tensor([[0.0], [0.1], [0.2], [5.0], [5.1], [9.0]])
    labels = torch.tensor([0, 0, 0, 1, 1, 0])
    test = torch.tensor([[0.05], [5.05], [8.0]])
    assert pixel_knn_accuracy(train, labels, test, torch.tensor([0, 1, 1]), ks=(1, 5)) == {
        1: pytest.approx(2 / 3),  # 8.0 is nearest to the lone 0 at 9.0
        5: pytest.approx(1 / 3),  # 5.05's and 8.0's five nearest hold three 0s
    }
    # leave-one-out: each point is classified by the others, never by itself
    assert pixel_knn_accuracy(train, labels, ks=(1,)) == {1: pytest.approx(5 / 6)}


def test_pixel_knn__chunks_of_training_images_and_uint8_give_the_same_answer():
    """The training set taken a few images at a time (a threshold crossed with 7 of 40 rows, queries 3 at a
    time), as uint8, gives the answer of one float32 pass, with a test set and leave-one-out."""
    from moco_retrieval.trainer.knn import pixel_knn_accuracy

    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 3
    train = (torch.rand(40, 2, 2, 3, generator=gen) * 150 + labels.view(-1, 1, 1, 1) * 40).to(torch.uint8)
    test = (torch.rand(15, 2, 2, 3, generator=gen) * 150 + (torch.arange(15) % 3).view(-1, 1, 1, 1) * 40).to(
        torch.uint8
    )
    ks = (1, 5, 20)
    whole = pixel_knn_accuracy(train.float(), labels, test.float(), torch.arange(15) % 3, ks=ks)
    assert pixel_knn_accuracy(train, labels, test, torch.arange(15) % 3, ks=ks, chunk=3, train_chunk=7) == whole
    assert 0.3 < whole[5] < 1.0  # neither trivial nor hopeless: the comparison means something
    loo = pixel_knn_accuracy(train.float(), labels, ks=ks)
    assert pixel_knn_accuracy(train, labels, ks=ks, chunk=3, train_chunk=7) == loo


def test_knn_monitor__pixel_baseline_separates_images_that_differ_in_their_pixels(tmp_path):
    """Two classes of plain colours with noise: raw-pixel k-NN (the baseline an encoder must beat) gets them all,
    leave-one-out, at every k."""
    from moco_retrieval.trainer.monitor import KnnMonitor

    rng = np.random.default_rng(0)
    for label, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(12):
            noise = rng.integers(-20, 20, (16, 16, 3))
            pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "data" / label / f"{i}.png")
    monitor = KnnMonitor(tmp_path / "data", 16, cache_root=tmp_path / "cache")
    assert monitor.pixel_accuracy() == {1: 1.0, 5: 1.0, 20: pytest.approx(1.0)}
