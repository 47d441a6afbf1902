"""The ``moco index`` pipeline: plan against the live generation, embed what is new (on one or many ranks),
publish what changed.

1. plan (``indexer.plan``): rescan the folder (or stat only a ``--changed-list``) and compare each file's size
   and mtime with the live generation's metadata: unchanged files are not read again; new and changed files
   are embedded; vanished ones removed;
2. embed (``indexer.embed``): into resumable shards (``indexer.shards``); under ``torchrun`` every rank embeds
   its share of the plan and rank 0 waits for the others (``indexer.ranks``), then does the rest alone;
3. commit: one of three strategies assembles a staging generation and returns it as a ``GenerationDraft``:

   - a **full build** (first run, ``--rebuild``): a fresh metadata store, every vector as a block
     (``indexer.vectors``), a FAISS index trained and filled from them (``indexer.faiss_index``, on disk past
     the memory budget), recall tuned;
   - an **update** (``indexer.update``): the predecessor's base shared by hard links, its small delta
     copied and extended with what changed, removed base ids appended. Costs what changed;
   - a **compaction**, published right after an update once the changes pass 5% of the base and 1,000
     items (or the index type must change, or ``--compact now``): metadata layers folded into one, vector
     blocks merged, the FAISS index rebuilt from the live vectors (IVF keeps its trained lists), recall
     re-measured;

4. publish: one ``_publish`` writes the draft's manifest, opens the generation as a server would and makes it
   live atomically (``indexer.layout.publish``); one ``_result`` makes the report from the live manifest.
   The work shards are deleted after the last publish; the seconds of every phase are on one ``Stopwatch``.

A run that changes nothing publishes nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from moco_retrieval.contracts.atomic import (
    atomic_write,
    copy_atomic,
    link_or_copy_atomic,
    output_errors,
    write_json_atomic,
)
from moco_retrieval.contracts.encoder_format import model_summary
from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError, OutputError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.images import FoundFile
from moco_retrieval.contracts.launch import WorldInfo, world_info_from_env
from moco_retrieval.contracts.locks import writer_lock
from moco_retrieval.indexer import faiss_index, integrity, update
from moco_retrieval.indexer.embed import Embedder, FolderEmbedder
from moco_retrieval.indexer.encoder import OnnxEncoder, available_cores, read_encoder_metadata
from moco_retrieval.indexer.config import IndexConfig
from moco_retrieval.indexer.factory import Factory
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.layout import (
    ENCODER_FILE,
    LMDB_DATA_FILE,
    META_DIR,
    GenerationPaths,
    IndexLayout,
    generation_name,
    generation_number,
    new_staging_dir,
    publish,
    remove_stale_staging,
    utc_now,
)
from moco_retrieval.indexer.manifest import IndexManifest, file_sha256
from moco_retrieval.indexer.metadata import MetadataStore, link_store, materialize
from moco_retrieval.indexer.records import ItemRecord
from moco_retrieval.indexer.plan import Plan, plan_full, plan_listed, read_changed_list, scan_listed
from moco_retrieval.indexer.ranks import Rendezvous, part_of_plan, plan_digest
from moco_retrieval.indexer.scan import read_labels_csv, scan_folder
from moco_retrieval.indexer.shards import WorkShards, discard_other_models
from moco_retrieval.indexer.vectors import BlockVectors, BlockWriter, block_dtype, block_exists, live_blocks

LOG = logging.getLogger(__name__)


def default_workers(world: WorldInfo | None = None) -> int:
    """Decoding processes of one rank: its share of the cores but the one feeding the encoder, at most 16
    (0, decoding in the rank itself, when it has a single core)."""
    cores = available_cores() // max(1, world.local_world_size if world else 1)
    if world is not None and world.local_world_size > 1:
        return max(0, min(16, cores - 1))
    return max(1, min(16, cores - 1))


@dataclass
class IndexResult:
    """What a run did. ``generation`` is the live one afterwards; ``published`` says if this run made it."""

    index_dir: str
    generation: str
    published: bool
    count: int
    added: int
    updated: int
    removed: int
    unchanged: int
    duplicates: int
    embedded: int  # files decoded + embedded by this run (resumed ones not included)
    resumed: int  # results taken from the shards of an interrupted run
    skipped: list[dict]  # [{path, reason}] files that could not be indexed
    factory: str
    recall_at_10: float | None
    search_params: dict
    timings: dict  # seconds: scan, plan, embed (...), commit, index, publish, compact, total
    report_path: str
    mode: str = "build"  # build, update, compaction, unchanged, or rank (a rank > 0: embedded only)
    compacted: str | None = None  # the generation a compaction published after the update, if any
    rank: int = 0
    world_size: int = 1
    delta_count: int = 0
    removed_count: int = 0
    not_images: dict = field(default_factory=dict)  # extension -> files of the folder passed over for it
    reattached: str | None = None  # the folder this index was built from, when this run moved it to image_dir


class Stopwatch:
    """Where the seconds of one run went: one total per phase (``scan``, ``plan``, ``embed``, ``commit``,
    ``index``, ``publish``, ``compact_*`` ...), added up when a phase runs more than once."""

    def __init__(self):
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - tic)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def report(self) -> dict[str, float]:
        """Every phase so far, and ``total``: the seconds since the run started."""
        return {**self.seconds, "total": time.perf_counter() - self.started}


@dataclass
class _Run:
    """What one run knows, from planning to publishing: its inputs, the live generation it follows, the plan,
    the work shards, what its embedder did and its stopwatch."""

    cfg: IndexConfig
    layout: IndexLayout
    image_root: Path
    world: WorldInfo
    clock: Stopwatch
    embedder: Embedder | None = None
    previous: str | None = None  # the live generation this run follows
    prev_manifest: IndexManifest | None = None
    base: IndexManifest | None = None  # the manifest an update builds on (None: a full build)
    plan: Plan | None = None
    shards: WorkShards | None = None
    embedded: int = 0  # files decoded and embedded by this run
    resumed: int = 0  # results taken from the shards of an interrupted run
    not_images: dict[str, int] = field(default_factory=dict)  # what the scan passed over, by extension
    reattached: str | None = None  # the old image folder, when --reattach moves the index here

    @property
    def encoder(self):
        return self.embedder.encoder

    def embed(self, entries: list[FoundFile]) -> None:
        """Embed ``entries`` into the shards; counts go on the run, seconds on its stopwatch."""
        stats = dict(self.embedder.embed_into(entries, self.shards, progress=self.cfg.progress))
        self.embedded += stats.pop("embedded", 0)
        self.resumed += stats.pop("resumed", 0)
        for phase, seconds in stats.items():
            self.clock.add(phase, seconds)


@dataclass(frozen=True)
class Changes:
    """What the embedded plan does to the index: the files that go in, and the figures the report gives."""

    readable: list[FoundFile]  # new and changed files that were embedded, in path order
    added: int
    updated: int
    removed: int  # vanished files, and changed ones that became unreadable
    skipped: list[dict]  # [{path, reason}] every file that could not be indexed, by path


@dataclass
class GenerationDraft:
    """A generation assembled in staging by one of the three commit strategies (full build, update,
    compaction): everything its manifest says beyond what the run itself knows."""

    name: str
    built: faiss_index.BuiltIndex  # the FAISS side: factory, search parameters, recall, where it was built
    count: int  # live items
    next_id: int
    duplicates: int
    labels: dict[str, int]  # label -> live items
    blocks: list[str]  # vector blocks, oldest first
    dtype: np.dtype  # of the vector blocks
    base_count: int
    base_next_id: int
    base_generation: str
    files: dict[str, dict]  # the generation's files: size and sha256 (``indexer.integrity``)
    block_files: dict[str, dict]  # the same for the vector blocks' files
    delta_count: int = 0
    removed_count: int = 0
    created_at: str | None = None  # None: the index's (a first build: now)


@contextmanager
def _staging(layout: IndexLayout):
    """A staging folder for the next generation, removed when the run fails before publishing it: a refused
    update leaves the directory as it found it (a kill leaves it to the next run, which removes it)."""
    staging = new_staging_dir(layout)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging.root, ignore_errors=True)  # once published it was renamed away: nothing to do
        raise


def build_index_dir(cfg: IndexConfig, embedder: Embedder | None = None, scanner=None) -> IndexResult:
    """Create or update the index directory ``cfg.out_dir`` from ``cfg.image_dir`` (see the module docstring).

    Launched by torchrun (``RANK`` / ``WORLD_SIZE`` set), every rank calls this; rank 0 publishes.

    Args:
        embedder: what turns files into vectors (see ``indexer.embed``; default: the ONNX encoder ``cfg.model``
            over decoded images).
        scanner: ``(root, labels) -> ScanResult`` instead of scanning the folder (benchmarks).

    Raises:
        DataError: missing or empty image folder.
        ArtifactError: not an encoder; an index built with another model, dimension or folder (without
            ``rebuild``); another run holds the directory.
        OutputError: the output cannot be written (permissions, full disk).
        ConfigError: bad options (unknown index type or device).
        IndexBuildError: FAISS or LMDB failed, or a rank stopped making progress.
    """
    clock = Stopwatch()
    world = world_info_from_env()
    layout = IndexLayout(Path(cfg.out_dir).absolute())
    image_root = Path(cfg.image_dir).absolute()
    # inputs first: a missing model or folder fails before anything is created, locked or scanned
    if embedder is None:
        read_encoder_metadata(cfg.model)
    if scanner is None and not image_root.is_dir():
        raise DataError(f"image folder not found: {image_root}")
    with output_errors(layout.root):
        if layout.root.exists() and not layout.root.is_dir():
            raise OutputError(f"--out {layout.root} exists and is not a folder; choose another --out")
        layout.root.mkdir(parents=True, exist_ok=True)
    if not os.access(layout.root, os.W_OK):
        raise OutputError(f"cannot write {layout.root} (permission denied); choose a writable --out")
    labels = read_labels_csv(cfg.labels_csv) if cfg.labels_csv else None
    run = _Run(cfg, layout, image_root, world, clock, embedder)
    if world.rank != 0:  # no lock: rank 0 holds it for the whole run, the others only write their shards
        _plan(run, labels, scanner, _live_generation(layout, cfg.rebuild))
        _embed_share(run)
        return _result(run, "rank")
    with writer_lock(layout.lock, "moco index", layout.root):
        live = _live_generation(layout, cfg.rebuild)
        remove_stale_staging(layout, live)
        _plan(run, labels, scanner, live)
        _embed_share(run)
        _wait_for_ranks(run)
        return _commit(run)


# --- 1. plan -------------------------------------------------------------------------------------------------


def _live_generation(layout: IndexLayout, rebuild: bool) -> str | None:
    """The generation this run follows: the live one (``None`` when nothing was published), checked before
    anything is scanned or embedded.

    A damaged ``CURRENT`` is refused, never read as "no index" (which re-embedded everything, renumbered the
    ids and deleted every generation). With ``--rebuild`` the run starts over after the newest generation
    folder there is, which it keeps until the next publish.

    Raises:
        ArtifactError: ``CURRENT`` is damaged or names a generation that is not there (without ``rebuild``).
    """
    try:
        live = layout.current()
        if live is not None and not layout.generation(live).root.is_dir():
            raise layout.damaged_pointer(f"names {live}, which is not there")
        return live
    except ArtifactError as exc:
        if not rebuild:
            raise
        names = layout.generation_names()
        LOG.warning("%s; --rebuild: starting over after %s", exc, names[-1] if names else "nothing")
        return names[-1] if names else None


def _open_embedder(cfg: IndexConfig, image_root: Path, world: WorldInfo) -> FolderEmbedder:
    threads = max(1, available_cores() // world.local_world_size) if world.world_size > 1 else None
    device = cfg.device
    if world.world_size > 1 and device in ("auto", "cuda"):  # one GPU per rank of a node
        try:
            encoder = OnnxEncoder(cfg.model, device=f"cuda:{world.local_rank}", threads=threads)
        except ConfigError:
            if device == "cuda":
                raise
            encoder = OnnxEncoder(cfg.model, device="cpu", threads=threads)
    else:
        encoder = OnnxEncoder(cfg.model, device=device, threads=threads)
    workers = cfg.workers if cfg.workers is not None else default_workers(world)
    return FolderEmbedder(encoder, image_root, cfg.batch_size, workers)


def _plan(run: _Run, labels, scanner, live: str | None) -> None:
    """Check what the run follows, scan, open the encoder, and compare the folder with the live generation:
    sets the run's ``previous``, ``prev_manifest``, ``base``, ``plan`` and ``shards``."""
    cfg, layout, image_root, world = run.cfg, run.layout, run.image_root, run.world
    run.previous = live
    run.prev_manifest = _previous_manifest(layout, live, cfg.rebuild)
    if run.prev_manifest is not None and not cfg.rebuild and world.rank == 0:
        # before anything is scanned or embedded: what an update reads and copies is hashed (the delta layer:
        # small), what it shares and carries forward is sized; --verify hashes everything
        checked = integrity.check_files(
            layout,
            live,
            run.prev_manifest,
            hashed=integrity.ALL if cfg.verify else integrity.UPDATE_READS,
            blocks=True,
            hashed_blocks=cfg.verify,
            ignore=() if cfg.verify else (ENCODER_FILE,),
        )
        run.clock.add("check_previous", checked.seconds)
    gone = None
    with run.clock.phase("scan"):
        if cfg.changed_list:
            scan, gone = scan_listed(image_root, read_changed_list(cfg.changed_list), labels)
        elif scanner is not None:
            scan = scanner(image_root, labels)
        else:
            scan = scan_folder(image_root, labels)
    run.not_images = scan.not_images
    if run.embedder is None:
        run.embedder = _open_embedder(cfg, image_root, world)
    encoder = run.encoder
    if run.prev_manifest is not None and not cfg.rebuild:
        run.prev_manifest.check_encoder(
            encoder.sha256,
            encoder.embedding_dim,
            encoder.path,
            str(layout.root),
            "pass --rebuild to re-embed everything with it",
        )
        if Path(run.prev_manifest.image_root) != image_root:
            if not cfg.reattach:
                raise ArtifactError(
                    f"{layout.root} indexes {run.prev_manifest.image_root}, not {image_root}; pass "
                    "--reattach if the folder moved (unchanged files keep their ids and vectors), "
                    "--rebuild to index this folder instead, or use another --out"
                )
            run.reattached = run.prev_manifest.image_root
            LOG.info(
                "re-attaching %s to %s: files with the same relative path, size and mtime keep their ids",
                layout.root,
                image_root,
            )
    run.base = run.prev_manifest if not cfg.rebuild else None
    with run.clock.phase("plan"):
        store = _open_store(layout.generation(run.previous)) if run.base is not None else None
        try:
            if cfg.changed_list:
                run.plan = plan_listed(scan.entries, gone, store)
                run.plan.unchanged = run.base.count - len(run.plan.changed_ids) - len(run.plan.removed_ids)
            else:
                run.plan = plan_full(scan.entries, store)
        finally:
            if store is not None:
                store.close()
        for rel, reason in scan.skipped:
            run.plan.skipped[rel] = {"path": rel, "bytes": 0, "mtime_ns": 0, "reason": reason}
    expected = (run.base.count if run.base else 0) + len(run.plan.todo) - len(run.plan.removed_ids)
    factory = _wanted(cfg, max(expected, 1), encoder.embedding_dim).factory
    dtype = block_dtype(factory if run.base is None else run.base.factory)
    run.shards = WorkShards(
        layout.work, encoder.sha256, encoder.embedding_dim, cfg.shard_size, rank=world.rank, dtype=dtype
    )
    if world.rank == 0:
        discard_other_models(layout.work, run.shards.dir)


