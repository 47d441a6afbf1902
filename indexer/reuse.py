"""Vectors an update need not compute again: files on the plan whose bytes are the ones on record.

The plan puts a file on the to-embed list when its size, mtime or label differ from its record (``indexer.plan``
reads only ``stat``). A copy without ``-p``, a ``git checkout``, a restore from a backup or an edited labels CSV
change the mtime or the label and leave the bytes as they were. Before such a file is decoded, the sha256 of its
bytes is compared with its record's. Where they agree, the vector the live generation stores for it goes into the
work shards as if the encoder had just computed it. It is the same encoder's output: an update refuses another
model. Nothing after the shards can tell the difference. The record is updated (new mtime or label, a new id,
as for any changed file), with the vector it had.

Only files whose record has the same size are read; a file of another size has changed.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.images import FoundFile, read_image_bytes
from moco_retrieval.indexer.decode import Decoded
from moco_retrieval.indexer.embed import shard_entry
from moco_retrieval.indexer.metadata import MetadataStore
from moco_retrieval.indexer.shards import WorkShards
from moco_retrieval.indexer.vectors import BlockVectors

LOG = logging.getLogger(__name__)

HASH_THREADS = 4  # file reads and sha256 both release the GIL
REUSE_CHUNK = 10_000  # changed files compared at a time: their records and vectors, never all of them at once


def reuse_stored_vectors(
    entries: list[FoundFile],
    changed_ids: dict[str, int],
    store: MetadataStore,
    vectors: BlockVectors,
    shards: WorkShards,
    image_root,
    progress: bool = True,
) -> tuple[list[FoundFile], int]:
    """Put into ``shards`` each of ``entries`` whose bytes hash to its record's sha256, with its stored vector.

    Args:
        changed_ids: path -> id of the record of each changed file (``Plan.changed_ids``).
        store, vectors: the metadata and the vector blocks of the live generation.

    Returns:
        ``(the entries still to embed, in their order; how many vectors were reused)``.
    """
    candidates = [  # changed files not already in a finished shard (of an interrupted run)
        e for e in entries if e.path in changed_ids and shards.lookup(e.path, e.bytes, e.mtime_ns) is None
    ]
    if not candidates:
        return entries, 0
    reused: set[str] = set()
    bar = tqdm(
        total=len(candidates), unit="file", desc="comparing changed files", disable=not progress, dynamic_ncols=True
    )
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="moco-hash") as pool:
        for start in range(0, len(candidates), REUSE_CHUNK):
            part = candidates[start : start + REUSE_CHUNK]
            reused |= _reuse_chunk(part, changed_ids, store, vectors, shards, image_root, pool)
            bar.update(len(part))
    bar.close()
    if reused:
        shards.flush()  # what was reused is kept if the run stops before the encoder's first shard
        LOG.info("%d changed files have the bytes on record: their stored vectors are reused", len(reused))
    return [e for e in entries if e.path not in reused], len(reused)


def _reuse_chunk(part, changed_ids, store, vectors, shards, image_root, pool) -> set[str]:
    """The paths of ``part`` given their stored vectors (see :func:`reuse_stored_vectors`)."""
    records = {rec.path: rec for rec in store.records([changed_ids[e.path] for e in part]) if rec is not None}
    same_size = [e for e in part if e.path in records and records[e.path].bytes == e.bytes]
    digests = pool.map(_sha256_or_none, [image_root / e.path for e in same_size])
    same = [e for e, digest in zip(same_size, digests) if digest is not None and digest == records[e.path].sha256]
    if not same:
        return set()
    found, stored = vectors.get(np.asarray([records[e.path].id for e in same], dtype=np.int64))
    done = set()
    for e, ok, vector in zip(same, found, stored):
        if not ok:  # a record without a stored vector is not expected; the encoder computes it again
            continue
        rec = records[e.path]
        as_decoded = Decoded(e.path, None, rec.width, rec.height, rec.bytes, rec.sha256, None, 0.0)
        shards.add(shard_entry(e, as_decoded), vector)
        done.add(e.path)
    return done


def _sha256_or_none(path) -> str | None:
    """The sha256 of an image file's bytes, read as the decoders read them (a FIFO or device that took the file's
    place is refused without blocking), or ``None`` when they cannot be read: the decoders then say why."""
    try:
        return hashlib.sha256(read_image_bytes(path)).hexdigest()
    except DataError:
        return None
