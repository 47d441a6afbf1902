"""The index-directory format: every path in it, and the atomic publish of a generation.

An index directory holds published *generations*; ``CURRENT`` names the live one::

    INDEX_DIR/
      CURRENT                      one line, the live generation's name, e.g. "g000003" (replaced atomically)
      generations/g000003/         one immutable, self-sufficient generation (enough to serve on its own)
        manifest.json              format, model sha256, embedding dim, metric, factory, counts, recall@10 ...
        vectors.faiss              the *base* FAISS index (CPU, explicit int64 ids, inner product on
                                   L2-normalized rows), as of the last full build or compaction
        vectors.ivfdata            its inverted lists, for an IVF-PQ index kept on disk
        trained.faiss              the trained, empty IVF index (to grow deltas with the same lists)
        delta.faiss                items added since the base (absent when there are none)
        removed.npy                sorted int64 base ids removed since the base (absent when none)
        meta.lmdb/                 the base metadata: id -> record, path -> id, sha256 -> ids, tombstones ...
        delta.lmdb/                metadata written since the base (absent right after a build/compaction)
        encoder.onnx               the model the vectors were made with
        report.json                what the run that published it did: counts and the skipped files
      report.json                  the same for the last run (also one that published nothing)
      vectors/g000003.ids.npy      vectors first embedded by that run: int64 [n] ids and [n, D] rows (float32;
      vectors/g000003.vec.npy      float16 for IVF-PQ); compaction and recall checks read these
      work/<model>/                resumable embedding shards of a run in progress, per rank (deleted on publish)
      .lock                        held (flock) by the one writer

Generations that share a base share its files (``vectors.faiss``, ``vectors.ivfdata``, ``trained.faiss``,
``meta.lmdb/data.mdb``) as hard links, so an update writes only what changed: the delta files and the
removed ids. A generation is written under ``generations/.tmp-*``, renamed into place, then ``CURRENT`` is
replaced with ``os.replace``: a reader sees the old generation or the new one, never a mix. The previous
generation is kept until the next publish, so readers that opened it stay valid while they swap.
``manifest.json`` is :class:`indexer.manifest.IndexManifest`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moco_retrieval.contracts.atomic import fsync_dir, output_errors, write_text_atomic
from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.indexer.manifest import IndexManifest

LOG = logging.getLogger(__name__)

CURRENT_FILE = "CURRENT"
GENERATIONS_DIR = "generations"
VECTORS_DIR = "vectors"
WORK_DIR = "work"
LOCK_FILE = ".lock"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "vectors.faiss"
LISTS_FILE = "vectors.ivfdata"  # the name FAISS's on-disk lists are found under (IO_FLAG_ONDISK_SAME_DIR)
TRAINED_FILE = "trained.faiss"
DELTA_INDEX_FILE = "delta.faiss"
REMOVED_FILE = "removed.npy"
META_DIR = "meta.lmdb"
DELTA_META_DIR = "delta.lmdb"
ENCODER_FILE = "encoder.onnx"
REPORT_FILE = "report.json"
STAGING_PREFIX = ".tmp-"
LMDB_DATA_FILE = "data.mdb"  # LMDB's name for a store's data file (indexer.metadata.DATA_FILE)
# Every data file a generation may hold, by its path inside the generation folder: the keys of the manifest's
# ``files``. Not report.json (what a run did, linked in after publishing) nor LMDB's lock files.
GENERATION_FILES = (
    INDEX_FILE,
    LISTS_FILE,
    TRAINED_FILE,
    DELTA_INDEX_FILE,
    REMOVED_FILE,
    f"{META_DIR}/{LMDB_DATA_FILE}",
    f"{DELTA_META_DIR}/{LMDB_DATA_FILE}",
    ENCODER_FILE,
)
# ... and those an update shares with its predecessor by hard links (the base)
SHARED_FILES = (INDEX_FILE, LISTS_FILE, TRAINED_FILE, f"{META_DIR}/{LMDB_DATA_FILE}")


_GENERATION_NAME = re.compile(r"g[0-9]{6,}")  # what generation_name writes (more digits past 999,999)


def generation_name(number: int) -> str:
    """``7 -> "g000007"``: names sort in publish order."""
    return f"g{number:06d}"


def is_generation_name(name: str) -> bool:
    """True for a name :func:`generation_name` makes (never a path: no ``/``, no ``..``)."""
    return _GENERATION_NAME.fullmatch(name) is not None


def generation_number(name: str) -> int:
    """``"g000007" -> 7``, for a name :func:`is_generation_name` accepts."""
    return int(name[1:])


@dataclass(frozen=True)
class GenerationPaths:
    """The files of one generation directory."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_FILE

    @property
    def index(self) -> Path:
        return self.root / INDEX_FILE

    @property
    def lists(self) -> Path:
        return self.root / LISTS_FILE

    @property
    def trained(self) -> Path:
        return self.root / TRAINED_FILE

    @property
    def delta_index(self) -> Path:
        return self.root / DELTA_INDEX_FILE

    @property
    def removed(self) -> Path:
        return self.root / REMOVED_FILE

    @property
    def meta(self) -> Path:
        return self.root / META_DIR

    @property
    def delta_meta(self) -> Path:
        return self.root / DELTA_META_DIR

    @property
    def encoder(self) -> Path:
        return self.root / ENCODER_FILE

    @property
    def report(self) -> Path:
        return self.root / REPORT_FILE

    def file(self, name: str) -> Path:
        """The path of one of :data:`GENERATION_FILES`."""
        return self.root / name

    def files(self) -> dict[str, Path]:
        """:data:`GENERATION_FILES` present in this generation, by name."""
        return {name: self.root / name for name in GENERATION_FILES if (self.root / name).is_file()}