def _previous_manifest(layout: IndexLayout, previous: str | None, rebuild: bool) -> IndexManifest | None:
    """The manifest of the generation this run follows; with ``--rebuild`` only its ``next_id`` matters (ids
    are never reused), so an unreadable one is passed over."""
    if previous is None:
        return None
    try:
        return IndexManifest.read(layout.generation(previous).manifest)
    except ArtifactError as exc:
        if not rebuild:
            raise
        LOG.warning("%s; --rebuild: ids start again from 0", exc)
        return None


def _open_store(gen: GenerationPaths) -> MetadataStore:
    """A generation's metadata, read-only (layered when it has a delta)."""
    return MetadataStore(gen.meta, delta=gen.delta_meta if gen.delta_meta.is_dir() else None)


def _wanted(cfg: IndexConfig, n: int, d: int) -> faiss_index.IndexChoice:
    return faiss_index.choose_index(cfg.index_type, n, d, budget=cfg.max_index_memory)


# --- 2. embed ------------------------------------------------------------------------------------------------


def _embed_share(run: _Run) -> None:
    """Embed this rank's part of the plan into the shards (rank > 0 then says it is done)."""
    cfg, world, plan = run.cfg, run.world, run.plan
    part = part_of_plan(plan.todo, world.rank, world.world_size, cfg.shard_size)
    rendezvous = Rendezvous(run.shards.dir, world, cfg.rank_timeout)
    if world.world_size > 1:
        run.shards.on_flush = rendezvous.progress
        rendezvous.progress(0)
        LOG.info("rank %d of %d: %d of the %d files to embed", world.rank, world.world_size, len(part), len(plan.todo))
    run.embed(part)
    if world.rank != 0:
        rendezvous.mark_done(plan_digest(part), len(part))


