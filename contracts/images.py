"""Image files, one set of rules for every stage: which files are images, how a folder is walked, and the one
function that decodes an image to RGB pixels. Pure Python + Pillow (no torch).

Folder rules (``moco train``, ``moco index``, ``moco export``'s verification images and ``moco eval`` all
walk folders with :func:`walk_image_files`):

- recursive; the result is sorted by relative path (``/``-separated), so every run sees the same order;
- image files are those whose name ends in one of :data:`IMAGE_EXTENSIONS` (case-insensitive); hidden files
  and folders (name starts with ``.``) are ignored;
- symlinks are followed: a linked file is found under the link's path, a linked folder is walked once (a
  second link to the same folder, or a loop, is not walked again); a broken link is reported as skipped;
- only regular files are images: a FIFO, socket or device named ``x.png`` is reported as skipped and never
  opened (opening a FIFO blocks forever);
- the label is the first-level subfolder (``root/cat/x.jpg`` -> ``cat``); files directly under the root have
  none.

Decoding (:func:`decode_image`, the same in training, indexing and serving): images over
:data:`MAX_IMAGE_PIXELS` are refused before their pixels are allocated; EXIF orientation is applied;
16-bit grayscale is scaled to 8 bits (not clipped); transparency (alpha channels, palette or grayscale
transparency) is composited on :data:`BACKGROUND`; everything else is converted to RGB.
"""
from __future__ import annotations

import io
import logging
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageOps

from contracts.errors import DataError

LOG = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
# The largest image any stage decodes (Pillow's own bomb guard is twice its default of this value).
MAX_IMAGE_PIXELS = 89_478_485
# Transparent pixels are shown over this colour (RGB), in every stage.
BACKGROUND = (255, 255, 255)

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


# -- finding files --------------------------------------------------------------------------------------------
def is_hidden(name: str) -> bool:
    return name.startswith(".")


def is_image_name(name: str) -> bool:
    """True for a visible file name with an image extension (the content is checked when decoded)."""
    return not is_hidden(name) and name.lower().endswith(IMAGE_EXTENSIONS)


@dataclass(frozen=True)
class FoundFile:
    """One image-named file of a folder walk.

    ``path`` is relative to the root, ``/``-separated; ``label`` the first-level subfolder (``None`` at the
    root); ``bytes`` and ``mtime_ns`` come from ``stat`` (of a link's target). ``skip_reason`` is set, and the
    file must not be opened, when it is not a readable regular file.
    """

    path: str
    label: str | None
    bytes: int
    mtime_ns: int
    skip_reason: str | None = None


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def walk_image_files(root: str | os.PathLike) -> list[FoundFile]:
    """Every image-named file under ``root`` by the folder rules above, sorted by relative path.

    Reads only directory entries and ``stat`` (never file contents), so rescanning millions of files is cheap.

    Raises:
        DataError: ``root`` is missing or not a folder.
    """
    return sorted(iter_image_files(root), key=lambda f: f.path)


def iter_image_files(root: str | os.PathLike) -> Iterator[FoundFile]:
    """The files of :func:`walk_image_files` as they are found (each folder's entries sorted, folders in walk
    order), for callers that need only the first few.

    Raises:
        DataError: ``root`` is missing or not a folder.
    """
    root = Path(root)
    if not root.exists():
        raise DataError(f"image folder not found: {root}")
    if not root.is_dir():
        raise DataError(f"not a folder: {root}")
    seen_dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=_log_walk_error):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop or a second link to the same folder
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
        rel_dir = Path(os.path.relpath(dirpath, root)).as_posix()
        label = None if rel_dir == "." else rel_dir.split("/")[0]
        for name in sorted(filenames):
            if not is_image_name(name):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            try:
                st = os.stat(os.path.join(dirpath, name))  # follows a symlink to its target
            except FileNotFoundError:
                yield FoundFile(rel, label, 0, 0, "broken symlink")
                continue
            except OSError as exc:
                yield FoundFile(rel, label, 0, 0, f"cannot stat ({exc.strerror or exc})")
                continue
            reason = None if stat.S_ISREG(st.st_mode) else f"{_file_kind(st.st_mode)}, not an image file"
            yield FoundFile(rel, label, st.st_size, st.st_mtime_ns, reason)


