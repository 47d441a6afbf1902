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
- with ``confine=True`` (``moco index``, whose server serves only files inside the folder) a file whose real
  path, symlinks resolved, lies outside the folder is reported as skipped;
- names are kept as the file system has them (:mod:`contracts.filenames`: not-UTF-8 bytes too);
- the label is the first-level subfolder (``root/cat/x.jpg`` -> ``cat``); files directly under the root have
  none.

Decoding (:func:`decode_image`, the same in training, indexing and serving): the memory a decode may take is
bounded from the header, before any pixel is allocated: images over :data:`MAX_IMAGE_PIXELS` pixels, or more
elongated than :data:`MAX_ASPECT_RATIO` (a 1x250,000 PNG of 565 bytes would otherwise be resized to
32x8,000,000), are refused. When the caller knows the size it needs (``target_size``: indexing and serving),
a JPEG is decoded reduced (``Image.draft``: the decoder's DCT scaling by 1/2, 1/4 or 1/8 per side) to no less
than :data:`REDUCING_GAP` times the target on the shorter side: a 12-megapixel photo then takes up to 1/64 of
the memory and decodes 4-8x faster, within 1-2 grey levels of the full decode after the encoder's resize
(measured). Other formats have no reduced decode; an ``Image.reduce`` after it would save no decode memory
and its partial edge blocks shift the center crop (measured: up to 28 grey levels at 32 px), so they are
decoded whole and the conversions after it work in place or with one extra buffer. EXIF orientation is
applied; 16-bit grayscale is scaled to 8 bits (not clipped); transparency (alpha channels, palette or
grayscale transparency) is composited on :data:`BACKGROUND`; everything else is converted to RGB.
"""

from __future__ import annotations

import io
import logging
import math
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageOps

from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.filenames import display_name

LOG = logging.getLogger(__name__)

# Every raster format the decode reads and the server accepts as a query (GIF: the first frame; ICO: the largest
# size), so nothing a user can search with is silently left out of an index.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".avif", ".ico")
# The largest image any stage decodes (Pillow's own bomb guard is twice its default of this value).
MAX_IMAGE_PIXELS = 89_478_485
# The most elongated image any stage decodes (long side / short side). The encoder's resize keeps the aspect
# and then center-crops a square, so past this a query is mostly resize work on pixels the crop throws away
# (at 1:100 and 224 px: a 224x22,400 intermediate); panoramas (~1:10) and banners (~1:8) are far inside it.
MAX_ASPECT_RATIO = 100
# A reduced JPEG decode keeps at least this many times the target size on its shorter side for the final
# (antialiased) resize (Pillow's thumbnail() uses 2-3); measured on a 4000x3000 JPEG at 32, 96 and 224 px:
# at most 1-2 grey levels from the full decode, mean under 0.25.
REDUCING_GAP = 3.0
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


@dataclass(frozen=True, slots=True)  # slots: a scan of 10M files holds 10M of them
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
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


OUTSIDE_ROOT = "outside the image folder (through a symlink)"


def walk_image_files(
    root: str | os.PathLike, confine: bool = False, not_images: dict[str, int] | None = None
) -> list[FoundFile]:
    """Every image-named file under ``root`` by the folder rules above, sorted by relative path.

    Reads only directory entries and ``stat`` (never file contents), so rescanning millions of files is cheap.
    ``confine``: report files whose real path is outside ``root`` as skipped (:data:`OUTSIDE_ROOT`).
    ``not_images``: counts the visible files passed over for their extension, by lower-cased extension
    (``""`` for none), so that a summary can say what was not looked at.

    Raises:
        DataError: ``root`` is missing or not a folder.
    """
    return sorted(iter_image_files(root, confine, not_images), key=lambda f: f.path)


def is_inside(real_path: str, real_root: str) -> bool:
    """True when ``real_path`` is ``real_root`` or below it (both already resolved with ``os.path.realpath``)."""
    return real_path == real_root or real_path.startswith(real_root.rstrip(os.sep) + os.sep)


def iter_image_files(
    root: str | os.PathLike, confine: bool = False, not_images: dict[str, int] | None = None
) -> Iterator[FoundFile]:
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
    real_root = os.path.realpath(root)
    seen_dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=_log_walk_error):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop or a second link to the same folder
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dir_inside = is_inside(real, real_root)
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
        rel_dir = Path(os.path.relpath(dirpath, root)).as_posix()
        label = None if rel_dir == "." else rel_dir.split("/")[0]
        for name in sorted(filenames):
            if not is_image_name(name):
                if not_images is not None and not is_hidden(name):
                    ext = os.path.splitext(name)[1].lower()
                    not_images[ext] = not_images.get(ext, 0) + 1
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                inside = dir_inside
                if stat.S_ISLNK(st.st_mode):
                    st = os.stat(path)  # the link's target
                    inside = inside and is_inside(os.path.realpath(path), real_root)
            except FileNotFoundError:
                yield FoundFile(rel, label, 0, 0, "broken symlink")
                continue
            except OSError as exc:  # a symlink loop (ELOOP), permissions of a folder on the way
                yield FoundFile(rel, label, 0, 0, f"cannot stat ({exc.strerror or exc})")
                continue
            reason = None if stat.S_ISREG(st.st_mode) else f"{_file_kind(st.st_mode)}, not an image file"
            if reason is None and confine and not inside:
                reason = OUTSIDE_ROOT
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


def _open_regular(path: str | os.PathLike, max_bytes: int):
    """An open binary file for ``path``, refusing what is not a regular file without blocking on it.

    Opened non-blocking and checked with ``fstat`` on the open descriptor, so a FIFO that took a file's place
    after the folder was scanned cannot hang the reader.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataError(f"image not found: {path}") from None
    except OSError as exc:
        raise DataError(f"cannot read ({exc.strerror or exc})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{_file_kind(st.st_mode)}, not an image file")
        if st.st_size > max_bytes:
            raise DataError(f"file too large ({st.st_size} bytes, limit {max_bytes})")
        if st.st_size == 0:
            raise DataError("empty file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_image_bytes(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of an image file, refusing what is not a regular file without blocking on it.

    Args:
        max_bytes: the size limit (default ``MAX_FILE_BYTES``, read at call time like ``check_image`` does).

    Raises:
        DataError: missing, not a regular file, empty, over ``max_bytes``, or unreadable.
    """
    max_bytes = MAX_FILE_BYTES if max_bytes is None else max_bytes
    with _open_regular(path, max_bytes) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            # the size fstat saw plus one byte, then on up to the limit only if the file grew since: asking for
            # max_bytes + 1 at once allocates a 1 GiB buffer per read (73 us against 10 us for a 3 KB PNG)
            data = f.read(min(size, max_bytes) + 1)
            if len(data) > size:
                data += f.read(max_bytes + 1 - len(data))
        except OSError as exc:
            raise DataError(f"cannot read ({exc.strerror or exc})") from exc
    if not data:
        raise DataError("empty file")
    if len(data) > max_bytes:
        raise DataError(f"file too large (more than {max_bytes} bytes)")
    return data


def _read_source(source: str | os.PathLike | bytes) -> tuple[str, bytes]:
    """``(name for messages, encoded bytes)``; refuses empty, missing and non-regular files."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise DataError("empty file")
        return "image data", data
    name = display_name(os.fspath(source))
    try:
        return name, read_image_bytes(source)
    except DataError as exc:
        if str(exc).startswith("image not found"):
            raise DataError(f"image not found: {name}") from None
        raise DataError(f"{name}: {exc}") from None


def check_size(
    width: int, height: int, max_pixels: int = MAX_IMAGE_PIXELS, max_aspect: float = MAX_ASPECT_RATIO
) -> str | None:
    """``None`` when a ``width`` x ``height`` image may be decoded, else the one-line reason it may not."""
    if width < 1 or height < 1:
        return f"no pixels ({width}x{height})"
    if width * height > max_pixels:
        return f"too large ({width}x{height} pixels, limit {max_pixels:,})"
    if max(width, height) > max_aspect * min(width, height):
        return f"too elongated ({width}x{height} pixels, aspect ratio limit 1:{max_aspect:g})"
    return None


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB copy of ``image``: 16-bit grayscale scaled to 8 bits, transparency composited on BACKGROUND."""
    if image.mode in _SIXTEEN_BIT_MODES:
        # Pillow's convert("L") clips 16-bit values at 255 (a 16-bit scan becomes black and white): scale instead,
        # in integers (round half up, as v * 255 / 65535 + 0.5 would): 4 bytes a pixel, not float64's 8
        values = np.asarray(image).clip(0, 65535).astype(np.uint32)
        image = Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), mode="L")
    elif image.mode == "F":
        image = Image.fromarray(np.asarray(image, dtype=np.float32).clip(0, 255).round().astype(np.uint8), mode="L")
    has_alpha = image.mode in _ALPHA_MODES or "transparency" in image.info
    if has_alpha:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, mask=rgba)  # = alpha_composite over the opaque background, with one buffer less
        return canvas
    return image if image.mode == "RGB" else image.convert("RGB")


_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that rotate by 90 degrees


def _upright(image: Image.Image) -> tuple[Image.Image, bool]:
    """Apply the EXIF orientation tag in place (a camera's portrait shot stored sideways); a broken EXIF block
    is ignored. Returns ``(image, whether width and height swapped)``."""
    try:
        swaps = image.getexif().get(0x0112, 1) in _SWAPS_SIDES
        ImageOps.exif_transpose(image, in_place=True)
        return image, swaps
    except Exception as exc:  # Pillow raises several types on malformed EXIF; the pixels are still good
        LOG.debug("ignoring unreadable EXIF orientation: %s", exc)
        return image, False


def _reduction(short_side: int, target_size: int | None) -> float:
    """The scale (<= 1) a reducing decode may apply: the shorter side keeps REDUCING_GAP x the target."""
    if not target_size:
        return 1.0
    return min(1.0, REDUCING_GAP * target_size / short_side)


def decode_image(
    source: str | os.PathLike | bytes,
    *,
    target_size: int | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_aspect: float = MAX_ASPECT_RATIO,
) -> Image.Image:
    """Decode an image file (or its bytes), upright and in RGB (see the module docstring).

    Args:
        target_size: the shorter side the caller will resize to (the encoder's image size). When given, a JPEG
            is decoded reduced (draft) to at least ``REDUCING_GAP`` x this on its shorter side, so the result may
            be smaller than the file; without it, and for other formats, the image is decoded at full size.
        max_pixels, max_aspect: the bounds checked on the header before decoding.

    Returns:
        An RGB image; ``info["source_size"]`` is the upright ``(width, height)`` of the file's image (before
        any reduction).

    Raises:
        DataError: missing file, not a regular file, empty, corrupt or truncated data, not an image, more
            than ``max_pixels`` pixels, or more elongated than ``max_aspect`` (refused before decoding). The
            message is one line.
    """
    name, data = _read_source(source)
    try:
        with warnings.catch_warnings():  # images over the limit are refused below; no warning per file
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # bytes in memory: nothing to close, whatever the result holds
            width, height = im.size
            problem = check_size(width, height, max_pixels, max_aspect)
            if problem is not None:
                raise DataError(f"{name}: {problem}")
            scale = _reduction(min(width, height), target_size)
            if scale < 1.0 and im.format == "JPEG":  # DCT scaling: the decoder itself makes the smaller image
                im.draft(im.mode, (math.ceil(width * scale), math.ceil(height * scale)))
            im.load()
            image, swapped = _upright(im)
            image = to_rgb(image)
            image.info["source_size"] = (height, width) if swapped else (width, height)
            return image
    except DataError:
        raise
    except Image.DecompressionBombError as exc:
        raise DataError(f"{name}: too large (more than {max_pixels:,} pixels)") from exc
    except Image.UnidentifiedImageError as exc:  # its text holds the repr of our file object: say it plainly
        raise DataError(f"{name}: not a readable image (unknown or corrupt format)") from exc
    except MemoryError:
        raise
    except Exception as exc:  # OSError, SyntaxError, ValueError, EOFError, struct.error ...: hostile bytes
        raise DataError(f"{name}: not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]) from exc


def check_image(path: str | os.PathLike) -> str | None:
    """``None`` if the file is a readable image, else a one-line reason it is not (without the path).

    Reads the header and verifies the file (for PNG that reads its chunks to the end and catches most
    truncation) without decoding pixels; refuses what :func:`check_size` refuses.
    """
    try:
        with _open_regular(path, MAX_FILE_BYTES) as f:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(f) as im:
                    problem = check_size(*im.size)
                    if problem is not None:
                        return problem
                    im.verify()
    except DataError as exc:
        return str(exc)
    except Image.DecompressionBombError:
        return f"too large (more than {MAX_IMAGE_PIXELS:,} pixels)"
    except Image.UnidentifiedImageError:
        return "not a readable image (unknown or corrupt format)"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return f"not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]
    return None
