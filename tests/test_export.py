"""ONNX export: parity with PyTorch, the file's contract and metadata, atomic writes, and clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from moco_retrieval.app.cli import main
from moco_retrieval.contracts.encoder_format import ENCODER_FORMAT, ENCODER_FORMAT_VERSION
from moco_retrieval.contracts.errors import ArtifactError, ConfigError, ExportError, OutputError
from moco_retrieval.indexer.encoder import read_encoder_metadata
from tests._checkpoints import key_backbone, write_checkpoint
from moco_retrieval.trainer.mirror_average import readout
from moco_retrieval.trainer.export import (
    DEFAULT_OPSET,
    FP32_TOLERANCE,
    MAX_OPSET,
    MIN_OPSET,
    ParityTolerance,
    export_encoder,
    load_backbone,
    reference_embeddings,
    verification_images,
)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def v2_run(shapes_dir, tmp_path_factory) -> Path:
    return write_checkpoint(shapes_dir, tmp_path_factory.mktemp("v2") / "run")


@pytest.fixture(scope="module")
def v2_onnx(v2_run) -> tuple[Path, object]:
    torch.set_num_threads(1)
    out = v2_run.parent / "encoder.onnx"
    return out, export_encoder(v2_run, out)


def _ort(path: Path, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["embeddings"], {"images": images})[0]


def _images(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _assert_parity(path: Path, run_dir: Path, max_abs: float = 1e-4, min_cosine: float = 0.9999) -> None:
    meta = read_encoder_metadata(path)
    backbone, _ = readout(load_backbone(run_dir)[0], bool(meta["mirror_average"]))
    size = meta["image_size"]
    for n in (1, 7):
        images = _images(n, size)
        got, want = _ort(path, images), reference_embeddings(backbone, images)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.abs(got - want).max() <= max_abs
        assert (got * want).sum(1).min() >= min_cosine


def test_export__v2_resnet18_matches_pytorch_at_batch_1_and_7(shapes_dir, v2_run, v2_onnx):
    path, result = v2_onnx
    assert path.is_file() and [c.batch_size for c in result.checks] == [1, 7]
    assert all(c.passed and c.max_abs <= 1e-4 and c.min_cosine >= 0.9999 for c in result.checks)
    assert result.image_source == f"7 images from {shapes_dir}"  # the run's own data
    _assert_parity(path, v2_run)


def test_export__uses_query_backbone_not_momentum_encoder(v2_run, v2_onnx):
    images = _images(4, 64, seed=3)
    got = _ort(v2_onnx[0], images)
    key = reference_embeddings(key_backbone(v2_run), images)
    assert np.abs(got - key).max() > 1e-2
    model = onnx.load(str(v2_onnx[0]))
    assert not any("head" in init.name or "encoder_k" in init.name for init in model.graph.initializer)


def test_export__graph_contract_uint8_nhwc_in_l2_normalized_float32_out(v2_onnx):
    model = onnx.load(str(v2_onnx[0]))
    (inp,), (out,) = model.graph.input, model.graph.output
    in_dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    out_dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert inp.name == "images" and inp.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert in_dims == ["batch", 64, 64, 3]  # trained at 32 px, where ResNet-18's last map is 1x1: twice that
    assert out.name == "embeddings" and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert out_dims == ["batch", 512]
    for n in (1, 3, 8):  # dynamic batch
        emb = _ort(v2_onnx[0], _images(n, 64, seed=n))
        assert emb.shape == (n, 512)
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_export__graph_holds_every_convolution_as_a_conv_node(v2_onnx):
    """At 64 px ResNet-18's layer4 sees a 2x2 map, where training computes its 3x3 convolutions as matrix
    products (trainer.small_map_conv); the file keeps the standard network: its 20 convolutions as Conv nodes."""
    model = onnx.load(str(v2_onnx[0]))
    assert sum(node.op_type == "Conv" for node in model.graph.node) == 20


def test_export__metadata_round_trips(v2_run, v2_onnx):
    meta = read_encoder_metadata(v2_onnx[0])
    assert meta["format"] == ENCODER_FORMAT and meta["format_version"] == ENCODER_FORMAT_VERSION
    assert meta["image_size"] == 64 and meta["trained_image_size"] == 32 and meta["embedding_dim"] == 512
    assert meta["arch"] == "resnet18" and meta["moco_version"] == 2
    assert meta["resize"] == "shorter_side_center_crop"
    assert meta["mean"] == [0.485, 0.456, 0.406] and meta["std"] == [0.229, 0.224, 0.225]
    assert meta["run_id"] == "test-run-0" and meta["checkpoint_epoch"] == 3 and meta["checkpoint_step"] == 42
    assert meta["precision"] == "fp32" and meta["opset"] == DEFAULT_OPSET
    assert v2_onnx[1].metadata["run_id"] == "test-run-0"


def test_export__fp16_is_smaller_and_within_cosine_limit(v2_run, v2_onnx, tmp_path):
    out = tmp_path / "encoder-fp16.onnx"
    result = export_encoder(v2_run, out, fp16=True)
    assert result.tolerance.max_abs is None and result.tolerance.min_cosine == 0.999
    assert all(c.passed for c in result.checks)
    assert out.stat().st_size < 0.6 * v2_onnx[0].stat().st_size
    assert read_encoder_metadata(out)["precision"] == "fp16"
    _assert_parity(out, v2_run, max_abs=5e-2, min_cosine=0.999)


def test_export__mismatch_fails_and_leaves_no_file(v2_run, tmp_path):
    out = tmp_path / "encoder.onnx"
    impossible = ParityTolerance(max_abs=FP32_TOLERANCE.max_abs, min_cosine=1.5)
    with pytest.raises(ExportError, match="does not match PyTorch"):
        export_encoder(v2_run, out, tolerance=impossible)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_export__mismatch_keeps_previous_file(v2_run, tmp_path):
    out = tmp_path / "encoder.onnx"
    out.write_bytes(b"previous")
    with pytest.raises(ExportError):
        export_encoder(v2_run, out, tolerance=ParityTolerance(max_abs=None, min_cosine=1.5))
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["encoder.onnx"]


def test_export__rejects_missing_unreadable_and_foreign_checkpoints(tmp_path, v2_onnx):
    out = tmp_path / "e.onnx"
    with pytest.raises(ArtifactError, match="no checkpoint"):
        export_encoder(tmp_path / "missing", out)
    (tmp_path / "garbage.pt").write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(ArtifactError, match="cannot read checkpoint"):
        export_encoder(tmp_path / "garbage.pt", out)
    torch.save({"state_dict": {}}, tmp_path / "other.pt")  # a torch file of another kind
    with pytest.raises(ArtifactError, match="not a moco-retrieval checkpoint"):
        export_encoder(tmp_path / "other.pt", out)
    with pytest.raises(ArtifactError, match="is an ONNX file, not a checkpoint"):
        export_encoder(v2_onnx[0], out)
    assert not out.exists()


def test_export__rejects_checkpoint_whose_weights_do_not_fit(v2_run, tmp_path):
    ckpt = torch.load(v2_run / "checkpoint_last.pt", weights_only=False)
    ckpt["config"]["arch"] = "resnet34"
    torch.save(ckpt, tmp_path / "mismatch.pt")
    with pytest.raises(ArtifactError, match="do not fit its configuration"):
        export_encoder(tmp_path / "mismatch.pt", tmp_path / "e.onnx")


def test_export__rejects_unwritable_output_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("x")
    missing_ckpt = tmp_path / "no-such-run"  # the output check must come first
    with pytest.raises(OutputError, match="is a file, not a folder"):
        export_encoder(missing_ckpt, tmp_path / "a_file" / "encoder.onnx")
    with pytest.raises(OutputError, match="is a folder"):
        export_encoder(missing_ckpt, tmp_path)
    with pytest.raises(ConfigError, match="--opset must be between"):
        export_encoder(missing_ckpt, tmp_path / "e.onnx", opset=MAX_OPSET + 1)


def test_verification_images__generated_when_the_run_data_is_gone(tmp_path):
    images, source = verification_images(str(tmp_path / "deleted"), 24)
    assert images.dtype == np.uint8 and images.shape == (7, 24, 24, 3) and "generated" in source
    assert images.std() > 10  # real drawings, not a blank batch


def test_export_cli__prints_figures_and_writes_file(v2_run, tmp_path, capsys):
    out = tmp_path / "cli.onnx"
    assert main(["export", str(v2_run), "--out", str(out), "--opset", str(MIN_OPSET)]) == 0
    printed = capsys.readouterr().out
    assert "batch 1: max |onnx - torch|" in printed and "batch 7:" in printed and f"wrote {out}" in printed
    assert read_encoder_metadata(out)["opset"] == MIN_OPSET


def test_export_cli__foreign_checkpoint_is_one_line_error_in_a_real_process(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"PK\x03\x04 definitely not torch")
    proc = subprocess.run(
        [sys.executable, "-m", "moco_retrieval", "export", str(tmp_path / "x.pt"), "--out", str(tmp_path / "e.onnx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == ArtifactError.exit_code
    assert proc.stderr.startswith("moco: error: cannot read checkpoint") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "e.onnx").exists()


def test_export_cli__help_states_the_real_opset_range(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"{MIN_OPSET}-{MAX_OPSET} (default {DEFAULT_OPSET})" in text and "RUN_DIR_OR_CHECKPOINT" in text


@pytest.mark.parametrize("arch", ["resnet18", "vit_tiny"])
def test_export__v3_matches_pytorch_at_batch_1_and_7(arch, shapes_dir, tmp_path):
    run = write_checkpoint(shapes_dir, tmp_path / "run", moco_version=3, arch=arch)
    out = tmp_path / "encoder.onnx"
    result = export_encoder(run, out)
    assert [c.batch_size for c in result.checks] == [1, 7] and all(c.passed for c in result.checks)
    meta = read_encoder_metadata(out)
    assert meta["moco_version"] == 3 and meta["arch"] == arch
    assert meta["embedding_dim"] == {"resnet18": 512, "vit_tiny": 192}[arch]
    # a ResNet trained at 32 px (a 1x1 last map) embeds at 64; a ViT at the size its position embeddings know
    assert (meta["image_size"], meta["trained_image_size"]) == ({"resnet18": 64, "vit_tiny": 32}[arch], 32)
    _assert_parity(out, run)
    names = [init.name for init in onnx.load(str(out)).graph.initializer]
    assert not any(part in name for name in names for part in ("encoder_k", "predictor", "projector"))


def test_export__v2_narrow_resnet18_matches_pytorch_with_a_128_d_embedding(shapes_dir, tmp_path):
    run = write_checkpoint(shapes_dir, tmp_path / "run", arch="resnet18_narrow", stem="small")
    out = tmp_path / "encoder.onnx"
    result = export_encoder(run, out)
    assert all(c.passed for c in result.checks)
    meta = read_encoder_metadata(out)
    assert (meta["arch"], meta["embedding_dim"]) == ("resnet18_narrow", 128)
    assert meta["image_size"] == 32  # the small stem leaves a 4x4 last map at 32 px: embedded as trained
    _assert_parity(out, run)


def test_demo__exports_the_trained_encoder_next_to_the_run(v2_run, tmp_path):
    from moco_retrieval.app.demo import export_demo_encoder

    path = export_demo_encoder(v2_run, tmp_path)
    assert path == tmp_path / "encoder.onnx" and read_encoder_metadata(path)["run_id"] == "test-run-0"


def test_export__accepts_ddp_and_compile_wrapped_weights(v2_run, v2_onnx, tmp_path):
    ckpt = torch.load(v2_run / "checkpoint_last.pt", weights_only=False)
    ckpt["model"] = {f"module.{k.replace('encoder_q.', 'encoder_q._orig_mod.')}": v for k, v in ckpt["model"].items()}
    torch.save(ckpt, tmp_path / "wrapped.pt")
    out = export_encoder(tmp_path / "wrapped.pt", tmp_path / "e.onnx").path
    images = _images(3, 64, seed=9)
    np.testing.assert_allclose(_ort(out, images), _ort(v2_onnx[0], images), atol=1e-6)


def test_embedding_size__twice_the_training_size_only_where_a_resnet_ends_on_a_1x1_map():
    """The rule of trainer.embedding_size at its threshold: ResNet-18's ImageNet stem leaves layer4 1x1 up to
    32 px and 2x2 from 33; the small stem 4x4 at 32; a ViT has no pooled map (its size is its own)."""
    from moco_retrieval.trainer.backbones import build_resnet, build_vit
    from moco_retrieval.trainer.backbones import last_map_side
    from moco_retrieval.trainer.embedding_size import embedding_size

    imagenet, _ = build_resnet("resnet18", "imagenet")
    small, _ = build_resnet("resnet18_narrow", "small")
    vit, _ = build_vit("vit_tiny", 32, 4)
    assert [last_map_side(imagenet, s) for s in (16, 32, 33, 64)] == [1, 1, 2, 2]
    assert last_map_side(small, 32) == 4 and last_map_side(vit, 32) is None
    assert [embedding_size(imagenet, s).size for s in (16, 32, 33, 224)] == [32, 64, 33, 224]
    assert (
        embedding_size(imagenet, 32, requested=40).size == 40
        and "--image-size 40" in embedding_size(imagenet, 32, 40).why
    )
    assert embedding_size(small, 32).size == 32 and embedding_size(small, 32).why == "the training size"
    assert imagenet.training  # the probe leaves the mode as it found it


def test_cli__export_image_size_chooses_the_size_and_is_checked(v2_run, shapes_dir, tmp_path, capsys):
    """--image-size on a run: the size it embeds at (the training size here), in the file and its metadata; a
    size out of bounds and a ViT run's other size are one-line errors that write nothing. ``moco eval`` of the
    run embeds at the size its export would."""
    from moco_retrieval.trainer.evaluate import CheckpointEmbedder

    assert main(["export", str(v2_run), "--out", str(tmp_path / "a.onnx"), "--image-size", "32"]) == 0
    assert "input uint8 [N, 32, 32, 3]" in capsys.readouterr().out
    meta = read_encoder_metadata(tmp_path / "a.onnx")
    assert (meta["image_size"], meta["trained_image_size"]) == (32, 32)
    assert main(["export", str(v2_run), "--out", str(tmp_path / "b.onnx"), "--image-size", "4"]) == 2
    assert "--image-size must be between 8 and 2048 pixels, got 4" in capsys.readouterr().err
    vit = write_checkpoint(shapes_dir, tmp_path / "vit", moco_version=3, arch="vit_tiny")
    assert main(["export", str(vit), "--out", str(tmp_path / "c.onnx"), "--image-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a ViT embeds at the size it trained at (32 px)" in err and "--init" in err
    assert not (tmp_path / "b.onnx").exists() and not (tmp_path / "c.onnx").exists()
    assert CheckpointEmbedder(v2_run, device="cpu").image_size == 64
    assert CheckpointEmbedder(v2_run, device="cpu", image_size=32).image_size == 32


def test_mirror_averaged__one_backbone_call_equals_the_mean_of_both_views_and_ignores_a_mirror():
    """:class:`MirrorAveraged` = normalize(b(x)) + normalize(b(mirror x)), so an image and its mirror give the same
    vector; ``readout`` wraps by default (``MIRROR_AVERAGE``) and leaves the backbone alone when told to."""
    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.mirror_average import MIRROR_AVERAGE, MirrorAveraged

    torch.manual_seed(0)
    backbone = build_resnet("resnet18", "imagenet")[0].eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        both = MirrorAveraged(backbone)(x)
        apart = torch.nn.functional.normalize(backbone(x), dim=1) + torch.nn.functional.normalize(
            backbone(x.flip(3)), dim=1
        )
        assert both.shape == (3, 512) and torch.allclose(both, apart, atol=1e-5)
        assert torch.allclose(MirrorAveraged(backbone)(x.flip(3)), both, atol=1e-5)
        assert not torch.allclose(backbone(x.flip(3)), backbone(x), atol=1e-3)  # the backbone alone is not
    assert readout(backbone)[1] is MIRROR_AVERAGE and isinstance(readout(backbone, True)[0], MirrorAveraged)
    assert readout(backbone, False) == (backbone, False)


def test_export__mirror_average_by_default_is_in_the_graph_and_off_on_request(v2_run, v2_onnx, tmp_path, capsys):
    """The default file embeds an image and its mirror identically (metadata ``mirror_average`` 1), verified
    against PyTorch; ``--mirror-average off`` gives one that does not (0); ``moco eval`` of the run reads out as
    asked, and refuses the flag for an .onnx file, which states its own."""
    from moco_retrieval.app.cmd_eval import open_model
    from moco_retrieval.trainer.evaluate import CheckpointEmbedder

    images = _images(5, 64, seed=4)
    mirrors = np.ascontiguousarray(images[:, :, ::-1])
    on = v2_onnx[0]
    assert read_encoder_metadata(on)["mirror_average"] == 1
    assert np.abs(_ort(on, images) - _ort(on, mirrors)).max() < 1e-5
    off = tmp_path / "off.onnx"
    assert main(["export", str(v2_run), "--out", str(off), "--mirror-average", "off"]) == 0
    assert "mirror-averaged: no" in capsys.readouterr().out
    assert read_encoder_metadata(off)["mirror_average"] == 0
    assert np.abs(_ort(off, images) - _ort(off, mirrors)).max() > 1e-3
    _assert_parity(off, v2_run)
    assert CheckpointEmbedder(v2_run, device="cpu").describe()["mirror_average"] == 1
    assert CheckpointEmbedder(v2_run, device="cpu", mirror_average=False).describe()["mirror_average"] == 0
    with pytest.raises(ConfigError, match="--mirror-average go with weights files"):
        open_model(str(on), "cpu", 16, 0, mirror_average="off")
