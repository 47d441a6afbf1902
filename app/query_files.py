"""Many queries from the command line: ``moco search`` / ``moco classify`` over several images or whole folders,
written as CSV or JSONL, one row per query image in the order given (a folder's images in path order).

Worker processes read and decode the files with the indexer's decoder (:mod:`indexer.decode`: the one decode and
the encoder's resize, results in input order), so decoding is not bound by this interpreter's GIL; this process
embeds whole batches with the served encoder and answers them by vector search (``SearchEngine.search_vectors`` /
``classify_vectors``). A query image that does not decode is one row with its ``error``, not the end of the run.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

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


def decode_workers(n: int, batch: int, slots: int | None = None) -> int:
    """Processes decoding ``n`` query files: none (this process decodes) when they fit in one batch, since there is
    no encoder work to overlap and starting a pool costs more than a few decodes; else ``slots`` when given
    (``EngineConfig.decode_slots``), else the indexer's default (the cores but the one feeding the encoder)."""
    if n <= batch:
        return 0
    if slots is not None:
        return slots
    from moco_retrieval.indexer.build import default_workers

    return default_workers()


def answer_files(
    encoder,
    paths: list[str],
    answer: Callable[[np.ndarray], list],
    batch: int,
    workers: int,
    progress: bool = False,
    lanes: int = 1,
) -> Iterator[tuple[str, object]]:
    """``(path, answer or DataError)`` of each path, in the order given.

    Args:
        encoder: the served encoder (``SearchEngine.encoder``): its ``image_size`` and ``resize`` for the decode,
            its ``embed`` for the batches.
        answer: float32 ``[m, D]`` unit rows -> ``m`` answers (``engine.search_vectors`` or ``classify_vectors``).
        batch: files per encoder call (failed ones included, so a batch embeds at most this many).
        workers: decoding processes (:func:`indexer.decode.decode_files`; 0: this process decodes).
        progress: a progress bar on stderr.
        lanes: encoder calls at once (:func:`indexer.encoder_lanes.embed_in_order`).

    A file that does not decode comes back as a :class:`DataError` with the decoder's one-line reason (logged).
    Close the iterator when leaving early: that stops the decoding processes.

    The encoder embeds the next batches on threads of their own (ONNX Runtime releases the GIL) while this thread
    searches, votes and writes the rows of the batch before: the two took turns, and the cores idled a quarter
    of the run.
    """
    from tqdm import tqdm

    from moco_retrieval.indexer.decode import decode_files
    from moco_retrieval.indexer.encoder_lanes import embed_in_order

    def batches():  # (decoded files, the pixels of the readable ones or None)
        while chunk := list(islice(stream, batch)):
            good = [d.pixels for d in chunk if d.pixels is not None]
            yield chunk, np.stack(good) if good else None

    stream = decode_files(Path(), paths, encoder.image_size, encoder.resize, workers)
    bar = tqdm(total=len(paths), unit="img", desc="queries", disable=not progress, dynamic_ncols=True, smoothing=0.1)
    embedded = embed_in_order(encoder.embed, batches(), lanes)
    try:
        for chunk, vectors, _ in embedded:
            answers = iter(answer(vectors) if vectors is not None else ())
            for d in chunk:
                if d.pixels is None:
                    LOG.warning("%s: %s", display_name(d.path), d.error)
                    yield d.path, DataError(d.error)
                else:
                    yield d.path, next(answers)
            bar.update(len(chunk))
    finally:
        embedded.close()  # waits for the encoder calls in flight
        stream.close()  # leaves the pool's context: its processes end
        bar.close()


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
