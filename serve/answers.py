"""What a search, a classification or an item looks like to a client: one JSON schema for the HTTP API and the
command line's ``--json`` (``moco search``, ``moco classify``), built here and nowhere else.

A record is shown as :data:`RECORD_FIELDS` with its path and label readable (valid Unicode on one line, ``\\xNN``
for bytes that are not UTF-8) and the URL of its image on a server (``/api/items/{id}/image``); hits add their
``score``, an item its ``mtime``. The HTTP API's response models (``serve/http.py``) declare the same fields.
"""

from __future__ import annotations

from moco_retrieval.contracts.filenames import display_name


RECORD_FIELDS = ("id", "path", "label", "width", "height", "bytes", "sha256", "duplicate_of")  # what a client sees


def public_record(record: dict, extra: tuple[str, ...] = ()) -> dict:
    """A stored record (or hit: with its ``score``) as clients see it: :data:`RECORD_FIELDS`, ``image_url``, and
    the ``extra`` fields asked for (an item's ``mtime``)."""
    out = {key: record.get(key) for key in RECORD_FIELDS + extra}
    out.update(
        path=display_name(record["path"]),
        label=display_name(record.get("label")),
        image_url=f"/api/items/{record['id']}/image",
    )
    if "score" in record:
        out["score"] = record["score"]
    return out


def search_answer(res, k: int, min_score: float | None) -> dict:
    """One search's answer: ``{generation, k, min_score, results: [hit], timings, batch_size[, query]}``."""
    body = {
        "generation": res.generation,
        "k": k,
        "min_score": min_score,
        "results": [public_record(h) for h in res.hits],
        "timings": res.timings,
        "batch_size": res.batch_size,
    }
    if res.query is not None:
        body["query"] = public_record(res.query)
    return body


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
