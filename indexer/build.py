"""The ``moco index`` pipeline: plan against the live generation, embed what is new (on one or many ranks),
publish what changed.

1. plan (``indexer.plan``): rescan the folder (or stat only a ``--changed-list``) and compare each file's size
   and mtime with the live generation's metadata: unchanged files are not read again; new and changed files
   are embedded; vanished ones removed;
2. embed (``indexer.embed``): into resumable shards (``indexer.shards``); under ``torchrun`` every rank embeds
   its share of the plan and rank 0 waits for the others (``indexer.ranks``), then does the rest alone;
3. commit (``indexer.commit``): one of three strategies (a full build, an update, or a compaction, published
   right after an update once the changes pass 5% of the base and 1,000 items, or the index type must change,
   or ``--compact now``) assembles a staging generation and returns it as a ``GenerationDraft``;
4. publish: one ``_publish`` writes the draft's manifest, opens the generation as a server would and makes it
   live atomically (``indexer.layout.publish``); one ``_result`` makes the report from the live manifest.
   The work shards are deleted after the last publish; the seconds of every phase are on one ``Stopwatch``.

A run that changes nothing publishes nothing. The values the phases pass on are ``indexer.build_types``'.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from moco_retrieval.contracts.atomic import link_or_copy_atomic, output_errors, write_json_atomic
from moco_retrieval.contracts.encoder_format import model_summary
from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError, OutputError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.launch import WorldInfo, world_info_from_env
from moco_retrieval.contracts.locks import writer_lock
from moco_retrieval.indexer import faiss_index, integrity, update
from moco_retrieval.indexer.build_types import (
    Changes,
    GenerationDraft,
    IndexResult,
    Run,
    Stopwatch,
)
from moco_retrieval.indexer.commit import commit_compaction, commit_full, commit_update, wanted_index
from moco_retrieval.indexer.config import IndexConfig
from moco_retrieval.indexer.decode import start_decoder_server
from moco_retrieval.indexer.embed import Embedder, FolderEmbedder
from moco_retrieval.indexer.encoder import OnnxEncoder, available_cores, read_encoder_metadata
from moco_retrieval.indexer.encoder_lanes import CPU_LANES, lane_threads
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.layout import (
    ENCODER_FILE,
    GenerationPaths,
    IndexLayout,
    generation_name,
    generation_number,
    new_staging_dir,
    publish,
    remove_stale_staging,
    utc_now,
)
from moco_retrieval.indexer.manifest import IndexManifest
from moco_retrieval.indexer.metadata import MetadataStore
from moco_retrieval.indexer.plan import Plan, plan_full, plan_listed, read_changed_list, scan_listed
from moco_retrieval.indexer.ranks import Rendezvous, part_of_plan, plan_digest
from moco_retrieval.indexer.scan import read_labels_csv, scan_folder
from moco_retrieval.indexer.shards import WorkShards, discard_other_models
from moco_retrieval.indexer.reuse import reuse_stored_vectors
from moco_retrieval.indexer.vectors import BlockVectors, block_dtype

LOG = logging.getLogger(__name__)


def default_workers(world: WorldInfo | None = None) -> int:
    """Decoding processes of one rank: its share of the cores but the one feeding the encoder, at most 16
    (0, decoding in the rank itself, when it has a single core)."""
    cores = available_cores() // max(1, world.local_world_size if world else 1)
    if world is not None and world.local_world_size > 1:
        return max(0, min(16, cores - 1))
    return max(1, min(16, cores - 1))


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
    run = Run(cfg, layout, image_root, world, clock, embedder)
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


# ONNX Runtime's intra-op threads do not spin-wait between batches: the decode processes and this process's own
# work per image (shards, progress) need the same cores. One process on 2 cores, 56,000 Fashion-MNIST PNGs:
# 2,504-2,552 images/s without spinning, 2,023-2,254 with it (bench/results/index_limit_fmnist56k_*.json).
INDEX_ENCODER_SPIN = False


def _decode_workers(cfg: IndexConfig, world: WorldInfo) -> int:
    """The decode processes of this rank: ``--workers``, or :func:`default_workers`."""
    return cfg.workers if cfg.workers is not None else default_workers(world)


def _open_embedder(cfg: IndexConfig, image_root: Path, world: WorldInfo) -> FolderEmbedder:
    # the rank's share of the cores, split between the CPU lanes (a GPU session runs one lane)
    threads = lane_threads(CPU_LANES, available_cores() // max(1, world.local_world_size))

    def open_on(device: str) -> OnnxEncoder:
        return OnnxEncoder(cfg.model, device=device, threads=threads, spin=INDEX_ENCODER_SPIN)

    device = cfg.device
    if world.world_size > 1 and device in ("auto", "cuda"):  # one GPU per rank of a node
        try:
            encoder = open_on(f"cuda:{world.local_rank}")
        except ConfigError:
            if device == "cuda":
                raise
            encoder = open_on("cpu")
    else:
        encoder = open_on(device)
    workers = _decode_workers(cfg, world)
    lanes = CPU_LANES if encoder.provider == "CPUExecutionProvider" else 1
    return FolderEmbedder(encoder, image_root, cfg.batch_size, workers, lanes)


def _plan(run: Run, labels, scanner, live: str | None) -> None:
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
    if live is None or cfg.rebuild:  # a full build decodes every file: the decoders' server boots beside the scan
        if _decode_workers(cfg, world) > 0 and run.embedder is None:
            start_decoder_server()
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
    factory = wanted_index(cfg, max(expected, 1), encoder.embedding_dim).factory
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


# --- 2. embed ------------------------------------------------------------------------------------------------


def _embed_share(run: Run) -> None:
    """Embed this rank's part of the plan into the shards (rank > 0 then says it is done)."""
    cfg, world, plan = run.cfg, run.world, run.plan
    part = part_of_plan(plan.todo, world.rank, world.world_size, cfg.shard_size)
    rendezvous = Rendezvous(run.shards.dir, world, cfg.rank_timeout)
    if world.world_size > 1:
        run.shards.on_flush = rendezvous.progress
        rendezvous.progress(0)
        LOG.info("rank %d of %d: %d of the %d files to embed", world.rank, world.world_size, len(part), len(plan.todo))
    run.embed(_reuse(run, part))
    if world.rank != 0:
        rendezvous.mark_done(plan_digest(part), len(part))


