"""The fault matrix: one generated file (or folder, link, FIFO, socket) per hostile kind, with the outcome each
must have.

:func:`write_fault_folder` writes every :data:`CASES` entry under one folder, next to a few good images.
Each case says what ``moco index`` must do with it: ``indexed``, ``skipped`` with a reason that contains
``reason``, or ``ignored`` (never looked at: hidden names, other extensions). Cases with ``upload`` set are
also sent to ``POST /api/search``, which must answer that status (``message`` in its error).

Everything is small (the largest file is a 6000x4000 JPEG of one colour, 100 kB) and generated here.
"""

from __future__ import annotations

import io
import os
import socket
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from moco_retrieval.contracts.images import MAX_IMAGE_PIXELS

NON_UTF8 = os.fsdecode(b"caf\xe9.png")  # a Latin-1 name: not valid UTF-8
NFC = "\u00e9t\u00e9.png"  # été.png, composed
NFD = "e\u0301te\u0301.png"  # été.png, decomposed: another name, another file
BAD_NAME = os.fsdecode(b"bad\xff\nname.png")  # not UTF-8 and a newline, unreadable: printed in the summary
DEEP = "/".join(["d" * 200, "e" * 200, "x" * 150 + ".png"])  # 555 bytes: over LMDB's 511-byte key limit


def _pattern(width: int = 32, height: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3)
    y, x = np.mgrid[0:height, 0:width]
    img = (base + 90 * np.sin(x[..., None] / 5.0 + y[..., None] / 7.0 + np.arange(3))) % 256
    return Image.fromarray(img.astype(np.uint8))


