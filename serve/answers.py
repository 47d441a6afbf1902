"""What a search, a classification or an item looks like to a client: one JSON schema for the HTTP API and the
command line's ``--json`` (``moco search``, ``moco classify``), built here and nowhere else.

A record is shown with the fields of :class:`Record` (the HTTP API's response models are these): its path and label
readable (valid Unicode on one line, ``\\xNN`` for bytes that are not UTF-8) and the URL of its image on a server
(``/api/items/{id}/image``); hits add their ``score``, items (and the item a search started from) their ``mtime``.
"""

from __future__ import annotations

from pydantic import BaseModel

from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.indexer.records import FIELDS


class Record(BaseModel):
    id: int
    path: str
    label: str | None = None
    width: int | None = None
    height: int | None = None
    bytes: int | None = None
    sha256: str | None = None
    duplicate_of: int | None = None
    image_url: str


class Hit(Record):
    score: float


class Item(Record):
    mtime: float | None = None


# the fields of the stored record (:class:`~indexer.records.ItemRecord`) the models show, in its order
RECORD_FIELDS = tuple(name for name in FIELDS if name in Record.model_fields)
ITEM_FIELDS = tuple(name for name in FIELDS if name in Item.model_fields and name not in Record.model_fields)


def public_record(record: dict, extra: tuple[str, ...] = ()) -> dict:
    """A stored record (or hit: with its ``score``) as clients see it: :data:`RECORD_FIELDS`, ``image_url``, and
    the ``extra`` fields asked for (an item's, :data:`ITEM_FIELDS`)."""
    out = {key: record.get(key) for key in RECORD_FIELDS + extra}
    out.update(
        path=display_name(record["path"]),
        label=display_name(record.get("label")),
        image_url=f"/api/items/{record['id']}/image",
    )
    if "score" in record:
        out["score"] = record["score"]
    return out


def capped(hits: list, limit: int) -> bool:
    """Whether a threshold answer may have been cut short: it holds ``limit`` hits (its ``k``, or the server's
    ``max_k``), so more items may score above its threshold."""
    return len(hits) >= limit


def search_answer(res, k: int, min_score: float | None) -> dict:
    """One search's answer: ``{generation, k, min_score, capped, results: [hit], timings, batch_size[, query]}``;
    ``capped``: a threshold search that returned ``k`` hits, so more items may score above ``min_score``."""
    body = {
        "generation": res.generation,
        "k": k,
        "min_score": min_score,
        "capped": min_score is not None and capped(res.hits, k),
        "results": [public_record(h) for h in res.hits],
        "timings": res.timings,
        "batch_size": res.batch_size,
    }
    if res.query is not None:
        body["query"] = item_record(res.query)
    return body


def item_record(record: dict) -> dict:
    """An indexed item as clients see it (:class:`Item`)."""
    return public_record(record, extra=ITEM_FIELDS)


def batch_answer(results: list, k: int, min_score: float | None) -> dict:
    """Several searches: ``{generation, k, min_score, responses: [search answer]}``, in request order."""
    return {
        "generation": results[0].generation,
        "k": k,
        "min_score": min_score,
        "responses": [search_answer(res, k, min_score) for res in results],
    }


def duplicates_answer(res, threshold: float, limit: int) -> dict:
    """An item's near-duplicates: ``{generation, threshold, capped, query: item, duplicates: [hit]}``; ``capped``:
    ``limit`` (the server's max_k) of them came back, so more items may be that similar."""
    return {
        "generation": res.generation,
        "threshold": threshold,
        "capped": capped(res.hits, limit),
        "query": item_record(res.query),
        "duplicates": [public_record(h) for h in res.hits],
    }


def classify_answer(res, k: int, temperature: float) -> dict:
    """One classification: ``{generation, k, temperature, label, probabilities, neighbors: [hit], timings}``."""
    return {
        "generation": res.generation,
        "k": k,
        "temperature": temperature,
        "label": display_name(res.label),
        "probabilities": {display_name(label): p for label, p in res.probabilities.items()},
        "neighbors": [public_record(h) for h in res.neighbors],
        "timings": res.timings,
    }