def _wait_for_ranks(run: _Run) -> None:
    """Rank 0 of several: wait for the others' shards, then embed whatever they did not."""
    cfg, world, plan, shards = run.cfg, run.world, run.plan, run.shards
    if world.world_size == 1:
        return
    with run.clock.phase("wait_for_ranks"):
        Rendezvous(shards.dir, world, cfg.rank_timeout).wait_for_peers(
            {
                r: plan_digest(part_of_plan(plan.todo, r, world.world_size, cfg.shard_size))
                for r in range(world.world_size)
            }
        )
    shards.refresh()
    gaps = [e for e in plan.todo if shards.lookup(e.path, e.bytes, e.mtime_ns) is None]
    if gaps:
        LOG.warning("rank 0 embeds %d files the other ranks did not (the folder changed during the run?)", len(gaps))
        run.embed(gaps)


# --- 3. commit -----------------------------------------------------------------------------------------------


def _commit(run: _Run) -> IndexResult:
    """Turn the embedded plan into the next generation by one of the three strategies, and publish it (or
    nothing, when nothing changed)."""
    layout, base = run.layout, run.base
    changes = _changes(run)
    if base is None and not changes.readable:
        first = changes.skipped[0]
        raise DataError(
            f"no readable images in {run.image_root} ({len(changes.skipped)} unreadable files, e.g. "
            f"{display_name(first['path'])}: {first['reason']})"
        )
    if base is not None and _nothing_changed(run):
        if _compaction_wanted(run, base):
            result = _compact(run, run.previous, changes)
        else:
            LOG.info("nothing changed in %s; generation %s stays live", run.image_root, run.previous)
            result = _result(run, "unchanged", base, changes)
            write_json_atomic(layout.report, asdict(result))
        run.shards.clear()
        return result

    name = generation_name(generation_number(run.previous) + 1 if run.previous else 1)
    with _staging(layout) as staging:
        if base is None:
            draft = _commit_full(run, staging, name, changes)
        else:
            draft = _commit_update(run, staging, name, changes)
        manifest = _publish(run, staging, draft, changes, previous=run.previous)
    result = _result(run, "build" if base is None else "update", manifest, changes, published=True)
    _write_report(run, result)
    if base is not None and _compaction_wanted(run, manifest):
        # the update and the compaction each keep their own report; the index's says both
        compacted = _compact(run, name, changes)
        result = replace(compacted, mode=result.mode, compacted=compacted.generation)
        write_json_atomic(layout.report, asdict(result))
    run.shards.clear()
    return result