def encode(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small valid PNG whose header claims ``width`` x ``height`` (a decompression bomb's shape)."""
    data = bytearray(encode(Image.new("L", (8, 8)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": stored sideways
    return encode(_pattern(40, 30).transpose(Image.Transpose.ROTATE_90), "JPEG", exif=exif, quality=95)


def _gray16() -> bytes:
    ramp = (np.arange(32 * 32, dtype=np.uint32) * 64).reshape(32, 32).astype(np.uint16)
    return encode(Image.fromarray(ramp), "PNG")


def _palette_transparent() -> bytes:
    image = _pattern().convert("P")
    return encode(image, "PNG", transparency=0)


def _animated(fmt: str) -> bytes:
    frames = [_pattern(seed=i) for i in range(3)]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


def _bad_crc() -> bytes:
    data = bytearray(encode(_pattern(), "PNG"))
    data[29] ^= 0xFF  # IHDR checksum
    return bytes(data)


def _write(data: bytes | Callable[[], bytes]) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(data() if callable(data) else data)

    return make


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))  # the file stays after the socket is closed
    sock.close()


def _link(target: str | Callable[[Path], str]) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        os.symlink(target(path) if callable(target) else target, path)

    return make


def _outside(path: Path) -> str:
    outside = path.parent.parent / "outside.png"  # next to the image folder, not in it
    outside.write_bytes(encode(_pattern(seed=9), "PNG"))
    return str(outside)


def _loop(path: Path) -> None:
    os.symlink(path.parent / "loop_b.png", path)
    os.symlink(path, path.parent / "loop_b.png")


def _folder_named_png(path: Path) -> None:
    path.mkdir()
    (path / "inside.png").write_bytes(encode(_pattern(seed=5), "PNG"))


def _hidden_folder(path: Path) -> None:
    path.mkdir()
    (path / "x.png").write_bytes(encode(_pattern(seed=6), "PNG"))


@dataclass(frozen=True)
class Case:
    path: str  # relative to the folder (a str that may hold surrogates: see NON_UTF8)
    make: Callable[[Path], None]  # creates it at the given absolute path
    expect: str  # indexed | skipped | ignored
    reason: str = ""  # for skipped: a substring of the reason
    upload: int | None = None  # status of POST /api/search with this file's bytes (None: not uploaded)
    message: str = ""  # a substring of the upload's error


_TRUNCATED_PNG = encode(_pattern(64, 64, seed=2), "PNG")[:300]
_TRUNCATED_JPEG = encode(_pattern(64, 64, seed=3), "JPEG", quality=90)[:600]

CASES = [
    Case("ok.png", _write(encode(_pattern(), "PNG")), "indexed", upload=200),
    Case("UPPER.JPG", _write(encode(_pattern(seed=1), "JPEG")), "indexed"),
    Case("bitmap.bmp", _write(encode(_pattern(seed=2), "BMP")), "indexed"),
    Case("scan.tiff", _write(encode(_pattern(seed=3), "TIFF")), "indexed"),
    Case("photo.webp", _write(encode(_pattern(seed=4), "WEBP")), "indexed"),
    Case("truncated.png", _write(_TRUNCATED_PNG), "skipped", "image file is truncated", 400, "image file is truncated"),
    Case("truncated.jpg", _write(_TRUNCATED_JPEG), "skipped", "Truncated File Read", 400, "Truncated File Read"),
    Case(
        "corrupt.png",
        _write(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4),
        "skipped",
        "unknown or corrupt format",
        400,
        "unknown or corrupt format",
    ),
    Case("bad_crc.png", _write(_bad_crc), "skipped", "unknown or corrupt format", 400, "unknown or corrupt format"),
    Case("empty.png", _write(b""), "skipped", "empty file", 400, "empty"),
    Case(
        "text.jpg",
        _write(b"just some notes, not a picture\n"),
        "skipped",
        "unknown or corrupt format",
        400,
        "unknown or corrupt format",
    ),
    Case(
        "page.png",
        _write(b"<!DOCTYPE html><html><body>404 not found</body></html>\n"),
        "skipped",
        "unknown or corrupt format",
        400,
        "unknown or corrupt format",
    ),
    Case(
        "gif_garbage.png",
        _write(b"GIF89a" + b"\xff\x00garbage" * 20),
        "skipped",
        "unknown or corrupt format",
        400,
        "unknown or corrupt format",
    ),
    Case(
        "bomb.png",
        _write(png_claiming(20_000, 20_000)),
        "skipped",
        f"more than {MAX_IMAGE_PIXELS:,} pixels",
        400,
        f"more than {MAX_IMAGE_PIXELS:,} pixels",
    ),
    Case(
        "bomb_90m.png",
        _write(png_claiming(10_000, 9_000)),
        "skipped",
        f"10000x9000 pixels, limit {MAX_IMAGE_PIXELS:,}",
        400,
        f"limit {MAX_IMAGE_PIXELS:,}",
    ),
    Case(
        "line_1x250000.png",
        _write(lambda: encode(Image.new("L", (1, 250_000)), "PNG")),
        "skipped",
        "too elongated (1x250000 pixels, aspect ratio limit 1:100)",
        400,
        "too elongated",
    ),
    Case(
        "zero_width.png",
        _write(png_claiming(0, 16)),
        "skipped",
        "unknown or corrupt format",
        400,
        "unknown or corrupt format",
    ),
    Case("gray16.png", _write(_gray16), "indexed", upload=200),
    Case("exif_rotated.jpg", _write(_exif_rotated), "indexed", upload=200),
    Case("cmyk.jpg", _write(lambda: encode(_pattern(seed=7).convert("CMYK"), "JPEG")), "indexed", upload=200),
    Case("palette_transparent.png", _write(_palette_transparent), "indexed", upload=200),
    Case("animated.png", _write(lambda: _animated("PNG")), "indexed", upload=200),
    Case("animated.webp", _write(lambda: _animated("WEBP")), "indexed", upload=200),
    Case(
        "huge_valid.jpg",
        _write(lambda: encode(Image.new("RGB", (6000, 4000), (90, 140, 200)), "JPEG")),
        "indexed",
        upload=200,
    ),
    Case("fifo.png", _fifo, "skipped", "a FIFO, not an image file"),
    Case("socket.png", _socket, "skipped", "a socket, not an image file"),
    Case("devnull.png", _link("/dev/null"), "skipped", "a character device, not an image file"),
    Case("broken_link.png", _link("does-not-exist.png"), "skipped", "broken symlink"),
    Case("loop_a.png", _loop, "skipped", "Too many levels of symbolic links"),
    Case("loop_b.png", lambda path: None, "skipped", "Too many levels of symbolic links"),  # made by loop_a
    Case("escape.png", _link(_outside), "skipped", "outside the image folder"),
    Case("inner_link.png", _link("ok.png"), "indexed"),  # a link inside the folder: indexed, a duplicate of ok.png
    Case("copy_of_ok.png", _write(encode(_pattern(), "PNG")), "indexed"),
    Case(NON_UTF8, _write(encode(_pattern(seed=10), "PNG")), "indexed"),
    Case("new\nline.png", _write(encode(_pattern(seed=11), "PNG")), "indexed"),
    Case("l" * 250 + ".png", _write(encode(_pattern(seed=12), "PNG")), "indexed"),
    Case(DEEP, _write(encode(_pattern(seed=13), "PNG")), "indexed"),
    Case(NFC, _write(encode(_pattern(seed=14), "PNG")), "indexed"),
    Case(NFD, _write(encode(_pattern(seed=15), "PNG")), "indexed"),
    Case("folder.png", _folder_named_png, "ignored"),  # a folder, walked as one: its inside.png is indexed
    Case("folder.png/inside.png", lambda path: None, "indexed"),
    Case(BAD_NAME, _write(b"neither a picture nor valid UTF-8 in its name"), "skipped", "unknown or corrupt format"),
    Case(".hidden.png", _write(encode(_pattern(seed=16), "PNG")), "ignored"),
    Case(".hidden_folder", _hidden_folder, "ignored"),
    Case("notes.txt", _write(b"not an image extension\n"), "ignored"),
]


def write_fault_folder(root: Path) -> dict[str, Case]:
    """Every case under ``root`` (created), plus ``selfloop`` -> ``.`` (a folder link loop, walked once).

    Returns:
        relative path -> case.
    """
    root.mkdir(parents=True)
    for case in CASES:
        path = root / case.path
        path.parent.mkdir(parents=True, exist_ok=True)
        case.make(path)
    os.symlink(".", root / "selfloop")
    return {case.path: case for case in CASES}
