"""PCA whitening baked into exported encoders: the fit, its size rules (each crossed), the sample, the export."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from moco_retrieval.app.cli import main
from moco_retrieval.contracts.errors import ConfigError, DataError
from moco_retrieval.indexer.encoder import read_encoder_metadata
from moco_retrieval.trainer.export import export_encoder, load_backbone, reference_embeddings
from moco_retrieval.trainer.mirror_average import readout
from moco_retrieval.trainer.whitening import (
    SAMPLES_PER_DIM,
    fit_for_export,
    fit_pca_whitening,
    parse_whiten,
    sample_images,
    whitening_dim,
)
from tests._checkpoints import write_checkpoint


def _anisotropic(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -2, d)  # variances 1 .. 1e-4
    return torch.randn(n, d, generator=g) * scales + 3.0  # off-centre, so the mean matters


def test_fit__whitened_features_have_unit_covariance_on_the_fitting_set():
    x = _anisotropic(4000, 16)
    w = fit_pca_whitening(x, 8)
    y = w(x).double()
    assert (w.in_dim, w.out_dim, w.images) == (16, 8, 4000)
    assert y.mean(0).abs().max() < 1e-4
    cov = y.T @ y / len(y)
    assert torch.allclose(cov, torch.eye(8, dtype=torch.float64), atol=1e-3)
    assert w.describe() == "pca 8 of 16 dims, 4000 images"


def test_fit__directions_without_variance_stay_finite():
    x = torch.zeros(500, 12)
    x[:, :3] = torch.randn(500, 3)  # rank 3 (+ the normalisation): 9 directions carry nothing
    w = fit_pca_whitening(x, 12)
    y = w(torch.randn(20, 12))
    assert torch.isfinite(y).all() and torch.isfinite(w.projection).all()


def test_whitening_dim__images_per_direction_cap_and_requested_bounds():
    assert whitening_dim(60_000, 128) == 128  # enough images: every direction
    assert whitening_dim(763, 512) == 763 // SAMPLES_PER_DIM == 190  # few images: n / 4 directions
    assert whitening_dim(5, 512) == 1
    assert whitening_dim(1000, 512, 300) == 300
    with pytest.raises(ConfigError, match="512-d"):
        whitening_dim(1000, 512, 513)
    with pytest.raises(ConfigError, match="at most 299"):
        whitening_dim(300, 512, 300)


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("OFF", "off"), ("64", 64), (32, 32)])
def test_parse_whiten__accepts_auto_off_and_positive_numbers(value, parsed):
    assert parse_whiten(value) == parsed


@pytest.mark.parametrize("value", ["0", "-3", "yes", "1.5", ""])
def test_parse_whiten__refuses_anything_else_in_one_line(value):
    with pytest.raises(ConfigError, match="--whiten must be auto, off"):
        parse_whiten(value)


def _folder(root: Path, per_class: dict[str, int], size: int = 32) -> Path:
    rng = np.random.default_rng(0)
    for name, count in per_class.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / name / f"{i:04d}.png")
    return root


def test_sample_images__spread_over_every_class_and_capped(tmp_path):
    root = _folder(tmp_path / "data", {"a": 30, "b": 30, "c": 30}, size=8)
    sample = sample_images(root, max_images=9)
    assert sample.found == 90 and len(sample.paths) == 9
    assert {p.parent.name for p in sample.paths} == {"a", "b", "c"}
    assert len(sample_images(root, max_images=1000).paths) == 90
    with pytest.raises(DataError, match="not a folder"):
        sample_images(tmp_path / "missing")


@pytest.fixture(scope="module")
def run_and_data(tmp_path_factory, shapes_dir) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    run = write_checkpoint(shapes_dir, tmp_path_factory.mktemp("white") / "run")
    data = _folder(tmp_path_factory.mktemp("white_data") / "data", {"x": 40, "y": 40, "z": 40})
    (data / "x" / "broken.png").write_bytes(b"not a png")  # an unreadable file is left out, not fatal
    return run, data


def test_fit_for_export__crosses_the_minimum_image_count(run_and_data):
    run, data = run_and_data
    backbone, cfg, _ = load_backbone(run)
    none, why = fit_for_export(backbone, cfg.image_size, data, "auto", min_images=121)
    assert none is None and "only 120 readable images" in why and "fewer than 121" in why
    w, what = fit_for_export(backbone, cfg.image_size, data, "auto", min_images=120)
    assert w is not None and w.images == 120 and w.out_dim == 120 // SAMPLES_PER_DIM and what == w.describe()
    sixty = functools.partial(sample_images, data, 60)
    w, _ = fit_for_export(backbone, cfg.image_size, data, "auto", min_images=50, listing=sixty)
    assert w.images == 59  # the sample is capped at 60 before embedding, and the broken file among them left out
    w, _ = fit_for_export(backbone, cfg.image_size, data, 40, min_images=50)
    assert w.out_dim == 40


def test_fit_for_export__off_missing_data_and_impossible_requests(run_and_data, tmp_path):
    run, data = run_and_data
    backbone, cfg, _ = load_backbone(run)
    assert fit_for_export(backbone, cfg.image_size, data, "off") == (None, "none (--whiten off)")
    none, why = fit_for_export(backbone, cfg.image_size, tmp_path / "gone", "auto")
    assert none is None and "not available" in why
    with pytest.raises(DataError, match="needs the images to fit it on"):
        fit_for_export(backbone, cfg.image_size, tmp_path / "gone", 16)
    with pytest.raises(DataError, match="only 120 readable images"):
        fit_for_export(backbone, cfg.image_size, data, 200, min_images=50)
    with pytest.raises(ConfigError, match="512-d"):  # checked before the folder is even looked at
        fit_for_export(backbone, cfg.image_size, tmp_path / "gone", 513)


def test_export__whitened_file_matches_pytorch_and_says_so(run_and_data, tmp_path, monkeypatch):
    run, data = run_and_data
    monkeypatch.setattr("moco_retrieval.trainer.whitening.WHITEN_MIN_IMAGES", 100)
    result = export_encoder(run, tmp_path / "w.onnx", data_dir=str(data))
    meta = read_encoder_metadata(result.path)
    assert meta["embedding_dim"] == 30 and meta["whitening"] == "pca 30 of 512 dims, 120 images"
    assert result.checks and all(c.passed for c in result.checks)
    backbone, cfg, _ = load_backbone(run)
    backbone, _ = readout(backbone, bool(meta["mirror_average"]))  # mirror-averaged, as the default file is
    assert meta["mirror_average"] == 1
    size = meta["image_size"]  # the whitening is fitted at the size the file embeds at (twice 32 px here)
    assert (size, meta["trained_image_size"]) == (2 * cfg.image_size, cfg.image_size)
    whitening, _ = fit_for_export(backbone, size, data, "auto", min_images=100)
    images = np.random.default_rng(1).integers(0, 256, (5, size, size, 3), dtype=np.uint8)
    got = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]
    want = reference_embeddings(backbone, images, whitening)
    assert got.shape == (5, 30) and np.abs(got - want).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    fp16 = export_encoder(run, tmp_path / "w16.onnx", data_dir=str(data), fp16=True)
    assert fp16.checks and all(c.passed for c in fp16.checks)  # the whitening stays float32 in a half graph


def test_cli__whiten_off_and_a_bad_value(run_and_data, tmp_path, capsys):
    run, data = run_and_data
    assert main(["export", str(run), "--out", str(tmp_path / "a.onnx"), "--whiten", "off", "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "whitening: none (--whiten off)" in out
    assert read_encoder_metadata(tmp_path / "a.onnx")["embedding_dim"] == 512
    assert main(["export", str(run), "--out", str(tmp_path / "b.onnx"), "--whiten", "many"]) == 2
    assert "--whiten must be auto, off" in capsys.readouterr().err
    assert not (tmp_path / "b.onnx").exists()


def _split_folder(root: Path) -> Path:
    from moco_retrieval.trainer.demo_data import write_demo_dataset

    write_demo_dataset(root / "train", per_class=12, size=32, seed=0)
    write_demo_dataset(root / "val", per_class=4, size=32, seed=1)
    return root


def test_knn_monitor__whitened_score_is_knn_of_a_whitening_fitted_on_the_bank(tmp_path):
    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.knn import knn_accuracy
    from moco_retrieval.trainer.monitor import KnnMonitor

    monitor = KnnMonitor(_split_folder(tmp_path / "data"), 32, cache_root=tmp_path / "cache", whiten_min_images=8)
    torch.manual_seed(0)
    backbone, _ = build_resnet("resnet18", "imagenet")
    cpu = torch.device("cpu")
    score = monitor.scores(backbone, cpu)
    assert backbone.training  # the monitor puts the backbone back in the mode it found it in
    backbone.eval()
    bank, queries = (monitor.features(backbone, s, cpu) for s in monitor.splits)
    whitening = fit_pca_whitening(bank, len(bank) // SAMPLES_PER_DIM)  # fitted on the bank only, labels unused
    expected = knn_accuracy(
        torch.nn.functional.normalize(whitening(bank), dim=1),
        monitor.splits[0].labels,
        torch.nn.functional.normalize(whitening(queries), dim=1),
        monitor.splits[1].labels,
        k=monitor.k,
        temperature=monitor.temperature,
    )
    assert score.whitened == pytest.approx(expected)
    assert score.plain == pytest.approx(monitor.evaluate(backbone, cpu))


def test_knn_monitor__no_whitened_score_below_the_minimum_bank(tmp_path):
    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.monitor import KnnMonitor

    data, cache = _split_folder(tmp_path / "data"), tmp_path / "cache"
    backbone, _ = build_resnet("resnet18", "imagenet")
    cpu = torch.device("cpu")
    bank = len(KnnMonitor(data, 32, cache_root=cache).splits[0].labels)
    below = KnnMonitor(data, 32, cache_root=cache, whiten_min_images=bank + 1).scores(backbone, cpu)
    at = KnnMonitor(data, 32, cache_root=cache, whiten_min_images=bank).scores(backbone, cpu)
    assert below.whitened is None and 0 <= below.plain <= 1
    assert at.whitened is not None and 0 <= at.whitened <= 1 and at.plain == below.plain