def _changes(run: _Run) -> Changes:
    """What the embedded plan changes: files the encoder could not read join the skipped ones (a changed
    file that became unreadable is removed from the index)."""
    plan, shards = run.plan, run.shards
    failed = {}
    for e in plan.todo:
        entry = shards.lookup(e.path, e.bytes, e.mtime_ns)
        if entry is not None and entry["row"] < 0:
            failed[e.path] = entry
    for path, entry in failed.items():
        plan.skipped[path] = {
            "path": path,
            "bytes": entry["stat_bytes"],
            "mtime_ns": entry["mtime_ns"],
            "reason": entry["error"],
        }
    readable = [e for e in plan.todo if e.path not in failed]
    return Changes(
        readable=readable,
        added=sum(1 for e in readable if e.path not in plan.changed_ids),
        updated=sum(1 for e in readable if e.path in plan.changed_ids),
        removed=len(plan.removed_ids) + sum(1 for p in failed if p in plan.changed_ids),
        skipped=_skipped_list(plan),
    )


def _skipped_list(plan: Plan) -> list[dict]:
    return [{"path": s["path"], "reason": s["reason"]} for s in sorted(plan.skipped.values(), key=lambda s: s["path"])]


def _nothing_changed(run: _Run) -> bool:
    """No file to add, update or remove, the same folder, and the same unreadable files as the live generation
    remembers."""
    if run.plan.todo or run.plan.removed_ids or run.reattached is not None:
        return False
    with _open_store(run.layout.generation(run.previous)) as store:
        return store.skipped() == run.plan.skipped


