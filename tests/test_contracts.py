"""The shared contracts (contracts/): the one image decode, the folder walk rules, the encoder metadata format,
atomic writes, and the import rules between the packages (checked on the source, and in a real process that
imports the serving stack without torch)."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from moco_retrieval.contracts.atomic import (
    atomic_path,
    link_or_copy_atomic,
    write_json_atomic,
    write_text_atomic,
)
from moco_retrieval.contracts.encoder_format import (
    ENCODER_FORMAT,
    ENCODER_FORMAT_VERSION,
    REQUIRED_KEYS,
    decode_metadata,
    encode_metadata,
    validate_metadata,
)
from moco_retrieval.contracts.errors import ArtifactError, DataError, OutputError
from moco_retrieval.contracts.images import (
    BACKGROUND,
    MAX_IMAGE_PIXELS,
    check_image,
    decode_image,
    read_image_bytes,
    walk_image_files,
)

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "moco_retrieval"
PACKAGES = ("contracts", "trainer", "indexer", "serve", "app")
# package -> project packages it may import (at any depth, lazily or not)
ALLOWED = {
    "contracts": set(),
    "trainer": {"contracts"},
    "indexer": {"contracts"},
    "serve": {"contracts", "indexer"},
    "app": {"contracts", "trainer", "indexer", "serve"},
}


def _png(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **save)
    return buffer.getvalue()


def _pattern(width: int = 40, height: int = 30) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float64)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float64)[:, None, None]
    return Image.fromarray(
        np.concatenate(
            [
                np.broadcast_to(x, (height, width, 1)),
                np.broadcast_to(y, (height, width, 1)),
                np.full((height, width, 1), 90.0),
            ],
            axis=2,
        ).astype(np.uint8)
    )


# -- decode ---------------------------------------------------------------------------------------------------
def test_decode_image__one_line_data_errors(tmp_path):
    png = _png(_pattern())
    (tmp_path / "truncated.png").write_bytes(png[: len(png) // 2])
    (tmp_path / "text.png").write_text("hello")
    (tmp_path / "empty.png").write_bytes(b"")
    cases = [
        (tmp_path / "truncated.png", "not a readable image"),
        (tmp_path / "text.png", "not a readable image"),
        (tmp_path / "empty.png", "empty file"),
        (tmp_path / "nope.png", "image not found"),
        (b"", "empty"),
        (b"GIF89a garbage", "not a readable image"),
        (tmp_path, "a folder, not an image file"),
    ]
    for source, expected in cases:
        with pytest.raises(DataError, match=expected) as info:
            decode_image(source)
        assert "\n" not in str(info.value)
    assert decode_image(png).mode == "RGB" and decode_image(png).size == (40, 30)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decode_image__refuses_decompression_bombs_with_the_projects_limit(tmp_path):
    Image.new("1", (10_000, 9_000)).save(tmp_path / "bomb.png")  # 90 M pixels in a few kB
    with pytest.raises(DataError, match=f"limit {MAX_IMAGE_PIXELS:,}"):
        decode_image(tmp_path / "bomb.png")
    Image.new("1", (20_000, 20_000)).save(tmp_path / "huge.png")  # past Pillow's own guard, which raises on open
    with pytest.raises(DataError, match=f"more than {MAX_IMAGE_PIXELS:,} pixels") as info:
        decode_image(tmp_path / "huge.png")
    assert "178956970" not in str(info.value)
    assert check_image(tmp_path / "huge.png").startswith("too large")


def test_decode_image__sixteen_bit_gray_is_scaled_not_clipped():
    ramp = (np.arange(16, dtype=np.uint32) * 4369).reshape(4, 4)  # 0 .. 65535 in 16 steps
    data = _png(Image.fromarray(ramp.astype(np.uint16)))
    pixels = np.asarray(decode_image(data))
    assert pixels.shape == (4, 4, 3)
    np.testing.assert_array_equal(pixels[..., 0], np.round(ramp * 255 / 65535).astype(np.uint8))
    assert len(np.unique(pixels)) == 16  # not crushed to 0 / 255


def test_decode_image__applies_exif_orientation():
    image = _pattern(40, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": the stored pixels are the upright image rotated 90 CCW
    stored = image.transpose(Image.Transpose.ROTATE_90)
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif, quality=95)
    upright = decode_image(buffer.getvalue())
    assert upright.size == (40, 30)
    diff = np.abs(np.asarray(upright, dtype=np.int16) - np.asarray(image, dtype=np.int16))
    assert diff.mean() < 4  # JPEG noise only


def test_decode_image__transparency_is_composited_on_the_fixed_background():
    rgba = Image.new("RGBA", (8, 8), (10, 200, 30, 0))  # fully transparent, hidden colour green
    rgba.putpixel((0, 0), (10, 200, 30, 255))
    pixels = np.asarray(decode_image(_png(rgba)))
    assert tuple(pixels[5, 5]) == BACKGROUND and tuple(pixels[0, 0]) == (10, 200, 30)
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
    palette.putpixel((0, 0), 0)
    pixels = np.asarray(decode_image(_png(palette, transparency=1)))
    assert tuple(pixels[4, 4]) == BACKGROUND and tuple(pixels[0, 0]) == (0, 0, 0)
    for mode in ("L", "LA", "P", "CMYK", "1"):
        assert decode_image(_png(_pattern().convert(mode)) if mode != "CMYK" else _jpeg_cmyk()).mode == "RGB"


def _jpeg_cmyk() -> bytes:
    buffer = io.BytesIO()
    _pattern().convert("CMYK").save(buffer, format="JPEG")
    return buffer.getvalue()


# -- walk -----------------------------------------------------------------------------------------------------
def test_walk_image_files__every_format_the_decode_reads_is_found_and_decodes(tmp_path):
    image = _pattern(16, 16)  # ICO's smallest size
    for ext, fmt in (
        (".gif", "GIF"),
        (".jfif", "JPEG"),
        (".jpe", "JPEG"),
        (".avif", "AVIF"),
        (".ico", "ICO"),
        (".JPG", "JPEG"),
    ):
        image.save(tmp_path / f"x{ext}", format=fmt)
    found = walk_image_files(tmp_path)
    assert sorted(f.path for f in found) == sorted(
        f"x{ext}" for ext in (".gif", ".jfif", ".jpe", ".avif", ".ico", ".JPG")
    )
    for f in found:
        assert decode_image(tmp_path / f.path).size == (16, 16), f.path


def test_walk_image_files__sorted_labeled_and_only_regular_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / ".hidden").mkdir()
    for rel in ("b/2.png", "b/1.JPG", "a/x.png", "top.png", ".hidden/h.png", "a/.h.png", "a/notes.txt"):
        (tmp_path / rel).write_bytes(b"x")
    os.mkfifo(tmp_path / "a" / "fifo.png")
    os.symlink(tmp_path / "nowhere.png", tmp_path / "a" / "broken.png")
    os.symlink(tmp_path / "a", tmp_path / "b" / "loop")
    found = walk_image_files(tmp_path)
    paths = [f.path for f in found]
    # sorted; hidden names and other extensions ignored; b/loop links to a folder already walked
    assert paths == ["a/broken.png", "a/fifo.png", "a/x.png", "b/1.JPG", "b/2.png", "top.png"]
    by_path = {f.path: f for f in found}
    assert by_path["a/x.png"].label == "a" and by_path["top.png"].label is None
    assert by_path["a/fifo.png"].skip_reason == "a FIFO, not an image file"
    assert by_path["a/broken.png"].skip_reason == "broken symlink"
    assert by_path["a/x.png"].skip_reason is None and by_path["a/x.png"].bytes == 1
    with pytest.raises(DataError, match="image folder not found"):
        walk_image_files(tmp_path / "missing")


def test_read_image_bytes__never_blocks_on_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "x.png")
    with pytest.raises(DataError, match="FIFO"):
        read_image_bytes(tmp_path / "x.png")  # would block forever if it opened the FIFO for reading normally
    with pytest.raises(DataError, match="FIFO"):
        decode_image(tmp_path / "x.png")
    (tmp_path / "big.png").write_bytes(b"x" * 100)
    with pytest.raises(DataError, match="too large"):
        read_image_bytes(tmp_path / "big.png", max_bytes=10)


# -- encoder metadata -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, shown",
    [
        ("cats/tabby 01.png", "cats/tabby 01.png"),  # printable ASCII: the fast path, returned as it is
        ("bad\tname.png", "bad\\tname.png"),  # ASCII with a control character: escaped
        ("caf\u00e9/\u732b.png", "caf\u00e9/\u732b.png"),  # valid UTF-8 beyond ASCII: as it is
        (os.fsdecode(b"caf\xe9.png"), "caf\\xe9.png"),  # a byte that is not UTF-8 (a lone surrogate): \xNN
        ("line\u2028sep", "line\\u2028sep"),  # a Unicode line separator: escaped
        (None, None),
    ],
)
def test_display_name__one_printable_line_fast_for_plain_ascii(name, shown):
    from moco_retrieval.contracts.filenames import display_name

    assert display_name(name) == shown


def test_encoder_metadata__round_trips_and_validates():
    meta = {
        "format": ENCODER_FORMAT,
        "format_version": ENCODER_FORMAT_VERSION,
        "image_size": 32,
        "embedding_dim": 512,
        "arch": "resnet18",
        "moco_version": 2,
        "resize": "shorter_side_center_crop",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "run_id": "r1",
    }
    props = encode_metadata(meta)
    assert all(isinstance(v, str) for v in props.values())
    assert decode_metadata(props) == meta
    assert validate_metadata(props, "x.onnx") == meta
    for broken, message in (
        (dict(props, format="other"), "not a moco-retrieval encoder"),
        ({k: v for k, v in props.items() if k != "image_size"}, "lacks encoder metadata"),
        (dict(props, image_size="big"), "malformed"),
        (dict(props, format_version="99"), "upgrade moco-retrieval"),
        (dict(props, resize="stretch"), "resize policy"),
    ):
        with pytest.raises(ArtifactError, match=message):
            validate_metadata(broken, "x.onnx")
    assert set(REQUIRED_KEYS) <= set(props)


# -- atomic writes --------------------------------------------------------------------------------------------
def test_atomic_write__a_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    write_json_atomic(target, {"v": 1, "a": [1]}, indent=None)  # compact, for programs
    assert target.read_text() == '{"a":[1],"v":1}\n'
    write_json_atomic(target, {"v": 1})  # indented, keys sorted, for people
    assert target.read_text() == '{\n  "v": 1\n}\n'
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash while writing")
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_text_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # the usual mode, not mkstemp's owner-only 0600
    link_or_copy_atomic(target, tmp_path / "copy.json")
    assert (tmp_path / "copy.json").read_text() == "new\n"
    with pytest.raises(OutputError, match="cannot write"):
        write_text_atomic(tmp_path / "missing-folder" / "x", "x")


# -- import rules ---------------------------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    """The top-level names a file imports; the project's own packages as ``trainer``, ``indexer`` ... (their
    import name is ``moco_retrieval.trainer`` ...). A bare top-level ``trainer`` is reported as ``bare:trainer``."""
    tree = ast.parse(path.read_text(), str(path))
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    names = set()
    for module in modules:
        parts = module.split(".")
        if parts[0] == NAMESPACE and len(parts) > 1:
            names.add(parts[1])
        else:
            names.add(f"bare:{parts[0]}" if parts[0] in PACKAGES else parts[0])
    return names


def test_packages__import_only_downward():
    bad = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            imported = _imports(path)
            used = imported & set(PACKAGES) - {package}
            for other in sorted(used - ALLOWED[package]):
                bad.append(f"{path.relative_to(REPO)} imports {other}")
            bad.extend(
                f"{path.relative_to(REPO)} imports {name[5:]} outside {NAMESPACE}"
                for name in sorted(imported)
                if name.startswith("bare:")
            )
    assert not bad, bad


def test_benches__never_import_the_tests():
    bad = [str(path.relative_to(REPO)) for path in sorted((REPO / "bench").rglob("*.py")) if "tests" in _imports(path)]
    assert not bad, bad


def test_tests_and_benches__import_the_project_by_its_one_name():
    bad = [
        f"{path.relative_to(REPO)} imports {name[5:]}"
        for folder in ("tests", "bench", NAMESPACE)
        for path in sorted((REPO / folder).rglob("*.py"))
        for name in sorted(_imports(path))
        if name.startswith("bare:")
    ]
    assert not bad, bad


def test_contracts__import_nothing_heavy():
    heavy = {"torch", "torchvision", "timm", "onnx", "onnxruntime", "faiss", "lmdb", "gradio", "fastapi"}
    for path in sorted((REPO / "contracts").rglob("*.py")):
        assert not _imports(path) & heavy, path


def test_serving_stack__imports_without_torch_in_a_real_process():
    modules = [
        f"moco_retrieval.{name}"
        for name in (
            "contracts.errors",
            "contracts.images",
            "contracts.encoder_format",
            "contracts.atomic",
            "contracts.knn",
            "indexer.build",
            "indexer.index_dir",
            "serve.engine",
            "serve.http",
            "app.cli",
            "app.server",
            "app.gradio_app",
            "app.cmd_serve",
            "app.cmd_index",
            "trainer.config",
            "trainer.imagefolder",
            "trainer.demo_data",
        )
    ]
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "from moco_retrieval.app.cli import build_parser\nbuild_parser()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'timm'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
