"""The values one ``moco index`` run passes between its phases (:mod:`indexer.build`): what it knows
(:class:`Run`), what the embedded plan changes (:class:`Changes`), what a commit strategy assembled
(:class:`GenerationDraft`, :mod:`indexer.commit`), where its seconds went (:class:`Stopwatch`) and what it did
(:class:`IndexResult`, the report).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module stays light to import
    import numpy as np

    from moco_retrieval.contracts.images import FoundFile
    from moco_retrieval.contracts.launch import WorldInfo
    from moco_retrieval.indexer import faiss_index
    from moco_retrieval.indexer.config import IndexConfig
    from moco_retrieval.indexer.embed import Embedder
    from moco_retrieval.indexer.layout import IndexLayout
    from moco_retrieval.indexer.manifest import IndexManifest
    from moco_retrieval.indexer.plan import Plan
    from moco_retrieval.indexer.shards import WorkShards


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
    reused: int = 0  # changed files whose bytes were the ones on record: their stored vectors, not the encoder's


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
class Run:
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
    reused: int = 0  # changed files given their stored vectors (indexer.reuse)
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
