"""The ``moco index`` pipeline: scan, diff against the live generation, embed what is new, publish.

1. scan the folder (``indexer.scan``) and compare each file's size and mtime with the live generation's
   metadata: unchanged files are not read again; new and changed files are embedded; vanished ones removed;
2. embed: worker processes read, hash, decode and resize (``indexer.decode``); this process batches them
   through the ONNX encoder; results go to resumable shards (``indexer.shards``);
3. commit into a staging generation: copy the metadata store, tombstone removed and changed ids, add new
   records with fresh ids (in path order, so an interrupted run resumed gives the same ids), write the new
   vectors as a block (``indexer.vectors``), rebuild the FAISS index from the live vectors of all blocks
   (``indexer.faiss_index``), copy the encoder, write manifest and report;
4. publish it atomically (``indexer.layout.publish``) and delete the shards.

A run that changes nothing publishes nothing.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from contracts.atomic import link_or_copy_atomic, output_errors, write_json_atomic
from contracts.errors import ArtifactError, ConfigError, DataError, OutputError
from contracts.filenames import display_name
from indexer import faiss_index
from indexer.decode import decode_files
from indexer.encoder import OnnxEncoder, available_cores
from indexer.layout import (
    IndexLayout,
    generation_name,
    generation_number,
    new_staging_dir,
    publish,
    remove_stale_staging,
    utc_now,
)
from indexer.manifest import IndexManifest
from indexer.metadata import MetadataStore, copy_store
from indexer.scan import ScanEntry, read_labels_csv, scan_folder
from indexer.shards import WorkShards
from indexer.vectors import BlockWriter, block_exists, live_blocks

LOG = logging.getLogger(__name__)


def default_workers() -> int:
    """Decoding processes: all cores but the one feeding the encoder, at most 16."""
    return max(1, min(16, available_cores() - 1))


@dataclass
class IndexConfig:
    """Everything ``moco index`` needs; the CLI builds it and nothing more."""

    image_dir: str                      # folder of images, scanned recursively
    model: str                          # encoder.onnx from `moco export`
    out_dir: str                        # the index directory (created; updated in place on later runs)
    index_type: str = "auto"            # auto, flat, hnsw, ivf, ivfpq or a FAISS factory string
    batch_size: int = 64                # images per encoder call
    workers: int = field(default_factory=default_workers)  # decoding processes (0 = decode in this process)
    device: str = "auto"                # encoder device: auto (GPU when usable), cpu or cuda
    labels_csv: str | None = None       # optional path,label CSV; default labels are first-level subfolders
    rebuild: bool = False               # ignore the existing index (another model, another folder) and start over
    shard_size: int = 1024              # embeddings per resumable shard
    target_recall: float = faiss_index.TARGET_RECALL  # recall@10 the search parameters are tuned to reach
    progress: bool = True               # show a progress bar

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.workers < 0:
            raise ConfigError(f"--workers must be 0 or more, got {self.workers}")
        if self.shard_size < 1:
            raise ConfigError(f"--shard-size must be at least 1, got {self.shard_size}")
        if not 0 < self.target_recall <= 1:
            raise ConfigError(f"--target-recall must be in (0, 1], got {self.target_recall}")


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
    embedded: int                     # files decoded + embedded by this run (resumed ones not included)
    resumed: int                      # results taken from the shards of an interrupted run
    skipped: list[dict]               # [{path, reason}] files that could not be indexed
    factory: str
    recall_at_10: float | None
    search_params: dict
    timings: dict                     # seconds: scan, embed (total, decode_wait, encoder), commit, index, total
    report_path: str


@dataclass
class _Plan:
    """The difference between the folder and the live generation."""

    todo: list[ScanEntry]             # new or changed files, in path order
    changed_ids: dict[str, int]       # path -> old id, for changed files
    removed_ids: list[int]            # ids of vanished files
    unchanged: int
    skipped: dict[str, dict]          # path -> {path, bytes, mtime_ns, reason}, still unreadable + unchanged


@contextmanager
def _writer_lock(layout: IndexLayout):
    """Hold ``INDEX_DIR/.lock`` so that two ``moco index`` runs never write the same directory."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with output_errors(layout.lock):
        f = open(layout.lock, "a+")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArtifactError(f"another `moco index` is writing {layout.root}; wait for it to finish") from None
        yield
    finally:
        f.close()


