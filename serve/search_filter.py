"""What a search may return, by what the metadata knows: :class:`SearchFilter`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.indexer.records import ItemRecord


@dataclass(frozen=True)
class SearchFilter:
    """What the results of a search may be, by what the metadata knows.

    Attributes:
        labels: allowed labels (any of them); empty: any item, labeled or not.
        path_prefix: the relative path starts with this (a folder: ``"shoes/"``).
        min_width, max_width, min_height, max_height: image size range in pixels (inclusive).
        exclude: ids never returned.

    Labels, the prefix and the excluded ids become a FAISS ``IDSelector`` over the base and the delta
    (:meth:`serve.generation.ServedGeneration.id_filter`); the size range is checked on the records read for the
    results, searching deeper while fewer than k pass.
    """

    labels: tuple[str, ...] = ()
    path_prefix: str | None = None
    min_width: int | None = None
    max_width: int | None = None
    min_height: int | None = None
    max_height: int | None = None
    exclude: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("min_width", "max_width", "min_height", "max_height"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0):
                raise ConfigError(f"{name} must be a whole number of pixels, 0 or more, got {value!r}")
        for low, high in (("min_width", "max_width"), ("min_height", "max_height")):
            if (
                getattr(self, low) is not None
                and getattr(self, high) is not None
                and getattr(self, low) > getattr(self, high)
            ):
                raise ConfigError(f"{low} ({getattr(self, low)}) is larger than {high} ({getattr(self, high)})")
        object.__setattr__(self, "labels", tuple(self.labels or ()))
        object.__setattr__(self, "exclude", tuple(int(i) for i in (self.exclude or ())))
        object.__setattr__(self, "path_prefix", self.path_prefix or None)

    @property
    def sized(self) -> bool:
        return any(v is not None for v in (self.min_width, self.max_width, self.min_height, self.max_height))

    def accepts(self, rec: ItemRecord) -> bool:
        """Whether a record's image size is in the range (the id conditions are the selector's)."""
        if not self.sized:
            return True
        w, h = rec.width, rec.height
        return (
            (self.min_width is None or w >= self.min_width)
            and (self.max_width is None or w <= self.max_width)
            and (self.min_height is None or h >= self.min_height)
            and (self.max_height is None or h <= self.max_height)
        )

    def __bool__(self) -> bool:
        return bool(self.labels or self.path_prefix or self.exclude or self.sized)