def _compaction_wanted(run: _Run, manifest: IndexManifest) -> bool:
    cfg = run.cfg
    if cfg.compact == "now":
        return True
    wanted = _wanted(cfg, max(1, manifest.count), manifest.embedding_dim)
    restructure = not faiss_index.same_structure(manifest.factory, wanted.factory) or wanted.on_disk != manifest.on_disk
    if restructure and (cfg.compact == "auto" or cfg.index_type != "auto"):  # never: only an explicit new type
        LOG.info("%s is now %s%s: rebuilding", manifest.factory, wanted.factory, " on disk" if wanted.on_disk else "")
        return True
    return cfg.compact == "auto" and update.needs_compaction(manifest)


RECORD_CHUNK = 10_000  # files committed per step of a full build (its records and vectors, not all at once)


def _records(run: _Run, readable: list[FoundFile], next_id: int) -> list[ItemRecord]:
    """New records with fresh ids in path order (so a resumed run gives the same ids)."""
    records = []
    for i, e in enumerate(readable):
        entry = run.shards.lookup(e.path, e.bytes, e.mtime_ns)
        records.append(
            ItemRecord(
                id=next_id + i,
                path=e.path,
                label=e.label,
                width=entry["width"],
                height=entry["height"],
                bytes=entry["bytes"],
                sha256=entry["sha256"],
                mtime=e.mtime_ns / 1e9,
                mtime_ns=e.mtime_ns,
            )
        )
    return records


