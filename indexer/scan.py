"""Scanning an image folder for indexing: which files, in which order, with which label, size and mtime.

The walk rules are :func:`contracts.images.walk_image_files`, the same for every stage (``moco index --help``
repeats them): recursive and sorted by relative path; image extensions only; hidden names ignored; symlinks
followed, each folder once, but a file that resolves outside the folder is skipped (the server serves only
files inside it); only regular files (a broken link or a FIFO is reported as skipped, never opened); names
kept as the file system has them, not-UTF-8 bytes included (:mod:`contracts.filenames`). The label is the
first-level subfolder, unless a ``path,label`` CSV is given, which then is the only
source of labels.

Reads only directory entries and ``stat`` (never file contents), so rescanning 10 million files is cheap.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from moco_retrieval.contracts.errors import ConfigError, DataError
from moco_retrieval.contracts.images import IMAGE_EXTENSIONS, FoundFile, walk_image_files

LOG = logging.getLogger(__name__)


@dataclass
class ScanResult:
    root: Path
    entries: list[FoundFile]  # the readable ones (no skip reason), labels as this scan gives them
    skipped: list[tuple[str, str]]  # (relative path, reason) for files that cannot even be stat'ed
    not_images: dict[str, int] = field(default_factory=dict)  # extension -> files passed over for it


def read_labels_csv(path: str | os.PathLike) -> dict[str, str]:
    """``path,label`` rows (an optional ``path,label`` header) -> {relative path: label}.

    Raises:
        ConfigError: missing or malformed file.
    """
    labels: dict[str, str] = {}
    try:
        with open(path, newline="") as f:
            for line_no, row in enumerate(csv.reader(f), 1):
                if not row or (line_no == 1 and [c.strip().lower() for c in row[:2]] == ["path", "label"]):
                    continue
                if len(row) != 2:
                    raise ConfigError(f"{path}:{line_no}: expected 'path,label', got {len(row)} columns")
                labels[Path(row[0].strip()).as_posix()] = row[1].strip()  # Path drops a leading "./"
    except FileNotFoundError:
        raise ConfigError(f"labels file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read labels file {path}: {exc}") from exc
    return labels


def scan_folder(root: str | os.PathLike, labels: dict[str, str] | None = None) -> ScanResult:
    """List the image files under ``root`` (see the module docstring for the rules).

    Args:
        root: the image folder.
        labels: optional {relative path: label}; when given, files it does not name are unlabeled.

    Raises:
        DataError: ``root`` is missing, not a folder, or holds no image files.
    """
    root = Path(root)
    entries: list[FoundFile] = []
    skipped: list[tuple[str, str]] = []
    not_images: dict[str, int] = {}
    for found in walk_image_files(root, confine=True, not_images=not_images):
        if found.skip_reason is not None:
            skipped.append((found.path, found.skip_reason))
            continue
        entries.append(found if labels is None else replace(found, label=labels.get(found.path)))
    if not entries:
        raise DataError(
            f"no image files in {root}; expected files ending in {', '.join(IMAGE_EXTENSIONS)}"
            + (f" (found {describe_not_images(not_images)})" if not_images else "")
        )
    LOG.info("scanned %s: %d image files", root, len(entries))
    return ScanResult(root=root, entries=entries, skipped=skipped, not_images=dict(sorted(not_images.items())))


def describe_not_images(not_images: dict[str, int], most: int = 5) -> str:
    """``{".txt": 10, ".json": 2}`` -> ``"12 other files: 10 .txt, 2 .json"`` (the ``most`` commonest)."""
    total = sum(not_images.values())
    common = sorted(not_images.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{n} {ext or '(no extension)'}" for ext, n in common[:most]]
    if len(common) > most:
        parts.append("...")
    return f"{total} other file{'s' if total != 1 else ''}: {', '.join(parts)}"