@dataclass(frozen=True)
class IndexLayout:
    """All paths of an index directory (nothing here touches the disk except the readers)."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def current_file(self) -> Path:
        return self.root / CURRENT_FILE

    @property
    def generations(self) -> Path:
        return self.root / GENERATIONS_DIR

    @property
    def vectors(self) -> Path:
        return self.root / VECTORS_DIR

    @property
    def work(self) -> Path:
        return self.root / WORK_DIR

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def report(self) -> Path:
        """What the last run did, published or not."""
        return self.root / REPORT_FILE

    def generation(self, name: str) -> GenerationPaths:
        return GenerationPaths(self.generations / name)

    def vector_block(self, name: str) -> tuple[Path, Path]:
        """``(ids, vectors)`` files of the block written by generation ``name``."""
        return self.vectors / f"{name}.ids.npy", self.vectors / f"{name}.vec.npy"

    def block_file(self, file_name: str) -> Path:
        """A file of ``vectors/`` by its name (a key of the manifest's ``block_files``)."""
        return self.vectors / file_name

    def generation_names(self) -> list[str]:
        """The generation folders present (published or left by a run that died publishing), oldest first."""
        try:
            names = [p.name for p in self.generations.iterdir() if is_generation_name(p.name) and p.is_dir()]
        except OSError:  # no generations/ folder (nothing written yet), or unreadable: none to name
            return []
        return sorted(names, key=generation_number)

    def current(self) -> str | None:
        """The live generation's name, or ``None`` when nothing was ever published here: no ``CURRENT`` and
        no generation folder.

        A damaged pointer is never taken for "no index": read as "no index", it made the next ``moco index``
        re-embed everything, renumber the ids and delete every generation.

        Raises:
            ArtifactError: ``CURRENT`` is unreadable, empty, holds something that is not a generation name
                (garbage, a path such as ``../..``), or is missing while generation folders exist.
        """
        try:
            raw = self.current_file.read_bytes()[:256]  # one short line; a huge file is damage too
        except FileNotFoundError:
            raw = None
        except OSError as exc:
            raise ArtifactError(
                f"cannot read {self.current_file} ({exc.strerror or exc}); check its permissions, "
                "or rebuild with `moco index --rebuild`"
            ) from exc
        if raw is None:
            if not self.generation_names():
                return None
            problem = "is missing"
        else:
            name = raw.decode("utf-8", "surrogateescape").strip()
            if is_generation_name(name):
                return name
            problem = f"holds '{display_name(name[:40])}', not a generation name" if name else "is empty"
        raise self.damaged_pointer(problem)

    def damaged_pointer(self, problem: str) -> ArtifactError:
        """The one-line error for a ``CURRENT`` that does not name a usable generation."""
        names = self.generation_names()
        held = ", ".join(names) if names else "no generation"
        fix = (
            f"write the live generation's name into it (e.g. `echo {names[-1]} > {self.current_file}`) or "
            if names
            else ""
        )
        return ArtifactError(
            f"{self.current_file} {problem}, and {self.generations} holds {held}; {fix}"
            "rebuild with `moco index --rebuild`"
        )


def current_generation(path: str | os.PathLike) -> str:
    """The live generation's name (one small file read): changes whenever ``moco index`` publishes.

    Raises:
        ArtifactError: ``path`` is not an index directory (nothing published there).
    """
    name = IndexLayout(path).current()
    if name is None:
        raise ArtifactError(f"{path} is not an index directory (no {CURRENT_FILE}); build one with `moco index`")
    return name


# -- publish ----------------------------------------------------------------------------------------------------
def new_staging_dir(layout: IndexLayout) -> GenerationPaths:
    """The paths of an empty folder under ``generations/`` to assemble the next generation in (same
    filesystem, so publishing it is a rename)."""
    with output_errors(layout.generations):
        layout.generations.mkdir(parents=True, exist_ok=True)
        return GenerationPaths(Path(tempfile.mkdtemp(dir=layout.generations, prefix=STAGING_PREFIX)))


def publish(layout: IndexLayout, staging: GenerationPaths, name: str, previous: str | None) -> None:
    """Make ``staging`` the live generation ``name``: rename it into place, then replace ``CURRENT``.

    Everything the generation holds must be written and flushed before this call. Afterwards all generations
    but this one and ``previous`` (the one it replaces: kept for the readers still on it; passed in, since
    after ``moco index --rebuild`` over a damaged ``CURRENT`` there is no pointer to read it from), stale
    staging folders, and vector blocks no kept manifest lists are removed.
    """
    final = layout.generation(name).root
    with output_errors(final):
        os.replace(staging.root, final)
        fsync_dir(layout.generations)
    write_text_atomic(layout.current_file, name + "\n")
    LOG.info("published generation %s of %s", name, layout.root)
    _collect_garbage(layout, keep={name, previous} - {None})


def _collect_garbage(layout: IndexLayout, keep: set[str]) -> None:
    blocks: set[str] = set()
    for name in keep:
        try:
            blocks.update(IndexManifest.read(layout.generation(name).manifest).vector_blocks)
        except ArtifactError:
            pass
    for child in layout.generations.iterdir():
        if child.name not in keep and (child.name.startswith(STAGING_PREFIX) or is_generation_name(child.name)):
            shutil.rmtree(child, ignore_errors=True)
    if layout.vectors.is_dir():
        for block in layout.vectors.iterdir():
            if block.name.split(".")[0] not in blocks:
                block.unlink(missing_ok=True)


def remove_stale_staging(layout: IndexLayout, live: str | None) -> None:
    """Delete what a run that died before publishing left: staging folders and the generations newer than
    ``live`` (renamed into place, ``CURRENT`` never replaced). ``live`` is the live generation (``None``:
    nothing was published, so no generation folder exists either: :meth:`IndexLayout.current`)."""
    newest = generation_number(live) if live else 0
    if layout.generations.is_dir():
        for child in layout.generations.iterdir():
            unpublished = is_generation_name(child.name) and generation_number(child.name) > newest
            if child.name.startswith(STAGING_PREFIX) or unpublished:
                shutil.rmtree(child, ignore_errors=True)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