def _reuse(run: Run, entries: list) -> list:
    """``entries`` less the changed files whose bytes are the ones on record, whose stored vectors go into the
    shards instead (:mod:`indexer.reuse`; an update only: a full build has nothing stored to reuse)."""
    if run.base is None or not run.plan.changed_ids or not entries:
        return entries
    with run.clock.phase("reuse"):
        store = _open_store(run.layout.generation(run.previous))
        try:
            vectors = BlockVectors(run.layout, run.base.vector_blocks)
            left, reused = reuse_stored_vectors(
                entries, run.plan.changed_ids, store, vectors, run.shards, run.image_root, run.cfg.progress
            )
        finally:
            store.close()
    run.reused += reused
    return left


def _wait_for_ranks(run: Run) -> None:
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
        run.embed(_reuse(run, gaps))


# --- 3. commit -----------------------------------------------------------------------------------------------


def _commit(run: Run) -> IndexResult:
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
            draft = commit_full(run, staging, name, changes)
        else:
            draft = commit_update(run, staging, name, changes)
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


def _changes(run: Run) -> Changes:
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


def _nothing_changed(run: Run) -> bool:
    """No file to add, update or remove, the same folder, and the same unreadable files as the live generation
    remembers."""
    if run.plan.todo or run.plan.removed_ids or run.reattached is not None:
        return False
    with _open_store(run.layout.generation(run.previous)) as store:
        return store.skipped() == run.plan.skipped


def _compaction_wanted(run: Run, manifest: IndexManifest) -> bool:
    cfg = run.cfg
    if cfg.compact == "now":
        return True
    wanted = wanted_index(cfg, max(1, manifest.count), manifest.embedding_dim)
    restructure = not faiss_index.same_structure(manifest.factory, wanted.factory) or wanted.on_disk != manifest.on_disk
    if restructure and (cfg.compact == "auto" or cfg.index_type != "auto"):  # never: only an explicit new type
        LOG.info("%s is now %s%s: rebuilding", manifest.factory, wanted.factory, " on disk" if wanted.on_disk else "")
        return True
    return cfg.compact == "auto" and update.needs_compaction(manifest)


def _compact(run: Run, source: str, changes: Changes) -> IndexResult:
    """Publish the live content of generation ``source`` as a new base (see ``indexer.update``)."""
    name = generation_name(generation_number(source) + 1)
    with _staging(run.layout) as staging:
        draft = commit_compaction(run, source, staging, name)
        manifest = _publish(run, staging, draft, changes, previous=source)
    LOG.info("compacted %s into %s (%d items, recall@10 %s)", source, name, manifest.count, manifest.recall_at_10)
    result = _result(run, "compaction", manifest, changes, published=True)
    _write_report(run, result)
    return result


# --- 4. publish ----------------------------------------------------------------------------------------------


def _manifest(run: Run, draft: GenerationDraft, changes: Changes) -> IndexManifest:
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
    run: Run, staging: GenerationPaths, draft: GenerationDraft, changes: Changes, previous: str | None
) -> IndexManifest:
    """Write the manifest of ``draft``, open the generation as a server will, and make it the live one."""
    manifest = _manifest(run, draft, changes)
    with run.clock.phase("publish"):
        manifest.write(staging.manifest)
        _check_opens(run.layout, staging)
        publish(run.layout, staging, manifest.generation, previous)
    return manifest


def _result(
    run: Run, mode: str, manifest: IndexManifest | None = None, changes: Changes | None = None, published: bool = False
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
        reused=run.reused,
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


def _write_report(run: Run, result: IndexResult) -> None:
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