def find_image_file(root: str | os.PathLike, rel: str) -> FoundFile | None:
    """The one file ``root / rel`` as the walk would report it, or ``None`` when the walk would not list it
    (not an image name, a hidden component, or no such file): for updates that name their changed files
    instead of rescanning the folder."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts or any(is_hidden(p) for p in parts):
        return None
    if not is_image_name(parts[-1]):
        return None
    rel = Path(rel).as_posix()
    label = parts[0] if len(parts) > 1 else None
    try:
        st = os.stat(Path(root) / rel)
    except FileNotFoundError:
        return FoundFile(rel, label, 0, 0, "broken symlink") if os.path.islink(Path(root) / rel) else None
    except OSError as exc:
        return FoundFile(rel, label, 0, 0, f"cannot stat ({exc.strerror or exc})")
    reason = None if stat.S_ISREG(st.st_mode) else f"{_file_kind(st.st_mode)}, not an image file"
    return FoundFile(rel, label, st.st_size, st.st_mtime_ns, reason)


def _log_walk_error(exc: OSError) -> None:
    LOG.warning("cannot list %s: %s", exc.filename, exc.strerror)


def no_images_message(root: str | os.PathLike, skipped: int = 0) -> str:
    """The one-line error for a folder without a usable image."""
    extra = f" ({skipped} unreadable files skipped)" if skipped else ""
    return f"no readable images in {root}{extra}; expected files ending in {', '.join(IMAGE_EXTENSIONS)}"


# -- reading and decoding -------------------------------------------------------------------------------------
MAX_FILE_BYTES = 1 << 30  # files over 1 GiB are refused before they are read into memory


def read_image_bytes(path: str | os.PathLike, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of an image file, refusing what is not a regular file without blocking on it.

    The file is opened non-blocking and checked with ``fstat`` on the open descriptor, so a FIFO that took a
    file's place after the folder was scanned cannot hang the reader.

    Raises:
        DataError: missing, not a regular file, empty, over ``max_bytes``, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataError(f"image not found: {path}") from None
    except OSError as exc:
        raise DataError(f"cannot read ({exc.strerror or exc})") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{_file_kind(st.st_mode)}, not an image file")
        if st.st_size > max_bytes:
            raise DataError(f"file too large ({st.st_size} bytes, limit {max_bytes})")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise DataError(f"cannot read ({exc.strerror or exc})") from exc
    if not data:
        raise DataError("empty file")
    if len(data) > max_bytes:
        raise DataError(f"file too large (more than {max_bytes} bytes)")
    return data


def _open_source(source: str | os.PathLike | bytes) -> tuple[str, object]:
    """``(name for messages, what Image.open takes)``; refuses empty, missing and non-regular files."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise DataError("empty file")
        return "image data", io.BytesIO(data)
    name = str(source)
    try:
        st = os.stat(source)
    except FileNotFoundError:
        raise DataError(f"image not found: {name}") from None
    except OSError as exc:
        raise DataError(f"cannot read {name}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{name}: {_file_kind(st.st_mode)}, not an image file")
    if st.st_size == 0:
        raise DataError(f"{name}: empty file")
    return name, source


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB copy of ``image``: 16-bit grayscale scaled to 8 bits, transparency composited on BACKGROUND."""
    if image.mode in _SIXTEEN_BIT_MODES:
        # Pillow's convert("L") clips 16-bit values at 255 (a 16-bit scan becomes black and white): scale instead
        values = np.asarray(image, dtype=np.float64).clip(0, 65535)
        image = Image.fromarray((values * (255.0 / 65535.0) + 0.5).astype(np.uint8), mode="L")
    elif image.mode == "F":
        image = Image.fromarray(np.asarray(image, dtype=np.float64).clip(0, 255).round().astype(np.uint8), mode="L")
    has_alpha = image.mode in _ALPHA_MODES or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _upright(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag (a camera's portrait shot stored sideways); a broken EXIF block is ignored."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception as exc:  # Pillow raises several types on malformed EXIF; the pixels are still good
        LOG.debug("ignoring unreadable EXIF orientation: %s", exc)
        return image


def decode_image(source: str | os.PathLike | bytes) -> Image.Image:
    """Decode an image file (or its bytes) fully, upright and in RGB (see the module docstring).

    Raises:
        DataError: missing file, not a regular file, empty, corrupt or truncated data, not an image, or more
            than ``MAX_IMAGE_PIXELS`` pixels (refused before decoding). The message is one line.
    """
    name, opener = _open_source(source)
    try:
        with warnings.catch_warnings():  # images over the limit are refused below; no warning per file
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(opener) as im:
                width, height = im.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise DataError(f"{name}: too large ({width}x{height} pixels, limit {MAX_IMAGE_PIXELS:,})")
                im.load()
                return to_rgb(_upright(im))
    except Image.DecompressionBombError as exc:
        raise DataError(f"{name}: too large (more than {MAX_IMAGE_PIXELS:,} pixels)") from exc
    except Image.UnidentifiedImageError as exc:  # its text holds the repr of our file object: say it plainly
        raise DataError(f"{name}: not a readable image (unknown or corrupt format)") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise DataError(f"{name}: not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]) from exc


def check_image(path: str | os.PathLike) -> str | None:
    """``None`` if the file is a readable image, else a one-line reason it is not (without the path).

    Reads the header and verifies the file (for PNG that reads its chunks to the end and catches most
    truncation) without decoding pixels; refuses images over ``MAX_IMAGE_PIXELS``.
    """
    try:
        name, opener = _open_source(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(opener) as im:
                width, height = im.size
                if width * height > MAX_IMAGE_PIXELS:
                    return f"too large ({width}x{height} pixels, limit {MAX_IMAGE_PIXELS:,})"
                im.verify()
    except DataError as exc:
        return str(exc).replace(f"{path}: ", "")
    except Image.DecompressionBombError:
        return f"too large (more than {MAX_IMAGE_PIXELS:,} pixels)"
    except Image.UnidentifiedImageError:
        return "not a readable image (unknown or corrupt format)"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return f"not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]
    return None
