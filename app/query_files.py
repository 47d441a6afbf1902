"""Many queries from the command line: ``moco search`` / ``moco classify`` over several images or whole folders,
answered in micro-batches and written as CSV or JSONL, one row per query image in the order given (a folder's
images in path order).

A query image that does not decode is one row with its ``error``, not the end of the run: a batch that fails is
answered again one image at a time.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

from moco_retrieval.contracts.errors import ConfigError, DataError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.images import walk_image_files

LOG = logging.getLogger(__name__)

FORMATS = ("csv", "jsonl")
SEARCH_COLUMNS = ("query", "ids", "paths", "scores", "error")
CLASSIFY_COLUMNS = ("query", "label", "share", "ids", "paths", "scores", "error")


def expand_queries(sources: Iterable[str]) -> list[str]:
    """Image files as given, and every image of each folder (the indexer's walk rules, path order).

    Raises:
        DataError: a source that is neither an image file nor a folder holding images.
    """
    out: list[str] = []
    for source in sources:
        if os.path.isdir(source):
            found = [os.path.join(source, f.path) for f in walk_image_files(source) if f.skip_reason is None]
            if not found:
                raise DataError(f"no image files in the folder {source}")
            out += found
        elif os.path.exists(source):
            out.append(source)
        else:
            raise DataError(f"query image not found: {source}")
    return out


def output_format(out: str | None, fmt: str | None) -> str:
    """The format asked for (``--format``), else the one ``--out``'s suffix names, else JSONL.

    Raises:
        ConfigError: an ``--out`` suffix that is neither .csv nor .jsonl, with no ``--format``.
    """
    if fmt:
        return fmt
    if out is None:
        return "jsonl"
    suffix = Path(out).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise ConfigError(f"cannot tell the format of --out {out}: name it .csv or .jsonl, or pass --format")
    return suffix


def answer_in_batches(
    paths: list[str], batch: int, answer: Callable[[list[str]], list], workers: int = 1
) -> Iterator[tuple[str, object]]:
    """``(path, answer or DataError)`` of each path, in order: ``batch`` paths per call, ``workers`` calls at once
    (each decodes its images in its own thread while the engine's batcher embeds another's), a failed batch
    again one by one so that a bad image costs only its own row."""
    from concurrent.futures import ThreadPoolExecutor

    def run(chunk: list[str]) -> list[tuple[str, object]]:
        try:
            return list(zip(chunk, answer(chunk)))
        except DataError:
            out = []
            for path in chunk:
                try:
                    (res,) = answer([path])
                except DataError as exc:
                    LOG.warning("%s: %s", path, exc)
                    res = exc
                out.append((path, res))
            return out

    chunks = [paths[start : start + batch] for start in range(0, len(paths), batch)]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="moco-queries") as pool:
        for rows in pool.map(run, chunks):  # in order, whatever order they finish in
            yield from rows


def _hits(hits: list[dict]) -> list[dict]:
    return [
        {
            "id": h["id"],
            "path": display_name(h["path"]),
            "label": display_name(h.get("label")),
            "score": round(float(h["score"]), 6),
        }
        for h in hits
    ]


def search_row(path: str, res) -> dict:
    if isinstance(res, Exception):
        return {"query": path, "results": [], "error": str(res)}
    return {"query": path, "results": _hits(res.hits), "error": None}


def classify_row(path: str, res) -> dict:
    if isinstance(res, Exception):
        return {"query": path, "label": None, "share": None, "probabilities": {}, "neighbors": [], "error": str(res)}
    label = display_name(res.label)
    return {
        "query": path,
        "label": label,
        "share": round(res.probabilities[res.label], 6) if res.label else None,
        "probabilities": {display_name(k): round(v, 6) for k, v in res.probabilities.items()},
        "neighbors": _hits(res.neighbors),
        "error": None,
    }


def _csv_fields(row: dict, columns: tuple[str, ...]) -> list:
    hits = row.get("results", row.get("neighbors", []))
    values = {
        "ids": ";".join(str(h["id"]) for h in hits),
        "paths": ";".join(h["path"] for h in hits),
        "scores": ";".join(f"{h['score']:.6f}" for h in hits),
    }
    return [values.get(c, row.get(c)) if values.get(c, row.get(c)) is not None else "" for c in columns]


def write_rows(rows: Iterable[dict], out: str | None, fmt: str, columns: tuple[str, ...]) -> int:
    """Write ``rows`` to ``out`` (stdout when ``None``) as CSV (lists joined with ``;``) or JSONL; the count.

    Raises:
        OutputError: ``out`` cannot be written.
    """
    from moco_retrieval.contracts.atomic import atomic_write

    def emit(f) -> int:
        n = 0
        writer = csv.writer(f) if fmt == "csv" else None
        if writer:
            writer.writerow(columns)
        for row in rows:
            if writer:
                writer.writerow(_csv_fields(row, columns))
            else:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
        return n

    if out is None:
        return emit(sys.stdout)
    with atomic_write(Path(out), "w") as f:  # published whole at the end: no half-written file
        return emit(f)