def build_index_dir(cfg: IndexConfig) -> IndexResult:
    """Create or update the index directory ``cfg.out_dir`` from ``cfg.image_dir`` (see the module docstring).

    Raises:
        DataError: missing or empty image folder.
        ArtifactError: not an encoder; an index built with another model, dimension or folder (without
            ``rebuild``); another run holds the directory.
        OutputError: the output cannot be written (permissions, full disk).
        ConfigError: bad options (unknown index type or device).
        IndexBuildError: FAISS or LMDB failed.
    """
    t_start = time.perf_counter()
    layout = IndexLayout(Path(cfg.out_dir).absolute())
    image_root = Path(cfg.image_dir).absolute()
    with output_errors(layout.root):
        if layout.root.exists() and not layout.root.is_dir():
            raise OutputError(f"--out {layout.root} exists and is not a folder; choose another --out")
        layout.root.mkdir(parents=True, exist_ok=True)
    if not os.access(layout.root, os.W_OK):
        raise OutputError(f"cannot write {layout.root} (permission denied); choose a writable --out")
    labels = read_labels_csv(cfg.labels_csv) if cfg.labels_csv else None
    with _writer_lock(layout):
        return _build_locked(cfg, layout, image_root, labels, t_start)


def _build_locked(cfg: IndexConfig, layout: IndexLayout, image_root: Path, labels, t_start: float) -> IndexResult:
    remove_stale_staging(layout)
    tic = time.perf_counter()
    scan = scan_folder(image_root, labels)
    t_scan = time.perf_counter() - tic
    encoder = OnnxEncoder(cfg.model, device=cfg.device)
    previous = layout.current()
    prev_manifest = IndexManifest.read(layout.generation(previous).manifest) if previous else None
    if prev_manifest is not None and not cfg.rebuild:
        prev_manifest.check_encoder(encoder, str(layout.root), "pass --rebuild to re-embed everything with it")
        if Path(prev_manifest.image_root) != image_root:
            raise ArtifactError(f"{layout.root} indexes {prev_manifest.image_root}, not {image_root}; use another "
                                "--out, or pass --rebuild to index this folder instead")
    base = prev_manifest if not cfg.rebuild else None
    prev_store = MetadataStore(layout.generation(previous).meta) if base is not None else None
    try:
        plan = _plan(scan.entries, prev_store)
    finally:
        if prev_store is not None:
            prev_store.close()
    for rel, reason in scan.skipped:
        plan.skipped[rel] = {"path": rel, "bytes": 0, "mtime_ns": 0, "reason": reason}

    shards = WorkShards(layout.work, encoder.sha256, encoder.embedding_dim, cfg.shard_size)
    embed_stats = _embed(cfg, encoder, image_root, plan.todo, shards)
    failed = {e.path: shards.lookup(e.path, e.bytes, e.mtime_ns) for e in plan.todo}
    failed = {p: e for p, e in failed.items() if e is not None and e["row"] < 0}
    for path, entry in failed.items():
        plan.skipped[path] = {"path": path, "bytes": entry["stat_bytes"], "mtime_ns": entry["mtime_ns"],
                              "reason": entry["error"]}
    readable = [e for e in plan.todo if e.path not in failed]
    added = sum(1 for e in readable if e.path not in plan.changed_ids)
    updated = sum(1 for e in readable if e.path in plan.changed_ids)
    # a changed file that became unreadable is removed from the index
    removed = len(plan.removed_ids) + sum(1 for p in failed if p in plan.changed_ids)
    skipped_list = [{"path": s["path"], "reason": s["reason"]} for s in sorted(plan.skipped.values(),
                                                                                key=lambda s: s["path"])]
    if base is None and not readable:
        raise DataError(f"no readable images in {image_root} ({len(plan.skipped)} unreadable files, e.g. "
                        f"{display_name(skipped_list[0]['path'])}: {skipped_list[0]['reason']})")
    factory_now = None
    if base is not None and not plan.todo and not plan.removed_ids:
        factory_now = faiss_index.choose_factory(cfg.index_type, base.count, encoder.embedding_dim)
    prev_skipped = None
    if base is not None:
        with MetadataStore(layout.generation(previous).meta) as store:
            prev_skipped = store.skipped()
    if factory_now is not None and factory_now == base.factory and prev_skipped == plan.skipped:
        LOG.info("nothing changed in %s; generation %s stays live", image_root, previous)
        shards.clear()
        result = IndexResult(
            index_dir=str(layout.root), generation=previous, published=False, count=base.count, added=0,
            updated=0, removed=0, unchanged=plan.unchanged, duplicates=base.duplicates, embedded=0,
            resumed=0, skipped=skipped_list, factory=base.factory, recall_at_10=base.recall_at_10,
            search_params=base.search_params,
            timings={"scan": t_scan, "total": time.perf_counter() - t_start}, report_path=str(layout.report))
        write_json_atomic(layout.report, asdict(result))
        return result

    tic = time.perf_counter()
    name = generation_name(generation_number(previous) + 1 if previous else 1)
    staging = new_staging_dir(layout)
    store_path = staging.meta
    if base is not None:
        with output_errors(store_path):
            copy_store(layout.generation(previous).meta, store_path)
    with MetadataStore(store_path, readonly=False) as store:
        if base is None and prev_manifest is not None:  # --rebuild: ids continue, never reused
            store.set_next_id(prev_manifest.next_id)
        old_ids = list(plan.removed_ids) + [plan.changed_ids[p] for p in sorted(plan.changed_ids)]
        store.remove_items(old_ids, name)
        next_id = store.next_id()
        records = []
        with BlockWriter(layout, name, len(readable), encoder.embedding_dim) as writer:
            for i, e in enumerate(readable):
                entry = shards.lookup(e.path, e.bytes, e.mtime_ns)
                item_id = next_id + i
                records.append({"id": item_id, "path": e.path, "label": e.label, "width": entry["width"],
                                "height": entry["height"], "bytes": entry["bytes"], "sha256": entry["sha256"],
                                "mtime": e.mtime_ns / 1e9, "mtime_ns": e.mtime_ns})
                writer.append(item_id, shards.vector(e.path))
        store.add_items(records)
        store.replace_skipped(plan.skipped)
        live, label_counts, duplicates = [], {}, 0
        for rec in store.iter_records():
            live.append(rec["id"])
            if rec["label"] is not None:
                label_counts[rec["label"]] = label_counts.get(rec["label"], 0) + 1
            duplicates += rec["duplicate_of"] is not None
        final_next_id = store.next_id()
        store.sync()
    blocks = [b for b in (base.vector_blocks if base else []) if block_exists(layout, b)]
    blocks += [name] if readable else []
    t_commit = time.perf_counter() - tic

    tic = time.perf_counter()
    live_ids = np.asarray(live, dtype=np.int64)  # iter_records yields id order: already sorted
    factory = faiss_index.choose_factory(cfg.index_type, len(live_ids), encoder.embedding_dim)
    built = faiss_index.build_index(factory, encoder.embedding_dim, len(live_ids),
                                    live_blocks(layout, blocks, live_ids), target_recall=cfg.target_recall)
    with output_errors(staging.index):
        faiss_index.write_index(built.index, str(staging.index))
        same_model = prev_manifest is not None and prev_manifest.model_sha256 == encoder.sha256
        _copy_encoder(encoder.path, staging.encoder, layout.generation(previous).encoder if same_model else None)
    t_index = time.perf_counter() - tic

    now = utc_now()
    manifest = IndexManifest(
        generation=name, created_at=base.created_at if base else now, updated_at=now,
        model_sha256=encoder.sha256, model=_model_summary(encoder), embedding_dim=encoder.embedding_dim,
        index_type=cfg.index_type, factory=built.factory, search_params=built.search_params,
        recall_at_10=built.recall_at_10, exact=built.exact, trained_on=built.trained_on, built_on_gpu=built.on_gpu,
        count=int(len(live_ids)), next_id=final_next_id, duplicates=duplicates, skipped=len(plan.skipped),
        labels=dict(sorted(label_counts.items())), image_root=str(image_root),
        labels_csv=str(Path(cfg.labels_csv).absolute()) if cfg.labels_csv else None, vector_blocks=blocks,
        last_update={"added": added, "updated": updated, "removed": removed, "unchanged": plan.unchanged},
        library_versions=_library_versions(),
    )
    timings = {"scan": t_scan, **{k: v for k, v in embed_stats.items() if k not in ("embedded", "resumed")},
               "commit": t_commit, "index": t_index}
    result = IndexResult(
        index_dir=str(layout.root), generation=name, published=True, count=int(len(live_ids)), added=added,
        updated=updated, removed=removed, unchanged=plan.unchanged, duplicates=duplicates,
        embedded=embed_stats["embedded"], resumed=embed_stats["resumed"], skipped=skipped_list,
        factory=built.factory, recall_at_10=built.recall_at_10, search_params=built.search_params,
        timings=timings, report_path=str(layout.report))
    manifest.write(staging.manifest)
    publish(layout, staging, name)
    shards.clear()
    result.timings["total"] = time.perf_counter() - t_start
    write_json_atomic(layout.report, asdict(result))
    link_or_copy_atomic(layout.report, layout.generation(name).report)
    return result


