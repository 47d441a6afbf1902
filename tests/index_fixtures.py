"""Fixtures for the ``moco index`` tests: real exported encoders and a generated folder with bad files.

The encoders are exported from untrained (randomly initialised, BN statistics randomised) ResNet-18 32 px
checkpoints: no training needed, embeddings still deterministic and image-dependent.
"""

from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path

import pytest

from moco_retrieval.trainer.demo_data import write_demo_dataset

BAD_FILES = {  # relative path -> what is wrong with it
    "circle/truncated.png": "truncated PNG",
    "circle/empty.png": "zero bytes",
    "square/notes.jpg": "a text file named .jpg",
    "ring/bomb.png": "a decompression bomb (declares 20000 x 20000 pixels)",
}


def bomb_png(small_png: bytes, width: int = 20_000, height: int = 20_000) -> bytes:
    """``small_png`` with its IHDR rewritten to declare ``width`` x ``height`` (a valid CRC): a tiny file that
    claims to be enormous, as a decompression bomb does."""
    assert small_png[12:16] == b"IHDR"
    ihdr = b"IHDR" + struct.pack(">II", width, height) + small_png[24:29]
    return small_png[:8] + small_png[8:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + small_png[33:]


def _export(root: Path, seed: int) -> Path:
    import torch

    from tests._checkpoints import write_checkpoint
    from moco_retrieval.trainer.export import export_encoder

    torch.set_num_threads(1)
    run = write_checkpoint(None, root / f"run{seed}", seed=seed)
    # at the training size: these tests are about indexing (the export's own size rule: test_export.py)
    return export_encoder(run, root / f"encoder{seed}.onnx", verify=False, image_size=32).path


@pytest.fixture(scope="session")
def index_encoder(tmp_path_factory) -> Path:
    """An ``encoder.onnx`` (ResNet-18, 32 px, 512-d)."""
    return _export(tmp_path_factory.mktemp("index_encoder"), seed=11)


@pytest.fixture(scope="session")
def other_encoder(tmp_path_factory) -> Path:
    """A second encoder of the same shape but other weights (another sha256)."""
    return _export(tmp_path_factory.mktemp("other_encoder"), seed=12)


def write_corpus(root: Path, per_class: int = 3) -> dict:
    """A labeled 32 px shapes folder plus a duplicate, bad files, a hidden file and a non-image file.

    Returns:
        {"good": sorted relative paths that must be indexed (duplicate included), "bad": bad paths,
         "duplicate": (original, copy)}.
    """
    write_demo_dataset(root, per_class=per_class, size=32, seed=3)
    good = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.png"))
    original = good[0]
    copy = "star/copy_of_first.png"
    shutil.copyfile(root / original, root / copy)
    png = (root / good[1]).read_bytes()
    (root / "circle/truncated.png").write_bytes(png[: len(png) // 2])
    (root / "circle/empty.png").write_bytes(b"")
    (root / "square/notes.jpg").write_text("not an image at all\n")
    (root / "ring/bomb.png").write_bytes(bomb_png(png))
    (root / ".hidden.png").write_bytes(png)  # hidden: ignored
    (root / "square/readme.txt").write_text("hi")  # not an image extension: ignored
    return {"good": sorted(good + [copy]), "bad": sorted(BAD_FILES), "duplicate": (original, copy)}


class SyntheticEmbedder:
    """An embedder (see ``indexer.embed``) that never opens the files: each path gets a fixed unit vector near one
    of ``clusters`` centres, so index tests exercise the whole build path in milliseconds. Its "encoder" is a
    small placeholder file (copied into the generations like a real encoder; nothing here runs it)."""

    def __init__(self, folder: Path, d: int = 32, clusters: int = 8):
        import hashlib
        from types import SimpleNamespace

        import numpy as np

        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "synthetic.onnx"
        path.write_bytes(f"synthetic encoder, {d}-d".encode())
        self.d = d
        self.centres = np.random.default_rng(0).normal(size=(clusters, d)).astype(np.float32)
        self.encoder = SimpleNamespace(
            path=path,
            sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
            embedding_dim=d,
            provider="synthetic",
            metadata={"arch": "synthetic", "image_size": 32, "embedding_dim": d},
        )
        self.calls: list[int] = []  # files embedded per call

    def vector(self, rel: str):
        import hashlib

        import numpy as np

        seed = int(hashlib.sha256(rel.encode()).hexdigest()[:16], 16)
        rng = np.random.default_rng(seed)
        x = self.centres[seed % len(self.centres)] + 0.5 * rng.normal(size=self.d).astype(np.float32)
        return (x / np.linalg.norm(x)).astype(np.float32)

    def embed_into(self, entries, shards, progress: bool = False) -> dict:
        import hashlib

        pending = [e for e in entries if shards.lookup(e.path, e.bytes, e.mtime_ns) is None]
        for e in pending:
            shards.add(
                {
                    "path": e.path,
                    "stat_bytes": e.bytes,
                    "mtime_ns": e.mtime_ns,
                    "sha256": hashlib.sha256(f"{e.path}:{e.mtime_ns}".encode()).hexdigest(),
                    "width": 32,
                    "height": 32,
                    "bytes": e.bytes,
                    "error": None,
                },
                self.vector(f"{e.path}:{e.mtime_ns}"),
            )
        shards.flush()
        self.calls.append(len(pending))
        return {
            "embedded": len(pending),
            "resumed": len(entries) - len(pending),
            "embed": 0.0,
            "decode_wait": 0.0,
            "encoder": 0.0,
            "decode_cpu": 0.0,
        }


def touch_files(root: Path, names) -> None:
    """Create empty files (the scan only stats them; a SyntheticEmbedder never reads them)."""
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()


def write_tiny_encoder(path: Path, d: int = 16, image_size: int = 16, seed: int = 0) -> Path:
    """A real, 50 kB ``encoder.onnx`` with our metadata: centred pixels times a fixed random matrix,
    L2-normalized. It loads in milliseconds where an exported ResNet-18 (45 MB) takes most of a second, so
    tests that start ``moco`` many times (the damage matrix) stay fast; nothing about it is learned."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from moco_retrieval.contracts.encoder_format import (
        ENCODER_FORMAT,
        ENCODER_FORMAT_VERSION,
        IMAGENET_MEAN,
        IMAGENET_STD,
        INPUT_NAME,
        OUTPUT_NAME,
        RESIZE_POLICY,
        encode_metadata,
    )

    pixels = image_size * image_size * 3
    weights = np.random.default_rng(seed).normal(size=(pixels, d)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", [INPUT_NAME], ["x"], to=TensorProto.FLOAT),
            helper.make_node("Sub", ["x", "centre"], ["centred"]),
            helper.make_node("Reshape", ["centred", "shape"], ["flat"]),
            helper.make_node("MatMul", ["flat", "weights"], ["projected"]),
            helper.make_node("LpNormalization", ["projected"], [OUTPUT_NAME], axis=1, p=2),
        ],
        "tiny_encoder",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", image_size, image_size, 3])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", d])],
        initializer=[
            numpy_helper.from_array(np.array(127.5, dtype=np.float32), "centre"),
            numpy_helper.from_array(np.array([-1, pixels], dtype=np.int64), "shape"),
            numpy_helper.from_array(weights, "weights"),
        ],
    )
    # IR version 8: onnx 1.23 writes 14 by default, newer than ONNX Runtime 1.31 reads (13)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    meta = encode_metadata(
        {
            "format": ENCODER_FORMAT,
            "format_version": ENCODER_FORMAT_VERSION,
            "image_size": image_size,
            "embedding_dim": d,
            "arch": "tiny-test",
            "moco_version": 2,
            "resize": RESIZE_POLICY,
            "mean": IMAGENET_MEAN,
            "std": IMAGENET_STD,
            "run_id": f"tiny-{seed}",
        }
    )
    onnx.helper.set_model_props(model, meta)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
