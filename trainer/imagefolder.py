"""The training view of an image folder: the images that decode, their labels, and the files skipped.

The walk and decode rules are :mod:`contracts.images` (the same as ``moco index``); this module adds the
checks training needs up front: every file is verified before the run starts, so an unreadable one is listed
in the run directory's ``skipped_files.txt`` instead of failing an epoch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.images import check_image, no_images_message, walk_image_files

LOG = logging.getLogger(__name__)


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


def scan_image_folder(root: str | os.PathLike, verify: bool = True) -> ImageList:
    """List the images under ``root`` (the rules of :func:`contracts.images.walk_image_files`).

    Args:
        root: folder to scan recursively.
        verify: check each file with :func:`contracts.images.check_image` and move unreadable ones to
            ``skipped``.

    Raises:
        DataError: ``root`` is missing or not a folder, or holds no readable image at all.
    """
    root = Path(root)
    result = ImageList(root=root)
    for found in walk_image_files(root):
        reason = found.skip_reason or (check_image(root / found.path) if verify else None)
        if reason is not None:
            LOG.warning("skipping %s: %s", found.path, reason)
            result.skipped.append((found.path, reason))
            continue
        result.paths.append(found.path)
        result.labels.append(found.label)
    if not result.paths:
        raise DataError(no_images_message(root, len(result.skipped)))
    return result