def _plan(entries: list[ScanEntry], store: MetadataStore | None) -> _Plan:
    """Split the scanned files into unchanged, to-embed (new or changed) and removed, against ``store``."""
    if store is None:
        return _Plan(todo=list(entries), changed_ids={}, removed_ids=[], unchanged=0, skipped={})
    live = dict(store.iter_ids_with_paths())
    old_skipped = store.skipped()
    todo, changed, unchanged, skipped = [], {}, 0, {}
    records = dict(zip(live.keys(), store.records(list(live.values()))))
    for e in entries:
        rec = records.get(e.path)
        if rec is not None and rec["bytes"] == e.bytes and rec["mtime_ns"] == e.mtime_ns and rec["label"] == e.label:
            unchanged += 1
            continue
        was_skipped = old_skipped.get(e.path)
        if rec is None and was_skipped and was_skipped["bytes"] == e.bytes and was_skipped["mtime_ns"] == e.mtime_ns:
            skipped[e.path] = was_skipped  # still the same unreadable file: not read again
            continue
        if rec is not None:
            changed[e.path] = rec["id"]
        todo.append(e)
    present = {e.path for e in entries}
    removed = sorted(i for p, i in live.items() if p not in present)
    return _Plan(todo=todo, changed_ids=changed, removed_ids=removed, unchanged=unchanged, skipped=skipped)


