"""Scanning an image folder for indexing: which files, in which order, with which label, size and mtime.

Rules (deliberate, documented in ``moco index --help``):

- recursive, sorted by relative path (``/``-separated), so every run sees the same order;
- image files are those ending in one of ``trainer.imagefolder.IMAGE_EXTENSIONS`` (case-insensitive); the
  content is checked later, when the file is decoded;
- hidden files and folders (name starts with ``.``) are ignored;
- symlinks are followed: a linked file is indexed under the link's path, a linked folder is walked once
  (a second link to the same folder, or a loop, is not walked again); a broken link is reported as skipped;
- the label is the first-level subfolder (``root/cat/x.jpg`` -> ``cat``; files directly under the root have
  none), unless a ``path,label`` CSV is given, which then is the only source of labels.

Reads only directory entries and ``stat`` (never file contents), so rescanning 10 million files is cheap.
"""
from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ConfigError, DataError
from trainer.imagefolder import IMAGE_EXTENSIONS

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScanEntry:
    """One image file: ``path`` relative to the root (``/``-separated), its label, size and mtime."""

    path: str
    label: str | None
    bytes: int
    mtime_ns: int


@dataclass
class ScanResult:
    root: Path
    entries: list[ScanEntry]
    skipped: list[tuple[str, str]]  # (relative path, reason) for files that cannot even be stat'ed


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
    if not root.exists():
        raise DataError(f"image folder not found: {root}")
    if not root.is_dir():
        raise DataError(f"not a folder: {root}")
    entries: list[ScanEntry] = []
    skipped: list[tuple[str, str]] = []
    seen_dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=_log_walk_error):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop or a second link to the same folder
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = Path(os.path.relpath(dirpath, root)).as_posix()
        folder_label = None if rel_dir == "." else rel_dir.split("/")[0]
        for name in filenames:
            if name.startswith(".") or not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            try:
                st = os.stat(os.path.join(dirpath, name))  # follows a symlink to its target
            except FileNotFoundError:
                skipped.append((rel, "broken symlink"))
                continue
            except OSError as exc:
                skipped.append((rel, f"cannot stat ({exc.strerror})"))
                continue
            label = labels.get(rel) if labels is not None else folder_label
            entries.append(ScanEntry(rel, label, st.st_size, st.st_mtime_ns))
    entries.sort(key=lambda e: e.path)
    skipped.sort()
    if not entries:
        raise DataError(f"no image files in {root}; expected files ending in {', '.join(IMAGE_EXTENSIONS)}")
    LOG.info("scanned %s: %d image files", root, len(entries))
    return ScanResult(root=root, entries=entries, skipped=skipped)


def _log_walk_error(exc: OSError) -> None:
    LOG.warning("cannot list %s: %s", exc.filename, exc.strerror)