def _write_block(
    run: _Run, name: str, ids: np.ndarray, vectors: np.ndarray, dtype
) -> tuple[list[str], dict[str, dict]]:
    """The block of this run's new vectors (none when there are none), and its files' records."""
    if not len(ids):
        return [], {}
    with BlockWriter(run.layout, name, len(ids), vectors.shape[1], dtype) as writer:
        writer.extend(ids, vectors)
    return [name], writer.records


def _commit_full(run: _Run, staging: GenerationPaths, name: str, changes: Changes) -> GenerationDraft:
    """A generation from scratch: one-layer metadata, every vector in one block, a freshly trained index.
    Records and vectors go through in chunks, so 10M files never sit in memory as records or float32 rows."""
    cfg, encoder, readable = run.cfg, run.encoder, changes.readable
    choice = _wanted(cfg, len(readable), encoder.embedding_dim)
    dtype = block_dtype(choice.factory)
    with run.clock.phase("commit"):
        labels, duplicates = {}, 0
        with MetadataStore(staging.meta, readonly=False) as store:
            if run.prev_manifest is not None:  # --rebuild: ids continue, never reused
                store.set_next_id(run.prev_manifest.next_id)
            next_id = store.next_id()
            ids = np.arange(next_id, next_id + len(readable), dtype=np.int64)
            blocks = [name] if readable else []
            with BlockWriter(run.layout, name, len(readable), encoder.embedding_dim, dtype) as writer:
                for start in range(0, len(readable), RECORD_CHUNK):
                    chunk = readable[start : start + RECORD_CHUNK]
                    stored = store.add_items(_records(run, chunk, next_id + start))
                    labels = _label_counts(labels, stored, [])
                    duplicates += sum(r.duplicate_of is not None for r in stored)
                    writer.extend(ids[start : start + len(chunk)], run.shards.vectors([e.path for e in chunk]))
            store.replace_skipped(run.plan.skipped)
            final_next_id = store.next_id()
            store.sync()
    with run.clock.phase("index"):
        built = _build_faiss(run, staging, choice, ids, blocks)
        _copy_encoder(run, staging)
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