def _embed(cfg: IndexConfig, encoder: OnnxEncoder, image_root: Path, todo: list[ScanEntry],
           shards: WorkShards) -> dict:
    """Embed every file of ``todo`` no finished shard holds; returns counts and where the time went."""
    from tqdm import tqdm

    pending = [e for e in todo if shards.lookup(e.path, e.bytes, e.mtime_ns) is None]
    resumed = len(todo) - len(pending)
    stats = {"embedded": len(pending), "resumed": resumed, "embed": 0.0, "decode_wait": 0.0, "encoder": 0.0,
             "decode_cpu": 0.0}
    if not pending:
        return stats
    by_path = {e.path: e for e in pending}
    bar = tqdm(total=len(todo), initial=resumed, unit="img", desc="embedding", disable=not cfg.progress,
               dynamic_ncols=True, smoothing=0.1)
    batch: list = []

    def run_batch() -> None:
        tic = time.perf_counter()
        vectors = encoder.embed(np.stack([d.pixels for d in batch]))
        stats["encoder"] += time.perf_counter() - tic
        for d, v in zip(batch, vectors):
            shards.add(_entry(by_path[d.path], d), v)
        bar.update(len(batch))
        batch.clear()

    tic_all = time.perf_counter()
    stream = decode_files(image_root, [e.path for e in pending], encoder.image_size, encoder.resize, cfg.workers)
    try:
        while True:
            tic = time.perf_counter()
            try:
                d = next(stream)
            except StopIteration:
                break
            finally:
                stats["decode_wait"] += time.perf_counter() - tic
            stats["decode_cpu"] += d.seconds
            if d.pixels is None:
                LOG.warning("skipping %s: %s", display_name(d.path), d.error)
                shards.add(_entry(by_path[d.path], d), None)
                bar.update(1)
                continue
            batch.append(d)
            if len(batch) >= cfg.batch_size:
                run_batch()
        if batch:
            run_batch()
    finally:
        stream.close()
        shards.flush()  # keep finished work on Ctrl-C too
        bar.close()
    stats["embed"] = time.perf_counter() - tic_all
    return stats


def _entry(e: ScanEntry, d) -> dict:
    return {"path": e.path, "stat_bytes": e.bytes, "mtime_ns": e.mtime_ns, "sha256": d.sha256, "width": d.width,
            "height": d.height, "bytes": d.bytes, "error": d.error}


def _copy_encoder(src: Path, dst: Path, same_in_previous: Path | None) -> None:
    """Copy the encoder into the generation; a hard link to the previous generation's copy when it is the same
    model (generations are immutable, so they can share the file)."""
    link_or_copy_atomic(same_in_previous if same_in_previous is not None and same_in_previous.is_file() else src, dst)


def _model_summary(encoder: OnnxEncoder) -> dict:
    keys = ("arch", "moco_version", "image_size", "embedding_dim", "resize", "run_id", "format_version")
    return {k: encoder.metadata[k] for k in keys if k in encoder.metadata}


def _library_versions() -> dict:
    import faiss
    import lmdb
    import onnxruntime

    return {"faiss": faiss.__version__, "lmdb": lmdb.__version__, "onnxruntime": onnxruntime.__version__,
            "numpy": np.__version__}
