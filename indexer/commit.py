"""The three commit strategies of ``moco index`` (:mod:`indexer.build` picks one): each assembles the next
generation in a staging folder from the embedded plan and returns it as a :class:`~indexer.build_types.GenerationDraft`,
which the pipeline publishes.

- a **full build** (:func:`commit_full`: first run, ``--rebuild``): a fresh metadata store, every vector as a block
  (``indexer.vectors``), a FAISS index trained and filled from them (``indexer.faiss_index``, on disk past the
  memory budget), recall tuned;
- an **update** (:func:`commit_update`, ``indexer.update``): the predecessor's base shared by hard links, its small
  delta copied and extended with what changed, removed base ids appended. Costs what changed;
- a **compaction** (:func:`commit_compaction`): metadata layers folded into one, vector blocks merged, the FAISS
  index rebuilt from the live vectors (IVF keeps its trained lists), recall re-measured.

Each also puts the encoder into the generation (:func:`_copy_encoder`) and records its files' checksums
(``indexer.integrity``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moco_retrieval.contracts.atomic import atomic_write, copy_atomic, link_or_copy_atomic, output_errors
from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.contracts.images import FoundFile
from moco_retrieval.indexer import faiss_index, integrity, update
from moco_retrieval.indexer.build_types import Changes, GenerationDraft, Run
from moco_retrieval.indexer.config import IndexConfig
from moco_retrieval.indexer.factory import Factory
from moco_retrieval.indexer.layout import LMDB_DATA_FILE, META_DIR, GenerationPaths
from moco_retrieval.indexer.manifest import IndexManifest, file_sha256
from moco_retrieval.indexer.metadata import MetadataStore, link_store, materialize
from moco_retrieval.indexer.records import ItemRecord
from moco_retrieval.indexer.vectors import BlockVectors, BlockWriter, block_dtype, block_exists, live_blocks

LOG = logging.getLogger(__name__)


def wanted_index(cfg: IndexConfig, n: int, d: int) -> faiss_index.IndexChoice:
    """The index type ``cfg`` asks for at ``n`` vectors of dimension ``d``."""
    return faiss_index.choose_index(cfg.index_type, n, d, budget=cfg.max_index_memory)


RECORD_CHUNK = 10_000  # files committed per step of a full build (its records and vectors, not all at once)


def _records(run: Run, readable: list[FoundFile], next_id: int) -> list[ItemRecord]:
    """New records with fresh ids in path order (so a resumed run gives the same ids)."""
    records = []
    for i, e in enumerate(readable):
        sha256, width, height, size = run.shards.facts(e.path)
        records.append(
            ItemRecord(
                id=next_id + i,
                path=e.path,
                label=e.label,
                width=width,
                height=height,
                bytes=size,
                sha256=sha256,
                mtime=e.mtime_ns / 1e9,
                mtime_ns=e.mtime_ns,
            )
        )
    return records


def _write_block(run: Run, name: str, ids: np.ndarray, vectors: np.ndarray, dtype) -> tuple[list[str], dict[str, dict]]:
    """The block of this run's new vectors (none when there are none), and its files' records."""
    if not len(ids):
        return [], {}
    with BlockWriter(run.layout, name, len(ids), vectors.shape[1], dtype) as writer:
        writer.extend(ids, vectors)
    return [name], writer.records


def commit_full(run: Run, staging: GenerationPaths, name: str, changes: Changes) -> GenerationDraft:
    """A generation from scratch: one-layer metadata, every vector in one block, a freshly trained index.
    Records and vectors go through in chunks, so 10M files never sit in memory as records or float32 rows.

    Three threads share the work, none waiting on another's files: the encoder's copy into the generation
    (file I/O and hashing, which release the GIL) starts first, so that its fsync does not follow FAISS's
    write (0.4 s after it, 0.1 s before); this thread writes the vectors into their block and builds the FAISS
    index from it (C++ that releases the GIL); the records (Python and LMDB) go into the store on a third once
    the block is written (beside the block's own Python both went slower). On two cores the serial tail of a
    build was these one after the other. FAISS stays on the main thread, where Ctrl-C reaches it; the records
    thread stops at its next chunk when the build fails or is interrupted, and the copy ends before the
    staging folder can be removed. The clock: ``commit`` is the block and the wait for the others after the
    index, ``index`` the FAISS part, ``records`` the records thread's own seconds (overlapped, not in the
    total)."""
    cfg, encoder, readable = run.cfg, run.encoder, changes.readable
    choice = wanted_index(cfg, len(readable), encoder.embedding_dim)
    dtype = block_dtype(choice.factory)
    stop = threading.Event()
    with MetadataStore(staging.meta, readonly=False) as store, ThreadPoolExecutor(2, "moco-commit") as pool:
        encoder_copy = pool.submit(_copy_encoder, run, staging)
        try:
            with run.clock.phase("commit"):
                if run.prev_manifest is not None:  # --rebuild: ids continue, never reused
                    store.set_next_id(run.prev_manifest.next_id)
                next_id = store.next_id()
                ids = np.arange(next_id, next_id + len(readable), dtype=np.int64)
                blocks = [name] if readable else []
                with BlockWriter(run.layout, name, len(readable), encoder.embedding_dim, dtype) as writer:
                    for start in range(0, len(readable), RECORD_CHUNK):
                        paths = [e.path for e in readable[start : start + RECORD_CHUNK]]
                        writer.extend(ids[start : start + len(paths)], run.shards.vectors(paths))
            records = pool.submit(_write_records, run, store, readable, next_id, stop)
            with run.clock.phase("index"):
                built = _build_faiss(run, staging, choice, ids, blocks)
            with run.clock.phase("commit"):
                encoder_copy.result()  # each raises what its thread raised
                labels, duplicates, seconds = records.result()
        except BaseException:  # Ctrl-C or a failed build: the records are not wanted any more
            stop.set()
            raise
        with run.clock.phase("commit"):
            run.clock.add("records", seconds)
            final_next_id = store.next_id()
            store.sync()
    with run.clock.phase("checksums"):
        files = integrity.record_files(staging, integrity.encoder_record(staging, encoder.sha256))
        block_files = integrity.record_blocks(run.layout, blocks, writer.records)
    return GenerationDraft(
        name,
        built,
        count=len(ids),
        next_id=final_next_id,
        duplicates=duplicates,
        labels=labels,
        blocks=blocks,
        dtype=dtype,
        base_count=len(ids),
        base_next_id=final_next_id,
        base_generation=name,
        files=files,
        block_files=block_files,
    )


def _write_records(
    run: Run, store: MetadataStore, readable: list[FoundFile], next_id: int, stop: threading.Event
) -> tuple[dict, int, float]:
    """A full build's records, a chunk per transaction, and its unreadable files; returns ``(label counts,
    duplicates, seconds)``. Returns early (its results unused) once ``stop`` is set."""
    tic = time.perf_counter()
    labels, duplicates = {}, 0
    for start in range(0, len(readable), RECORD_CHUNK):
        if stop.is_set():
            break
        stored = store.add_items(_records(run, readable[start : start + RECORD_CHUNK], next_id + start))
        labels = _label_counts(labels, stored, [])
        duplicates += sum(r.duplicate_of is not None for r in stored)
    else:
        store.replace_skipped(run.plan.skipped)
    return labels, duplicates, time.perf_counter() - tic


def _build_faiss(
    run: Run,
    staging: GenerationPaths,
    choice: faiss_index.IndexChoice,
    live_ids: np.ndarray,
    blocks: list[str],
    trained=None,
) -> faiss_index.BuiltIndex:
    """Train (unless ``trained``), fill, tune and write the base index of ``staging`` from ``blocks``."""
    layout, encoder = run.layout, run.encoder
    vectors = BlockVectors(layout, blocks) if Factory.parse(choice.factory).pq_codes else None
    built = faiss_index.build_index(
        choice.factory,
        encoder.embedding_dim,
        len(live_ids),
        live_blocks(layout, blocks, live_ids),
        target_recall=run.cfg.target_recall,
        on_disk=staging.lists if choice.on_disk else None,
        trained=trained,
        vectors=vectors,
    )
    with output_errors(staging.index):
        faiss_index.write_index(built.index, str(staging.index))
        if built.trained is not None:
            with atomic_write(staging.trained) as f:
                f.write(np.asarray(built.trained).tobytes())
    if built.on_disk:
        with open(staging.lists, "rb+") as f:  # the lists were written through a memory map
            os.fsync(f.fileno())
    built.index = None  # releases the on-disk lists' memory map before the folder is renamed
    return built


def commit_update(run: Run, staging: GenerationPaths, name: str, changes: Changes) -> GenerationDraft:
    """The predecessor plus what changed (see ``indexer.update``)."""
    layout, base, plan, readable = run.layout, run.base, run.plan, changes.readable
    prev = layout.generation(run.previous)
    with run.clock.phase("commit"):
        update.link_base(prev, staging)
        with update.open_delta_store(prev, staging) as store:
            old_ids = list(plan.removed_ids) + [plan.changed_ids[p] for p in sorted(plan.changed_ids)]
            removed = store.remove_items(old_ids, name)
            next_id = store.next_id()
            stored = store.add_items(_records(run, readable, next_id))
            store.replace_skipped(plan.skipped)
            final_next_id = store.next_id()
            store.sync()
        ids = np.arange(next_id, next_id + len(readable), dtype=np.int64)
        vectors = run.shards.vectors([e.path for e in readable])
        labels = _label_counts(base.labels, stored, [rec for rec, _ in removed])
        duplicates = base.duplicates + _duplicate_change(stored, removed)
        dtype = np.dtype(base.block_dtype)
        blocks = [b for b in base.vector_blocks if block_exists(layout, b)]
        new_blocks, new_block_files = _write_block(run, name, ids, vectors, dtype)
        blocks += new_blocks
    with run.clock.phase("index"):
        delta_count, removed_count = update.update_faiss(
            prev, staging, base, ids, vectors, np.asarray(old_ids, dtype=np.int64)
        )
        _copy_encoder(run, staging)
    with run.clock.phase("checksums"):
        # the base is shared with the predecessor by hard links: its records carry over unread (an update costs
        # what changed); the delta layer this run wrote is hashed
        files = integrity.record_files(
            staging, {**integrity.carried(base), **integrity.encoder_record(staging, run.encoder.sha256)}
        )
        block_files = integrity.record_blocks(layout, blocks, {**base.block_files, **new_block_files})
    count = base.count + len(ids) - len(old_ids)
    if base.base_count - removed_count + delta_count != count:
        raise ArtifactError(
            f"{layout.root}: the update of {run.previous} would hold {count} items but its FAISS "
            "parts do not; rebuild with `moco index --rebuild`"
        )
    built = faiss_index.BuiltIndex(
        index=None,
        factory=base.factory,
        search_params=base.search_params,
        recall_at_10=base.recall_at_10,
        exact=base.exact,
        trained_on=base.trained_on,
        on_gpu=base.built_on_gpu,
        on_disk=base.on_disk,
    )
    return GenerationDraft(
        name,
        built,
        count=count,
        next_id=final_next_id,
        duplicates=duplicates,
        labels=labels,
        blocks=blocks,
        dtype=dtype,
        base_count=base.base_count,
        base_next_id=base.base_next_id,
        base_generation=base.base_generation or base.generation,
        files=files,
        block_files=block_files,
        delta_count=delta_count,
        removed_count=removed_count,
    )


def _label_counts(labels: dict, added: list[ItemRecord], removed: list[ItemRecord]) -> dict:
    out = dict(labels)
    for rec in added:
        if rec.label is not None:
            out[rec.label] = out.get(rec.label, 0) + 1
    for rec in removed:
        if rec.label is not None:
            out[rec.label] -= 1
            if out[rec.label] <= 0:
                del out[rec.label]
    return dict(sorted(out.items()))


def _duplicate_change(added: list[ItemRecord], removed: list[tuple[ItemRecord, bool]]) -> int:
    """Duplicates = sum over contents of (copies - 1): +1 per added copy of known content, -1 per removed item
    whose content still has live copies (an original's place is taken by its oldest copy)."""
    return sum(r.duplicate_of is not None for r in added) - sum(1 for _, copies_left in removed if copies_left)


def commit_compaction(run: Run, source: str, staging: GenerationPaths, name: str) -> GenerationDraft:
    """Metadata layers folded into one, vector blocks merged, the FAISS index rebuilt from the live vectors
    (IVF keeps its trained lists)."""
    cfg, layout, encoder = run.cfg, run.layout, run.encoder
    src = layout.generation(source)
    manifest = IndexManifest.read(src.manifest)
    with run.clock.phase("compact_metadata"):
        # everything the new base is rebuilt from, hashed first: a compaction over a damaged vector block
        # published garbage measured at "recall@10 1.0" (the recall check reads the same blocks)
        integrity.check_files(
            layout, source, manifest, hashed=integrity.COMPACTION_READS, blocks=True, hashed_blocks=True
        )
        with output_errors(staging.meta):
            if src.delta_meta.is_dir():
                materialize(src.meta, src.delta_meta, staging.meta)
                linked = {}
            else:
                link_store(src.meta, staging.meta)
                linked = integrity.carried(manifest, [f"{META_DIR}/{LMDB_DATA_FILE}"])
        with MetadataStore(staging.meta) as store:
            live_ids = store.live_ids()
        choice = wanted_index(cfg, max(1, len(live_ids)), encoder.embedding_dim)
        trained = None
        if faiss_index.same_structure(manifest.factory, choice.factory):
            trained = update.read_trained(src)  # IVF: keep the trained lists; nlist stays as it is
            choice = faiss_index.IndexChoice(manifest.factory, choice.on_disk)
        dtype = block_dtype(choice.factory)
        blocks = [b for b in manifest.vector_blocks if block_exists(layout, b)]
        blocks, new_block_files = update.compact_blocks(layout, blocks, live_ids, name, dtype)
    with run.clock.phase("compact_index"):
        built = _build_faiss(run, staging, choice, live_ids, blocks, trained=trained)
        _copy_encoder(run, staging)
    files = integrity.record_files(staging, {**linked, **integrity.encoder_record(staging, encoder.sha256)})
    block_files = integrity.record_blocks(layout, blocks, {**manifest.block_files, **new_block_files})
    return GenerationDraft(
        name,
        built,
        count=len(live_ids),
        next_id=manifest.next_id,
        duplicates=manifest.duplicates,
        labels=manifest.labels,
        blocks=blocks,
        dtype=dtype,
        base_count=len(live_ids),
        base_next_id=manifest.next_id,
        base_generation=name,
        files=files,
        block_files=block_files,
        created_at=manifest.created_at,
    )


def _copy_encoder(run: Run, staging: GenerationPaths) -> None:
    """Put the encoder into the generation: a hard link to the previous generation's copy when it is still
    this model byte for byte (generations are immutable, so they can share the file), else a copy of
    ``--model`` checked against the sha256 this run embedded with. Never a link to the user's file: a later
    ``cp other.onnx model.onnx`` would have changed the index's own copy. The previous copy is hashed again:
    linked forward unread, a damaged copy made every later generation unopenable.

    Raises:
        ArtifactError: ``--model`` changed while the run embedded with it.
    """
    prev, sha256 = run.prev_manifest, run.encoder.sha256
    if prev is not None and prev.model_sha256 == sha256 and run.previous is not None:
        copy = run.layout.generation(run.previous).encoder
        if file_sha256(copy) == sha256:
            link_or_copy_atomic(copy, staging.encoder)
            return
        LOG.warning(
            "%s is not the model it was copied from (damaged or missing); copying %s instead", copy, run.encoder.path
        )
    copy_atomic(run.encoder.path, staging.encoder)
    if file_sha256(staging.encoder) != sha256:
        raise ArtifactError(f"{run.encoder.path} changed while this run embedded with it; run the same command again")