def _build_faiss(
    run: _Run,
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


def _commit_update(run: _Run, staging: GenerationPaths, name: str, changes: Changes) -> GenerationDraft:
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


def _compact(run: _Run, source: str, changes: Changes) -> IndexResult:
    """Publish the live content of generation ``source`` as a new base (see ``indexer.update``)."""
    name = generation_name(generation_number(source) + 1)
    with _staging(run.layout) as staging:
        draft = _commit_compaction(run, source, staging, name)
        manifest = _publish(run, staging, draft, changes, previous=source)
    LOG.info("compacted %s into %s (%d items, recall@10 %s)", source, name, manifest.count, manifest.recall_at_10)
    result = _result(run, "compaction", manifest, changes, published=True)
    _write_report(run, result)
    return result


def _commit_compaction(run: _Run, source: str, staging: GenerationPaths, name: str) -> GenerationDraft:
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
        choice = _wanted(cfg, max(1, len(live_ids)), encoder.embedding_dim)
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


# --- 4. publish ----------------------------------------------------------------------------------------------


def _manifest(run: _Run, draft: GenerationDraft, changes: Changes) -> IndexManifest:
    """The manifest of ``draft``: what the commit strategy made, and what the run knows (its model, folder,
    options and the changes it made)."""
    cfg, encoder, base, built = run.cfg, run.encoder, run.base, draft.built
    now = utc_now()
    return IndexManifest(
        generation=draft.name,
        created_at=draft.created_at or (base.created_at if base else now),
        updated_at=now,
        model_sha256=encoder.sha256,
        model=model_summary(encoder.metadata),
        embedding_dim=encoder.embedding_dim,
        index_type=cfg.index_type,
        factory=built.factory,
        search_params=built.search_params,
        recall_at_10=built.recall_at_10,
        exact=built.exact,
        trained_on=built.trained_on,
        built_on_gpu=built.on_gpu,
        count=int(draft.count),
        next_id=int(draft.next_id),
        duplicates=int(draft.duplicates),
        skipped=len(run.plan.skipped),
        labels=draft.labels,
        image_root=str(run.image_root),
        labels_csv=str(Path(cfg.labels_csv).absolute()) if cfg.labels_csv else None,
        vector_blocks=draft.blocks,
        block_dtype=np.dtype(draft.dtype).name,
        on_disk=built.on_disk,
        base_count=int(draft.base_count),
        base_next_id=int(draft.base_next_id),
        delta_count=int(draft.delta_count),
        removed_count=int(draft.removed_count),
        base_generation=draft.base_generation,
        last_update={
            "added": changes.added,
            "updated": changes.updated,
            "removed": changes.removed,
            "unchanged": run.plan.unchanged,
        },
        library_versions=_library_versions(),
        files=draft.files,
        block_files=draft.block_files,
    )


def _publish(
    run: _Run, staging: GenerationPaths, draft: GenerationDraft, changes: Changes, previous: str | None
) -> IndexManifest:
    """Write the manifest of ``draft``, open the generation as a server will, and make it the live one."""
    manifest = _manifest(run, draft, changes)
    with run.clock.phase("publish"):
        manifest.write(staging.manifest)
        _check_opens(run.layout, staging)
        publish(run.layout, staging, manifest.generation, previous)
    return manifest


def _result(
    run: _Run, mode: str, manifest: IndexManifest | None = None, changes: Changes | None = None, published: bool = False
) -> IndexResult:
    """What the run did, as the report and the CLI give it: ``manifest`` is the generation live afterwards
    (None for a rank > 0, which only embeds)."""
    changes = changes or Changes([], 0, 0, 0, [])
    m = manifest
    return IndexResult(
        index_dir=str(run.layout.root),
        generation=m.generation if m else (run.previous or ""),
        published=published,
        count=m.count if m else 0,
        added=changes.added,
        updated=changes.updated,
        removed=changes.removed,
        unchanged=run.plan.unchanged if m else 0,
        duplicates=m.duplicates if m else 0,
        embedded=run.embedded,
        resumed=run.resumed,
        skipped=changes.skipped,
        factory=m.factory if m else "",
        recall_at_10=m.recall_at_10 if m else None,
        search_params=m.search_params if m else {},
        timings=run.clock.report(),
        report_path=str(run.layout.report),
        mode=mode,
        rank=run.world.rank,
        world_size=run.world.world_size,
        delta_count=m.delta_count if m else 0,
        removed_count=m.removed_count if m else 0,
        not_images=run.not_images,
        reattached=run.reattached,
    )


def _write_report(run: _Run, result: IndexResult) -> None:
    """``INDEX_DIR/report.json``, and a copy in the generation the result made."""
    write_json_atomic(run.layout.report, asdict(result))
    if result.published:
        link_or_copy_atomic(run.layout.report, run.layout.generation(result.generation).report)


def _check_opens(layout: IndexLayout, staging: GenerationPaths) -> None:
    """Open the assembled generation as a server will before it is published (every part read, counted and
    checked against the manifest): an update over an unreadable ``vectors.faiss`` published a generation that
    could not be opened, with exit 0. Memory maps where the index type allows, so it costs little more than
    reading the headers.

    Raises:
        ArtifactError: a part that does not open or does not match the manifest.
    """
    with IndexDirectory(layout.root, staging.root.name):
        pass


def _copy_encoder(run: _Run, staging: GenerationPaths) -> None:
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


def _library_versions() -> dict:
    import faiss
    import lmdb
    import onnxruntime

    return {
        "faiss": faiss.__version__,
        "lmdb": lmdb.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
    }
