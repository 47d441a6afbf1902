"""The record of one indexed item, as the ``items`` database of the LMDB metadata stores it
(:mod:`indexer.metadata`): its field names are spelled here and nowhere else.

A record is one JSON object per id, written with sorted keys; :meth:`ItemRecord.to_json` (through
:meth:`ItemRecord.to_dict`) and :meth:`ItemRecord.from_dict` are the only conversions between it and
:class:`ItemRecord`, at the LMDB boundary.
What a client sees of a record (the HTTP schema) is :mod:`serve.answers`'s, built from :meth:`ItemRecord.to_dict`.
"""

from __future__ import annotations

import json
import math
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
        """The bytes the store holds: :meth:`to_dict` as compact JSON with sorted keys.

        A record of the usual types is formatted into one template with the JSON encoder's own string escaping
        (1.7 instead of 4.1 us a record, timeit: a 10M-file build writes 10M of them, on its commit's critical path);
        anything else (a non-finite or non-float ``mtime``, a number that is not an ``int``) goes through the
        encoder. Both give the same bytes (``tests/test_index_parts.py``)."""
        if not _templatable(self):
            return _ENCODER.encode(self.to_dict()).encode()
        return (
            _TEMPLATE
            % (
                self.bytes,
                "null" if self.duplicate_of is None else self.duplicate_of,
                self.height,
                self.id,
                "null" if self.label is None else _json_string(self.label),
                float.__repr__(self.mtime),
                self.mtime_ns,
                _json_string(self.path),
                _json_string(self.sha256),
                self.width,
            )
        ).encode()

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
_json_string = json.encoder.encode_basestring_ascii  # the encoder's escaping (ensure_ascii), in C
# to_json's template: STORED_KEYS in order, each with the conversion its value gets there
_TEMPLATE_FIELDS = {
    "bytes": "%d",
    "duplicate_of": "%s",
    "height": "%d",
    "id": "%d",
    "label": "%s",
    "mtime": "%s",
    "mtime_ns": "%d",
    "path": "%s",
    "sha256": "%s",
    "width": "%d",
}
assert tuple(_TEMPLATE_FIELDS) == STORED_KEYS, "to_json's template must list every stored key, in order"
_TEMPLATE = "{" + ",".join(f'"{k}":{v}' for k, v in _TEMPLATE_FIELDS.items()) + "}"


def _templatable(r: ItemRecord) -> bool:
    """Whether ``r`` holds the types the template formats exactly as the encoder would."""
    return (
        type(r.id) is int
        and type(r.bytes) is int
        and type(r.width) is int
        and type(r.height) is int
        and type(r.mtime_ns) is int
        and type(r.mtime) is float
        and math.isfinite(r.mtime)
        and (r.duplicate_of is None or type(r.duplicate_of) is int)
        and type(r.path) is str
        and type(r.sha256) is str
        and (r.label is None or type(r.label) is str)
    )
