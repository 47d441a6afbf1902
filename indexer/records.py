"""The record of one indexed item, as the ``items`` database of the LMDB metadata stores it
(:mod:`indexer.metadata`): its field names are spelled here and nowhere else.

A record is one JSON object per id, written with sorted keys; :meth:`ItemRecord.to_json` (through
:meth:`ItemRecord.to_dict`) and :meth:`ItemRecord.from_dict` are the only conversions between it and
:class:`ItemRecord`, at the LMDB boundary.
What a client sees of a record (the HTTP schema) is :mod:`serve.answers`'s, built from :meth:`ItemRecord.to_dict`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from operator import attrgetter


@dataclass(frozen=True, slots=True)
class ItemRecord:
    """One live item: a file of the image folder, as the run that indexed it saw it."""

    id: int  # the id FAISS returns for its vector (ids are never reused)
    path: str  # relative to the image folder (``os.fsdecode`` of its bytes: lossless)
    label: str | None  # its class (its top-level folder or the --labels CSV), None when unlabeled
    width: int  # pixels, of the decoded image
    height: int
    bytes: int  # the file's size when it was read (a different size: the file changed)
    sha256: str  # hex digest of the file's bytes (exact duplicates share it)
    mtime: float  # seconds since the epoch, for clients
    mtime_ns: int  # what an update compares with the file's (with its size) to find a change
    duplicate_of: int | None = None  # the id of the first live item with the same sha256 (None: it is the first)

    def to_dict(self) -> dict:
        """The JSON object the store holds, keys in the order it writes them (sorted): a record read as a dict
        is the dict it always was."""
        return dict(zip(STORED_KEYS, _STORED_VALUES(self)))

    def to_json(self) -> bytes:
        """The bytes the store holds: :meth:`to_dict` as compact JSON (its keys are already sorted, so the encoder
        does not sort them again: 3.0 instead of 4.7 us a record, of the ~17 us a build's metadata costs)."""
        return _ENCODER.encode(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, raw: dict) -> "ItemRecord":
        """The record of a stored JSON object.

        Raises:
            TypeError: an object with other keys than a record's (not ours: the store calls its page damaged).
        """
        return cls(**raw)

    def __getitem__(self, name: str):
        """``record["path"]``: field access by name, for callers written against the dict records."""
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None


FIELDS = tuple(f.name for f in fields(ItemRecord))
STORED_KEYS = tuple(sorted(FIELDS))
_STORED_VALUES = attrgetter(*STORED_KEYS)  # record -> its values in STORED_KEYS order, in one C call
_ENCODER = json.JSONEncoder(separators=(",", ":"))
