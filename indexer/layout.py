"""The index-directory format: every path in it, the manifest, and the atomic publish of a generation.

An index directory holds published *generations*; ``CURRENT`` names the live one::

    INDEX_DIR/
      CURRENT                      one line, the live generation's name, e.g. "g000003" (replaced atomically)
      generations/g000003/         one immutable, self-sufficient generation (enough to serve on its own)
        manifest.json              format, model sha256, embedding dim, metric, factory, count, recall@10 ...
        vectors.faiss              CPU FAISS index, explicit int64 ids (inner product on L2-normalized rows)
        meta.lmdb/                 id -> record, path -> id, sha256 -> ids, tombstones, skipped files
        encoder.onnx               the model the vectors were made with
        report.json                what the run that published it did: counts and the skipped files
      vectors/g000003.ids.npy      the vectors first embedded by that run: int64 [n] ids and float32 [n, D]
      vectors/g000003.vec.npy      rows; the index is (re)built from these, so later generations share them
      work/                        resumable embedding shards of a run in progress (deleted on publish)
      .lock                        held (flock) by the one writer

A generation is written under ``generations/.tmp-*``, renamed into place, then ``CURRENT`` is replaced with
``os.replace``: a reader sees the old generation or the new one, never a mix. The previous generation is kept
until the next publish, so readers that opened it stay valid while they swap.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ArtifactError, OutputError

LOG = logging.getLogger(__name__)

INDEX_FORMAT = "moco-retrieval/index"
INDEX_FORMAT_VERSION = 1
CURRENT_FILE = "CURRENT"
GENERATIONS_DIR = "generations"
VECTORS_DIR = "vectors"
WORK_DIR = "work"
LOCK_FILE = ".lock"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "vectors.faiss"
META_DIR = "meta.lmdb"
ENCODER_FILE = "encoder.onnx"
REPORT_FILE = "report.json"


def generation_name(number: int) -> str:
    """``7 -> "g000007"``: names sort in publish order."""
    return f"g{number:06d}"


def generation_number(name: str) -> int:
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
    def meta(self) -> Path:
        return self.root / META_DIR

    @property
    def encoder(self) -> Path:
        return self.root / ENCODER_FILE

    @property
    def report(self) -> Path:
        return self.root / REPORT_FILE


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

    def generation(self, name: str) -> GenerationPaths:
        return GenerationPaths(self.generations / name)

    def vector_block(self, name: str) -> tuple[Path, Path]:
        """``(ids, vectors)`` files of the block written by generation ``name``."""
        return self.vectors / f"{name}.ids.npy", self.vectors / f"{name}.vec.npy"

    def current(self) -> str | None:
        """The live generation's name, or ``None`` when nothing was published yet."""
        try:
            name = self.current_file.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ArtifactError(f"cannot read {self.current_file}: {exc.strerror or exc}") from exc
        return name or None


def current_generation(path: str | os.PathLike) -> str:
    """The live generation's name (one small file read): changes whenever ``moco index`` publishes.

    Raises:
        ArtifactError: ``path`` is not an index directory (nothing published there).
    """
    name = IndexLayout(path).current()
    if name is None:
        raise ArtifactError(f"{path} is not an index directory (no {CURRENT_FILE}); build one with `moco index`")
    return name


# -- manifest ---------------------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict:
    """Read and check a generation's ``manifest.json``.

    Raises:
        ArtifactError: missing, not JSON, not an index manifest, or of a newer format.
    """
    path = Path(path)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"index manifest not found: {path}; build the index with `moco index`") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"unreadable index manifest {path} ({exc}); rebuild with `moco index --rebuild`") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != INDEX_FORMAT:
        raise ArtifactError(f"{path} is not a moco-retrieval index manifest; build the index with `moco index`")
    if manifest.get("format_version", 0) > INDEX_FORMAT_VERSION:
        raise ArtifactError(f"{path} has index format {manifest['format_version']}, newer than this moco-retrieval "
                            f"reads ({INDEX_FORMAT_VERSION}); upgrade moco-retrieval")
    return manifest


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temp file in the same folder, fsync it, and rename it over ``path``."""
    with output_errors(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(obj, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class output_errors:
    """Context manager: an OSError while writing ``what`` (full disk, permissions...) becomes an OutputError."""

    def __init__(self, what: str | os.PathLike):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not issubclass(exc_type, OSError):
            return False
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"disk full while writing {self.what}; free some space and rerun the same command "
                              "(finished work is kept)") from exc
        raise OutputError(f"cannot write {self.what} ({exc.strerror or exc}); choose a writable --out") from exc


# -- publish ----------------------------------------------------------------------------------------------------
def new_staging_dir(layout: IndexLayout) -> Path:
    """An empty folder under ``generations/`` to assemble the next generation in (same filesystem)."""
    with output_errors(layout.generations):
        layout.generations.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=layout.generations, prefix=".tmp-"))


def publish(layout: IndexLayout, staging: Path, name: str) -> None:
    """Make ``staging`` the live generation ``name``: rename it into place, then replace ``CURRENT``.

    Everything the generation holds must be written and flushed before this call. Afterwards all generations
    but this one and the previous one, stale staging folders, and vector blocks no kept manifest lists are
    removed.
    """
    previous = layout.current()
    final = layout.generation(name).root
    with output_errors(final):
        os.replace(staging, final)
        fsync_dir(layout.generations)
        tmp = layout.root / f".{CURRENT_FILE}.tmp"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, layout.current_file)
        fsync_dir(layout.root)
    LOG.info("published generation %s of %s", name, layout.root)
    _collect_garbage(layout, keep={name, previous} - {None})


def _collect_garbage(layout: IndexLayout, keep: set[str]) -> None:
    blocks: set[str] = set()
    for name in keep:
        try:
            blocks.update(read_manifest(layout.generation(name).manifest).get("vector_blocks", []))
        except ArtifactError:
            pass
    for child in layout.generations.iterdir():
        if child.name not in keep and (child.name.startswith(".tmp-") or child.name.startswith("g")):
            shutil.rmtree(child, ignore_errors=True)
    if layout.vectors.is_dir():
        for block in layout.vectors.iterdir():
            if block.name.split(".")[0] not in blocks:
                block.unlink(missing_ok=True)


def remove_stale_staging(layout: IndexLayout) -> None:
    """Delete what a run that died before publishing left: staging folders and unpublished generations."""
    current = layout.current()
    newest = generation_number(current) if current else 0
    if layout.generations.is_dir():
        for child in layout.generations.iterdir():
            unpublished = child.name.startswith("g") and child.name[1:].isdigit() and int(child.name[1:]) > newest
            if child.name.startswith(".tmp-") or unpublished:
                shutil.rmtree(child, ignore_errors=True)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def __getattr__(name: str):
    # IndexDirectory lives in indexer.index_dir (it needs faiss and lmdb); re-exported here lazily so
    # ``from indexer.layout import IndexDirectory`` works without importing them for plain path work.
    if name == "IndexDirectory":
        from indexer.index_dir import IndexDirectory

        return IndexDirectory
    raise AttributeError(name)
