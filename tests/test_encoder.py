"""The shared encoder runtime (indexer.encoder): preprocessing equal to torchvision's eval transform, embeddings
equal to the PyTorch backbone, input checks, foreign files, device choice, no torch."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import v2 as T

from moco_retrieval.contracts.encoder_format import ENCODER_FORMAT_VERSION, preprocess_image
from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError
from moco_retrieval.contracts.images import decode_image
from moco_retrieval.indexer.encoder import (
    OnnxEncoder,
    available_cores,
    open_session,
    read_encoder_metadata,
)
from tests._checkpoints import write_checkpoint
from moco_retrieval.trainer.demo_data import draw_shape
from moco_retrieval.trainer.eval_transform import eval_transform
from moco_retrieval.trainer.export import export_encoder, load_backbone
from moco_retrieval.trainer.mirror_average import readout


@pytest.fixture(scope="module")
def exported(shapes_dir, tmp_path_factory) -> tuple[Path, Path]:
    """``(encoder.onnx, run_dir)``: a ResNet-18 v2 encoder at 32 px (exported without the parity check)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("encoder")
    run = write_checkpoint(shapes_dir, root / "run", seed=5)
    return export_encoder(run, root / "encoder.onnx", verify=False, image_size=32).path, run  # the training size


@pytest.fixture(scope="module")
def encoder(exported) -> OnnxEncoder:
    return OnnxEncoder(exported[0], device="cpu", threads=1)


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A detailed RGB picture of any shape (a drawn shape pattern, stretched), so resampling differences show."""
    rng = np.random.default_rng(seed)
    return draw_shape("star", rng, 64).resize((width, height), Image.NEAREST)


@pytest.mark.parametrize("width,height", [(50, 37), (37, 50), (32, 32), (33, 32), (20, 90), (64, 64), (31, 17)])
def test_preprocess_image__equals_torchvision_resize_and_center_crop(width, height):
    image = _photo(width, height, seed=width)
    want = np.asarray(T.Compose([T.Resize(32, antialias=True), T.CenterCrop(32)])(image))
    got = preprocess_image(image, 32)
    assert got.dtype == np.uint8 and got.shape == (32, 32, 3)
    np.testing.assert_array_equal(got, want)


def test_preprocess_image__converts_modes_and_rejects_unknown_policy():
    gray = _photo(40, 30).convert("L")
    np.testing.assert_array_equal(preprocess_image(gray, 16), preprocess_image(gray.convert("RGB"), 16))
    with pytest.raises(ConfigError, match="unknown resize policy"):
        preprocess_image(gray, 16, resize="stretch")


def test_preprocess_image__is_picklable_and_runs_in_worker_processes():
    assert pickle.loads(pickle.dumps(preprocess_image)) is preprocess_image
    images = [_photo(40 + i, 30, seed=i) for i in range(3)]
    with ProcessPoolExecutor(max_workers=1) as pool:
        rows = list(pool.map(preprocess_image, images, [24] * 3))
    for image, row in zip(images, rows):
        np.testing.assert_array_equal(row, preprocess_image(image, 24))


def test_encoder__image_file_embedding_equals_pytorch_eval_transform(exported, encoder, tmp_path):
    paths = []
    for i, (w, h) in enumerate([(50, 37), (29, 61), (32, 32)]):
        paths.append(tmp_path / f"img{i}.png")
        _photo(w, h, seed=10 + i).save(paths[-1])
    mirrored = bool(read_encoder_metadata(exported[0])["mirror_average"])  # 1: the default readout
    backbone, _ = readout(load_backbone(exported[1])[0], mirrored)
    with torch.no_grad():
        x = torch.stack([eval_transform(32)(decode_image(p)) for p in paths])
        want = F.normalize(backbone(x), dim=1).numpy()
    got = encoder.embed_images([str(p) for p in paths])
    assert got.dtype == np.float32 and got.shape == (3, 512)
    assert np.abs(got - want).max() <= 1e-4
    from_bytes = encoder.embed_images([p.read_bytes() for p in paths])
    from_pil = encoder.embed_images([Image.open(p) for p in paths])
    np.testing.assert_array_equal(from_bytes, got)
    np.testing.assert_array_equal(from_pil, got)


def test_encoder__attributes_come_from_the_file(exported, encoder):
    path = exported[0]
    assert encoder.path == path and encoder.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert encoder.image_size == 32 and encoder.embedding_dim == 512
    assert encoder.metadata == read_encoder_metadata(path) and encoder.metadata["run_id"] == "test-run-5"
    assert encoder.provider == "CPUExecutionProvider"
    assert encoder.session.get_session_options().intra_op_num_threads == 1


def test_encoder__dynamic_batch_rows_do_not_depend_on_batch(encoder):
    batch = np.random.default_rng(1).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    whole = encoder.embed(batch)
    assert whole.shape == (8, 512)
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-5)
    for n in (1, 3):
        np.testing.assert_allclose(encoder.embed(batch[:n]), whole[:n], atol=1e-5)
    assert encoder.embed(batch[:0]).shape == (0, 512)
    assert encoder.embed_images([]).shape == (0, 512)


@pytest.mark.parametrize(
    "bad,expected",
    [
        (np.zeros((2, 32, 32, 3), dtype=np.float32), "must be uint8"),
        (np.zeros((32, 32, 3), dtype=np.uint8), "must have shape"),
        (np.zeros((2, 3, 32, 32), dtype=np.uint8), "must have shape"),
        (np.zeros((2, 64, 64, 3), dtype=np.uint8), "must have shape"),
        ([[0, 1, 2]], "must be a numpy uint8 array"),
    ],
)
def test_encoder__wrong_dtype_or_shape_is_data_error(encoder, bad, expected):
    with pytest.raises(DataError, match=expected) as info:
        encoder.embed(bad)
    assert "\n" not in str(info.value)


def test_encoder__rejects_missing_foreign_and_newer_files(exported, tmp_path):
    with pytest.raises(ArtifactError, match="encoder not found"):
        OnnxEncoder(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07junk that is not protobuf" * 3)
    with pytest.raises(ArtifactError, match="not a readable ONNX file|not a moco-retrieval encoder"):
        OnnxEncoder(tmp_path / "junk.onnx")
    with pytest.raises(ArtifactError, match="not a readable ONNX file"):  # the file, not the GPU, is at fault
        OnnxEncoder(tmp_path / "junk.onnx", device="cuda")
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))  # a valid ONNX file, not ours
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter announces its removal
        torch.onnx.export(plain, (torch.zeros(1, 2, 2, 3),), str(tmp_path / "plain.onnx"), dynamo=False)
    with pytest.raises(ArtifactError, match="not a moco-retrieval encoder"):
        OnnxEncoder(tmp_path / "plain.onnx")
    with pytest.raises(ArtifactError, match="not a moco-retrieval encoder"):
        read_encoder_metadata(tmp_path / "plain.onnx")
    model = onnx.load(str(exported[0]))
    props = {p.key: p.value for p in model.metadata_props}
    props["format_version"] = str(ENCODER_FORMAT_VERSION + 1)
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(tmp_path / "newer.onnx"))
    with pytest.raises(ArtifactError, match="upgrade moco-retrieval"):
        OnnxEncoder(tmp_path / "newer.onnx")


def test_open_session__auto_uses_cuda_only_when_a_session_really_runs_there(exported):
    session, provider = open_session(exported[0], device="auto", threads=1)
    assert session.get_providers()[0] == provider
    if provider == "CPUExecutionProvider":
        for device in ("cuda", "cuda:0"):
            with pytest.raises(ConfigError, match="--device cuda"):
                OnnxEncoder(exported[0], device=device)
    with pytest.raises(ConfigError, match="unknown --device"):
        open_session(exported[0], device="tpu")
    assert available_cores() >= 1


def test_encoder__runs_without_torch_in_a_real_process(exported, tmp_path):
    image = tmp_path / "x.png"
    _photo(45, 33).save(image)
    code = (
        "import json, sys\n"
        "from moco_retrieval.indexer.encoder import OnnxEncoder\n"
        f"e = OnnxEncoder({str(exported[0])!r}, device='cpu', threads=1)\n"
        f"x = e.embed_images([{str(image)!r}])\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'shape': list(x.shape), 'row': x[0, :4].tolist()}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] is False and report["shape"] == [1, 512]
    here = OnnxEncoder(exported[0], device="cpu", threads=1).embed_images([image])
    np.testing.assert_allclose(report["row"], here[0, :4], atol=1e-6)


def _tiny_encoder(path: Path, exported: Path, output: str, size: int = 8, dim: int = 3, **declared) -> Path:
    """An ONNX file with our metadata (``declared`` overrides it) whose graph maps uint8 [N, size, size, 3] to
    the per-channel mean, then: ``unit`` L2-normalized, ``raw`` as it is, ``nan`` times NaN, ``flat`` 1-D."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["images"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["f", "axes"], ["m"], keepdims=0),
    ]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])]
    out_shape = ["N", dim]
    if output == "unit":
        nodes.append(helper.make_node("LpNormalization", ["m"], ["embeddings"], axis=1, p=2))
    elif output == "raw":
        nodes.append(helper.make_node("Identity", ["m"], ["embeddings"]))
    elif output == "nan":
        inits.append(helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")]))
        nodes.append(helper.make_node("Mul", ["m", "nan"], ["embeddings"]))
    else:  # flat
        inits.append(helper.make_tensor("axis1", TensorProto.INT64, [1], [1]))
        nodes.append(helper.make_node("ReduceMean", ["m", "axis1"], ["embeddings"], keepdims=0))
        out_shape = ["N"]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.UINT8, ["N", size, size, 3])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    props = {p.key: p.value for p in onnx.load(str(exported)).metadata_props}
    props.update({"image_size": str(size), "embedding_dim": str(dim)})
    props.update({k: str(v) for k, v in declared.items()})
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("output, message", [("nan", "non-finite"), ("raw", "not L2-normalized"), ("flat", "shape")])
def test_encoder__an_output_that_is_not_unit_vectors_of_the_declared_shape_is_refused(
    exported, tmp_path, output, message
):
    good = OnnxEncoder(_tiny_encoder(tmp_path / "good.onnx", exported[0], "unit"), device="cpu", threads=1)
    pixels = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
    np.testing.assert_allclose(np.linalg.norm(good.embed(pixels), axis=1), 1, atol=1e-5)
    path = _tiny_encoder(tmp_path / f"{output}.onnx", exported[0], output)
    if output == "flat":  # a graph whose output is 1-D is refused when opened
        with pytest.raises(ArtifactError, match="graph output has shape"):
            OnnxEncoder(path, device="cpu", threads=1)
        return
    bad = OnnxEncoder(path, device="cpu", threads=1)
    with pytest.raises(ArtifactError, match=message) as info:
        bad.embed(pixels)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_encoder__declared_sizes_must_fit_the_graph_and_stay_bounded(exported, tmp_path):
    with pytest.raises(ArtifactError, match="graph input has shape"):  # declares 16 px, the graph takes 8
        OnnxEncoder(_tiny_encoder(tmp_path / "a.onnx", exported[0], "unit", image_size=16), device="cpu")
    with pytest.raises(ArtifactError, match="graph output has shape"):  # declares 4-d, the graph gives 3
        OnnxEncoder(_tiny_encoder(tmp_path / "b.onnx", exported[0], "unit", embedding_dim=4), device="cpu")
    with pytest.raises(ArtifactError, match="image_size 60000, outside 8-2048"):
        read_encoder_metadata(_tiny_encoder(tmp_path / "c.onnx", exported[0], "unit", image_size=60000))


def test_open_session__preloads_the_cuda_libraries_quietly_where_a_driver_is(monkeypatch, capsys, caplog):
    import logging

    import onnxruntime as ort

    import moco_retrieval.indexer.encoder as encoder_module

    calls = []

    def preload():  # what onnxruntime prints on a machine without the libraries
        calls.append(1)
        print("Failed to load libcurand.so.10: cannot open shared object file")

    monkeypatch.setattr(ort, "preload_dlls", preload)
    for driver in (False, True):
        encoder_module._preload_cuda_libraries.cache_clear()
        monkeypatch.setattr(
            encoder_module.os.path, "exists", lambda p, d=driver: d if p == "/dev/nvidiactl" else os.path.lexists(p)
        )
        with caplog.at_level(logging.DEBUG, logger="moco_retrieval.indexer.encoder"):
            encoder_module._preload_cuda_libraries()
    assert calls == [1]  # only where there is a driver, and once
    assert capsys.readouterr().out == "" and "libcurand" in caplog.text
    encoder_module._preload_cuda_libraries.cache_clear()
