"""Finding images in a folder tree and checking that they decode. Pure Python + Pillow (no torch).

A folder is scanned recursively in a deterministic (sorted) order. When the images sit in first-level
subfolders, the subfolder name is the image's label (``root/cat/x.jpg`` -> ``cat``); images directly under
the root are unlabeled. Hidden files and folders (names starting with ``.``) are ignored.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from trainer.errors import DataError

LOG = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
# Pillow's decompression-bomb guard raises above 2x this many pixels; we refuse anything above it.
MAX_IMAGE_PIXELS = 89_478_485


@dataclass
class ImageList:
    """The images of a folder: paths relative to ``root``, their labels (``None`` when unlabeled)."""

    root: Path
    paths: list[str] = field(default_factory=list)
    labels: list[str | None] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def classes(self) -> list[str]:
        """Sorted distinct labels (empty when the folder is unlabeled)."""
        return sorted({label for label in self.labels if label is not None})

    def label_indices(self) -> list[int]:
        """Each image's index into ``classes``; -1 for unlabeled images."""
        index = {name: i for i, name in enumerate(self.classes)}
        return [index[label] if label is not None else -1 for label in self.labels]

    def subset(self, keep: list[int]) -> "ImageList":
        return ImageList(self.root, [self.paths[i] for i in keep], [self.labels[i] for i in keep], list(self.skipped))


def check_image(path: str | os.PathLike) -> str | None:
    """Return ``None`` if the file is a readable image, else a one-line reason it is not.

    Opens the header and verifies the file (which reads PNG chunks to the end and catches most truncation),
    and refuses images over ``MAX_IMAGE_PIXELS`` (decompression bombs) without decoding them.
    """
    try:
        if os.path.getsize(path) == 0:
            return "empty file"
        with Image.open(path) as im:
            width, height = im.size
            if width * height > MAX_IMAGE_PIXELS:
                return f"too large ({width}x{height} pixels)"
            im.verify()
    except Image.DecompressionBombError as exc:
        return f"too large ({exc})"
    except (OSError, SyntaxError, ValueError, Image.UnidentifiedImageError) as exc:
        return f"not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]
    return None


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Decode an image fully and convert it to RGB (grayscale, palette and alpha images included).

    Raises:
        OSError: the file is not a decodable image (truncated, corrupt, unknown format).
    """
    with Image.open(path) as im:
        if im.size[0] * im.size[1] > MAX_IMAGE_PIXELS:
            raise OSError(f"image too large ({im.size[0]}x{im.size[1]} pixels)")
        im.load()
        return im.convert("RGB")


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def scan_image_folder(root: str | os.PathLike, verify: bool = True) -> ImageList:
    """List the images under ``root``, sorted, with labels from the first-level subfolder.

    Args:
        root: folder to scan recursively (symlinked folders are followed once).
        verify: check each file with :func:`check_image` and move unreadable ones to ``skipped``.

    Raises:
        DataError: ``root`` is missing or not a folder, or holds no image files at all.
    """
    root = Path(root)
    if not root.exists():
        raise DataError(f"image folder not found: {root}")
    if not root.is_dir():
        raise DataError(f"not a folder: {root}")
    result = ImageList(root=root)
    seen_dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop or a second link to the same folder
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = sorted(d for d in dirnames if not _is_hidden(d))
        rel_dir = os.path.relpath(dirpath, root)
        label = None if rel_dir == "." else Path(rel_dir).parts[0]
        for name in sorted(filenames):
            if _is_hidden(name) or not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            rel = name if rel_dir == "." else os.path.join(rel_dir, name)
            if verify:
                reason = check_image(root / rel)
                if reason is not None:
                    LOG.warning("skipping %s: %s", rel, reason)
                    result.skipped.append((rel, reason))
                    continue
            result.paths.append(rel)
            result.labels.append(label)
    if not result.paths:
        extra = f" ({len(result.skipped)} unreadable files skipped)" if result.skipped else ""
        raise DataError(
            f"no readable images in {root}{extra}; expected files ending in {', '.join(IMAGE_EXTENSIONS)}"
        )
    return result
