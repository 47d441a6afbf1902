"""Writing a generation that differs from its predecessor by what changed: the incremental update, and the
compaction that folds the accumulated changes back into a new base.

An update (cost proportional to the change, never to the corpus):

- hard-links the predecessor's base files into the new generation (``vectors.faiss``, ``vectors.ivfdata``,
  ``trained.faiss``, ``meta.lmdb/data.mdb``) and copies its small ``delta.lmdb``, then writes the metadata
  changes into that copy (:class:`indexer.metadata.MetadataStore` layered over the base);
- rewrites the delta FAISS index: the predecessor's delta (an ``IDMap2,Flat`` beside Flat / HNSW bases, a copy
  of the trained, empty IVF for IVF bases, so the same lists and nprobe serve both) minus removed delta
  items, plus the new vectors;
- appends removed base ids to ``removed.npy``; searches exclude them (:class:`indexer.searcher.LayeredIndex`).

Ids only grow, so ids below the manifest's ``base_next_id`` are in the base and the others in the delta.
Once the delta and the removed ids together pass ``COMPACT_FRACTION`` of the base and ``COMPACT_MIN`` items
(or the index type has to change), the run publishes a compaction right after the update: the metadata layers
materialized into one
(:func:`indexer.metadata.materialize`), the vector blocks merged into one block of live rows when they are
many or mostly dead, and the FAISS index rebuilt from them (IVF keeps its trained lists), recall re-measured.
HNSW cannot remove vectors at all; its tombstones are filtered at search time until that rebuild.
"""

from __future__ import annotations

import logging
from pathlib import Path

import faiss
import numpy as np

from moco_retrieval.contracts.atomic import atomic_write, link_or_copy_atomic, output_errors
from moco_retrieval.contracts.errors import ArtifactError, IndexBuildError
from moco_retrieval.indexer.faiss_index import read_index, write_index
from moco_retrieval.indexer.layout import GenerationPaths, IndexLayout
from moco_retrieval.indexer.manifest import IndexManifest
from moco_retrieval.indexer.metadata import MetadataStore, copy_store, link_store
from moco_retrieval.indexer.vectors import BlockWriter, block_rows, live_blocks, open_block

LOG = logging.getLogger(__name__)

COMPACT_FRACTION = 0.05  # compact once delta + removed items pass 5% of the base ...
COMPACT_MIN = 1_000  # ... and this many (below it a delta costs nothing worth a rebuild)
MAX_BLOCKS = 16  # ... and merge the vector blocks then when there are more than this
MAX_DEAD_FRACTION = 0.10  # ... or when more than this share of their rows is dead


def needs_compaction(manifest: IndexManifest) -> bool:
    changes = manifest.delta_count + manifest.removed_count
    return changes > max(COMPACT_MIN, COMPACT_FRACTION * manifest.base_count)


def link_base(prev: GenerationPaths, staging: GenerationPaths) -> None:
    """Share the predecessor's base files with the new generation (hard links; copies where impossible)."""
    for src, dst in ((prev.index, staging.index), (prev.lists, staging.lists), (prev.trained, staging.trained)):
        if src.is_file():
            link_or_copy_atomic(src, dst)
    with output_errors(staging.meta):
        link_store(prev.meta, staging.meta)


def open_delta_store(prev: GenerationPaths, staging: GenerationPaths) -> MetadataStore:
    """The new generation's metadata, writable: the shared base under a copy of the predecessor's delta. The
    base is read through the predecessor's path (the same file as the new generation's link), so that an error
    in it names a file that stays, not the staging folder."""
    with output_errors(staging.delta_meta):
        if prev.delta_meta.is_dir():
            copy_store(prev.delta_meta, staging.delta_meta)
    return MetadataStore(prev.meta, readonly=False, delta=staging.delta_meta)


def _new_delta(prev: GenerationPaths, d: int) -> faiss.Index:
    if prev.trained.is_file():  # IVF: the same trained lists as the base
        return read_index(prev.trained)
    return faiss.index_factory(d, "IDMap2,Flat", faiss.METRIC_INNER_PRODUCT)


def read_delta(
    gen: GenerationPaths, manifest: IndexManifest, factory: str | None = None, mmap: bool = False
) -> faiss.Index | None:
    """The generation's delta index (``None`` when it has none), checked against its manifest's
    ``delta_count``: a missing delta was read as an empty one, losing its items without a word.

    Raises:
        ArtifactError: missing while the manifest counts items in it, unreadable, or holding another count.
    """
    path = gen.delta_index
    if not path.is_file():
        if manifest.delta_count:
            raise ArtifactError(
                f"{path} is missing (its manifest counts {manifest.delta_count} items added since "
                "the base); rebuild with `moco index --rebuild`"
            )
        return None
    delta = read_index(path, factory, mmap=mmap)
    if delta.ntotal != manifest.delta_count or delta.d != manifest.embedding_dim:
        raise ArtifactError(
            f"{path} holds {delta.ntotal} {delta.d}-d vectors, its manifest counts "
            f"{manifest.delta_count} {manifest.embedding_dim}-d; rebuild with `moco index --rebuild`"
        )
    return delta


