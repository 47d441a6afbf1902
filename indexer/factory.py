"""FAISS factory strings, parsed once: :class:`Factory` answers the questions the index code asks of one.

A factory string (``"IDMap2,Flat"``, ``"IVF1024,PQ64x8np"``, ``"OPQ16_64,IVF1024,Flat"``) is a comma-separated
list of components in FAISS's order: an id map, preprocessing transforms, the coarse quantizer (``IVFn``), the
encoding of the vectors, and a refinement. Substring tests on the whole string answer wrongly (``"PQ" in
"OPQ16_64,IVF1024,Flat"`` is true, yet that index stores float32 codes), so every question is asked of the
parsed components instead, as FAISS's own ``contrib/factory_tools.py`` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_IDMAPS = ("IDMap", "IDMap2")
_PREPROCESSING = re.compile(r"^(OPQ|PCAW?R?|RR|L2norm|ITQ)\d*")
_IVF = re.compile(r"^IVF(\d+)(_.+)?$")
_PQ = re.compile(r"^PQ(\d+)(?:x(\d+))?(np)?$")
_HNSW = re.compile(r"^HNSW(\d+)$")


@dataclass(frozen=True)
class Factory:
    """The components of a FAISS factory string (see the module docstring).

    Attributes:
        text: the string as given.
        id_map: ``"IDMap"`` / ``"IDMap2"`` when wrapped, else ``""``.
        preprocessing: transforms applied before the index (``OPQ16_64``, ``PCA64``, ...).
        coarse: the coarse quantizer (``IVF1024``, ``IVF1024_HNSW32``), else ``""``.
        encoding: how vectors are stored (``Flat``, ``PQ64x8np``, ``HNSW32``, ``SQ8``, ...).
        refine: what follows the encoding (``RFlat``, ``Refine(...)``), else ``""``.
    """

    text: str
    id_map: str
    preprocessing: tuple[str, ...]
    coarse: str
    encoding: str
    refine: str

    @classmethod
    def parse(cls, text: str) -> Factory:
        return _parse(text)

    @property
    def nlist(self) -> int | None:
        """Inverted lists of an ``IVFn`` coarse quantizer, else ``None``."""
        match = _IVF.match(self.coarse)
        return int(match.group(1)) if match else None

    @property
    def is_ivf(self) -> bool:
        return bool(self.coarse)

    @property
    def pq_m(self) -> int | None:
        """Sub-quantizers of a PQ encoding (bytes per vector at 8 bits), else ``None``."""
        match = _PQ.match(self.encoding)
        return int(match.group(1)) if match else None

    @property
    def pq_codes(self) -> bool:
        """The vectors are stored as PQ codes only: lossy, so the full vectors are kept aside (float16 blocks)
        and results are re-ranked with them."""
        return self.pq_m is not None

    @property
    def exact(self) -> bool:
        """Brute force over the vectors themselves: recall is 1 by construction."""
        return not self.is_ivf and not self.preprocessing and self.encoding == "Flat" and not self.refine

    @property
    def kind(self) -> str:
        """``flat``, ``hnsw``, ``ivf`` or ``ivfpq`` for the shapes ``auto`` makes, else ``custom``."""
        if self.preprocessing or self.refine:
            return "custom"
        if self.id_map == "IDMap2" and not self.is_ivf:
            if self.encoding == "Flat":
                return "flat"
            if _HNSW.match(self.encoding):
                return "hnsw"
        if not self.id_map and self.coarse == f"IVF{self.nlist}":  # a flat coarse quantizer
            if self.encoding == "Flat":
                return "ivf"
            if self.pq_codes:
                return "ivfpq"
        return "custom"

    @property
    def codec(self) -> str:
        """The encoding without its bit count (``PQ64`` for ``PQ64x8np``): two indexes of one codec can hold
        each other's vectors' roles after an update even when the bits per code moved with the corpus size."""
        match = _PQ.match(self.encoding)
        return f"PQ{match.group(1)}" if match else self.encoding


@lru_cache(maxsize=256)
def _parse(text: str) -> Factory:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    id_map = parts.pop(0) if parts and parts[0] in _IDMAPS else ""
    preprocessing = []
    while parts and _PREPROCESSING.match(parts[0]) and not _PQ.match(parts[0]):
        preprocessing.append(parts.pop(0))
    coarse = parts.pop(0) if parts and _IVF.match(parts[0]) else ""
    encoding = parts.pop(0) if parts else ""
    return Factory(text, id_map, tuple(preprocessing), coarse, encoding, ",".join(parts))
