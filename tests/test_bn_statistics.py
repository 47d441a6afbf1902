"""BatchNorm statistics re-estimated at export: the estimate itself, its minimum image count (crossed), the
settings, and the exported file carrying them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from moco_retrieval.app.cli import main
from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.indexer.encoder import read_encoder_metadata
from moco_retrieval.trainer.backbones import build_resnet
from moco_retrieval.trainer.bn_statistics import has_batch_norm, refit_bn_statistics, refit_for_export
from moco_retrieval.trainer.eval_transform import eval_transform
from moco_retrieval.contracts.images import decode_image
from moco_retrieval.trainer.export import export_encoder, load_backbone, reference_embeddings
from moco_retrieval.trainer.mirror_average import readout
from tests._checkpoints import write_checkpoint


def _images(root: Path, count: int, size: int = 24, broken: int = 0) -> list[Path]:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    paths = []
    for i in range(count):
        path = root / f"{i:04d}.png"
        tint = rng.integers(0, 256, 3)  # off-centre colours, so the statistics are far from a fresh BN's 0 / 1
        pixels = np.clip(tint + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path)
        paths.append(path)
    for i in range(broken):
        (root / f"broken{i}.png").write_bytes(b"not a png")
        paths.append(root / f"broken{i}.png")
    return paths


def _running(backbone: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [torch.cat([m.running_mean, m.running_var]) for m in backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    )


def test_refit__first_layer_statistics_are_the_images_own(tmp_path):
    torch.manual_seed(0)
    backbone, _ = build_resnet("resnet18", "imagenet")
    backbone.eval()
    paths = _images(tmp_path / "imgs", 32, broken=1)
    seen = refit_bn_statistics(backbone, 32, paths, batch_size=16)
    assert seen == 32 and not backbone.training  # the broken file is left out, the mode restored
    x = torch.stack([eval_transform(32)(decode_image(p)) for p in paths[:32]])
    with torch.no_grad():
        conv1 = backbone.conv1(x)
    want_mean = conv1.mean((0, 2, 3))  # two batches of 16: the mean of their means is the mean of all
    assert torch.allclose(backbone.bn1.running_mean, want_mean, atol=1e-4)
    per_batch_var = torch.stack([conv1[i : i + 16].var((0, 2, 3), unbiased=True) for i in (0, 16)]).mean(0)
    assert torch.allclose(backbone.bn1.running_var, per_batch_var, rtol=1e-3)


def test_refit__fewer_readable_images_than_the_minimum_change_nothing(tmp_path):
    torch.manual_seed(0)
    backbone, _ = build_resnet("resnet18", "imagenet")
    before = _running(backbone).clone()
    paths = _images(tmp_path / "imgs", 5, broken=3)
    assert refit_bn_statistics(backbone, 32, paths, min_images=6) == 5
    assert torch.equal(_running(backbone), before)
    assert refit_bn_statistics(backbone, 32, paths, min_images=5) == 5  # the threshold crossed: they change
    assert not torch.equal(_running(backbone), before)


def test_refit_for_export__settings_and_the_minimum_crossed(tmp_path):
    torch.manual_seed(0)
    backbone, _ = build_resnet("resnet18", "imagenet")
    before = _running(backbone).clone()
    data = tmp_path / "data"
    _images(data / "a", 12, broken=2)
    _images(data / "b", 12)
    assert refit_for_export(backbone, 32, data, "off") == "training's (--refit-bn off)"
    assert "not available" in refit_for_export(backbone, 32, tmp_path / "gone")
    assert refit_for_export(backbone, 32, data, min_images=27) == "training's (only 26 images, fewer than 27)"
    assert refit_for_export(backbone, 32, data, min_images=25) == "training's (only 24 readable images, fewer than 25)"
    assert torch.equal(_running(backbone), before)  # nothing done so far
    assert refit_for_export(backbone, 32, data, min_images=24) == "refit on 24 images at 32 px"
    assert not torch.equal(_running(backbone), before)
    with pytest.raises(ConfigError, match="--refit-bn must be auto or off"):
        refit_for_export(backbone, 32, data, "yes")
    assert not has_batch_norm(torch.nn.Sequential(torch.nn.LayerNorm(4)))
    assert refit_for_export(torch.nn.Sequential(torch.nn.LayerNorm(4)), 32, data) == "none (no BatchNorm layers)"


def test_export__refit_file_matches_pytorch_says_so_and_differs_from_off(tmp_path, shapes_dir, monkeypatch):
    torch.set_num_threads(1)
    run = write_checkpoint(shapes_dir, tmp_path / "run")
    data = tmp_path / "data"
    _images(data / "x", 30, size=32)
    monkeypatch.setattr("moco_retrieval.trainer.bn_statistics.REFIT_BN_MIN_IMAGES", 30)
    refit = export_encoder(run, tmp_path / "refit.onnx", data_dir=str(data), whiten="off")
    assert refit.checks and all(c.passed for c in refit.checks)
    meta = read_encoder_metadata(refit.path)
    size = meta["image_size"]
    assert meta["bn_statistics"] == f"refit on 30 images at {size} px"
    off = ["export", str(run), "--out", str(tmp_path / "off.onnx"), "--whiten", "off", "--data", str(data)]
    assert main([*off, "--refit-bn", "off"]) == 0
    assert read_encoder_metadata(tmp_path / "off.onnx")["bn_statistics"] == "training's (--refit-bn off)"
    images = np.random.default_rng(1).integers(0, 256, (4, size, size, 3), dtype=np.uint8)

    def run_onnx(path: Path) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"images": images})[0]

    backbone, _, _ = load_backbone(run)
    assert refit_bn_statistics(backbone, size, sorted((data / "x").iterdir())) == 30
    want = reference_embeddings(readout(backbone, bool(meta["mirror_average"]))[0], images)
    assert np.abs(run_onnx(refit.path) - want).max() < 1e-4  # the file holds the refitted statistics
    assert np.abs(run_onnx(tmp_path / "off.onnx") - want).max() > 1e-2  # and --refit-bn off the training's


def test_cli__refit_bn_goes_with_a_checkpoint_and_its_help_names_the_minimum(tmp_path, capsys):
    from moco_retrieval.trainer.bn_statistics import REFIT_BN_MIN_IMAGES

    weights = tmp_path / "w.pth"
    weights.write_bytes(b"")
    assert main(["export", "--init", str(weights), "--out", str(tmp_path / "e.onnx"), "--refit-bn", "off"]) == 2
    assert "--refit-bn goes with a run's checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert f"at least {REFIT_BN_MIN_IMAGES} readable images" in " ".join(capsys.readouterr().out.split())


def test_export__walks_the_data_folder_once_for_the_refit_and_the_whitening(tmp_path, shapes_dir, monkeypatch):
    import moco_retrieval.contracts.images as images

    run = write_checkpoint(shapes_dir, tmp_path / "run")
    data = tmp_path / "data"
    _images(data / "x", 30, size=32)
    monkeypatch.setattr("moco_retrieval.trainer.bn_statistics.REFIT_BN_MIN_IMAGES", 30)
    monkeypatch.setattr("moco_retrieval.trainer.whitening.WHITEN_MIN_IMAGES", 30)
    walks, walk = [], images.iter_image_files
    monkeypatch.setattr(images, "iter_image_files", lambda root, *a, **k: walks.append(root) or walk(root, *a, **k))
    meta = read_encoder_metadata(export_encoder(run, tmp_path / "e.onnx", data_dir=str(data)).path)
    assert meta["bn_statistics"].startswith("refit on 30 images") and not meta["whitening"].startswith("none")
    assert walks == [data]