def update_faiss(
    prev: GenerationPaths,
    staging: GenerationPaths,
    manifest: IndexManifest,
    add_ids: np.ndarray,
    add_vectors: np.ndarray,
    removed_ids: np.ndarray,
) -> tuple[int, int]:
    """Write the new generation's ``delta.faiss`` and ``removed.npy``; returns ``(delta count, removed count)``.

    Args:
        manifest: the predecessor's manifest; add_ids / add_vectors: int64 ``[m]`` / float32 ``[m, d]``.
        removed_ids: int64 ids removed by this update (base or delta items).
    """
    removed_ids = np.asarray(removed_ids, dtype=np.int64)
    in_delta = removed_ids[removed_ids >= manifest.base_next_id]
    in_base = removed_ids[removed_ids < manifest.base_next_id]
    delta = read_delta(prev, manifest)
    if delta is None:
        delta = _new_delta(prev, manifest.embedding_dim)
    try:
        if len(in_delta):
            gone = delta.remove_ids(faiss.IDSelectorBatch(in_delta))
            if gone != len(in_delta):
                raise IndexBuildError(
                    f"the delta index of {prev.root.name} holds {gone} of the {len(in_delta)} "
                    "ids to remove; rebuild with `moco index --rebuild`"
                )
        if len(add_ids):
            delta.add_with_ids(
                np.ascontiguousarray(add_vectors, dtype=np.float32), np.ascontiguousarray(add_ids, dtype=np.int64)
            )
    except RuntimeError as exc:
        raise IndexBuildError(f"FAISS failed updating the delta index: {str(exc).splitlines()[-1]}") from exc
    if delta.ntotal:
        write_index(delta, str(staging.delta_index))
    removed = np.union1d(read_removed(prev, manifest), in_base).astype(np.int64)
    if len(removed):
        with atomic_write(staging.removed) as f:
            np.save(f, removed)
    return int(delta.ntotal), int(len(removed))


def read_removed(gen: GenerationPaths, manifest: IndexManifest) -> np.ndarray:
    """The generation's removed base ids: sorted, unique int64, checked against its manifest (``removed_count``
    of them, each below ``base_next_id``), since a damaged file otherwise let removed items back into results
    or raised numpy's tracebacks.

    Raises:
        ArtifactError: missing while the manifest counts removed ids, unreadable, or not those ids.
    """
    path = gen.removed
    if not path.is_file():
        if manifest.removed_count:
            raise ArtifactError(
                f"{path} is missing (its manifest counts {manifest.removed_count} removed ids); "
                "rebuild with `moco index --rebuild`"
            )
        return np.zeros(0, dtype=np.int64)
    try:
        removed = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ArtifactError(
            f"{path} is unreadable ({str(exc).splitlines()[0][:120]}); rebuild with `moco index --rebuild`"
        ) from exc
    ok = (
        removed.ndim == 1
        and removed.dtype == np.int64
        and len(removed) == manifest.removed_count
        and (
            len(removed) == 0
            or (removed[0] >= 0 and removed[-1] < manifest.base_next_id and bool(np.all(removed[1:] > removed[:-1])))
        )
    )
    if not ok:
        raise ArtifactError(
            f"{path} is damaged: not the {manifest.removed_count} sorted base ids its manifest "
            "counts; rebuild with `moco index --rebuild`"
        )
    return removed


def read_trained(gen: GenerationPaths) -> faiss.Index | None:
    """The trained, empty IVF index of a generation's base, when it has one."""
    return read_index(gen.trained) if gen.trained.is_file() else None


def compact_blocks(
    layout: IndexLayout, names: list[str], live_ids: np.ndarray, name: str, dtype
) -> tuple[list[str], dict[str, dict]]:
    """The blocks a compacted generation uses: ``names`` as they are, or one new block ``name`` holding only
    the live rows when there are more than ``MAX_BLOCKS`` of them, over ``MAX_DEAD_FRACTION`` dead rows, or
    rows of another dtype; and the records of a new block's files (``{}`` when none was written)."""
    if not names:
        return [], {}
    rows = block_rows(layout, names)
    dtypes = {open_block(layout, b)[1].dtype for b in names}
    dead = rows - len(live_ids)
    if len(names) <= MAX_BLOCKS and dead <= MAX_DEAD_FRACTION * max(rows, 1) and dtypes <= {np.dtype(dtype)}:
        return list(names), {}
    LOG.info("merging %d vector blocks (%d rows, %d dead) into %s", len(names), rows, dead, name)
    with BlockWriter(layout, name, len(live_ids), _dim(layout, names), dtype) as writer:
        for ids, xb in live_blocks(layout, names, live_ids)():
            writer.extend(ids, xb)
    return [name], writer.records


def _dim(layout: IndexLayout, names: list[str]) -> int:
    return int(open_block(layout, names[0])[1].shape[1])


def base_paths(gen: GenerationPaths) -> list[Path]:
    """The files an update shares with its predecessor (for reports and tests)."""
    return [p for p in (gen.index, gen.lists, gen.trained, gen.meta / "data.mdb") if p.exists()]
