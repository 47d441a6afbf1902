"""What the training images are like before anything is decoded: their sizes, from a sample of file headers.

The recipe (:mod:`trainer.recipes`) picks the training size from this, so 28-px images are not upscaled to
224 px, cached at 280 px and trained on at 60x the compute they carry. Reading a header (PIL's lazy
``Image.open``) costs well under a millisecond, so an evenly spread sample of :data:`SURVEY_SAMPLE` files
answers in about a second for any folder size; the sample is fixed by the sorted file list, so the same folder
always gives the same survey.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from moco_retrieval.contracts.images import FoundFile

SURVEY_SAMPLE = 1000  # headers read; the median side of 1,000 draws is within a few pixels of the folder's


@dataclass(frozen=True)
class ImageSurvey:
    """The images' sizes: ``median_side`` is the median of each sampled image's shorter side, in pixels."""

    sampled: int
    median_side: int
    min_side: int
    max_side: int

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"median shorter side {self.median_side} px over {self.sampled} sampled images "
            f"({self.min_side}-{self.max_side} px)"
        )


def evenly_spread(items: list, count: int) -> list:
    """At most ``count`` items of ``items``, evenly spread over it (all of them when there are fewer)."""
    if len(items) <= count:
        return list(items)
    keep = np.unique(np.linspace(0, len(items) - 1, count).round().astype(np.int64))
    return [items[i] for i in keep.tolist()]


def survey_images(root: str | Path, files: list[FoundFile], sample: int = SURVEY_SAMPLE) -> ImageSurvey | None:
    """The sizes of an evenly spread sample of ``files`` (paths relative to ``root``), read from their headers.

    Files whose header cannot be read are passed over (the image cache reports them when it decodes);
    ``None`` when no sampled header was readable.
    """
    sides = []
    for found in evenly_spread(files, sample):
        try:
            with Image.open(Path(root) / found.path) as image:
                sides.append(min(image.size))
        except (OSError, ValueError, Image.DecompressionBombError):
            continue
    if not sides:
        return None
    return ImageSurvey(
        sampled=len(sides), median_side=int(statistics.median(sides)), min_side=min(sides), max_side=max(sides)
    )
