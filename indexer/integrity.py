"""Checksums of a generation's files: recorded in its manifest when it is assembled, checked when it is read.

Damage inside a file used to become results: a garbled ``vectors.faiss`` served items that could no longer
be found, or one id first for every query at a score of 1e36, and a compaction over a damaged vector block
published garbage with "recall@10 1.0". So every generation records the size and sha256 of each data file
(:data:`indexer.layout.GENERATION_FILES`, in ``IndexManifest.files``) and of each file of its vector blocks
(``IndexManifest.block_files``), and each reader checks what it can afford:

=============================  ===========================================================================
when                           what is checked
=============================  ===========================================================================
assembled (every publish)      files written by the run are hashed after writing (vector blocks while they
                               are written); files an update shares with its predecessor by hard links
                               carry the predecessor's record unread, so an update still costs what
                               changed (a predecessor without records is hashed once)
opened (serve, search, the     the size of every recorded file (a ``stat`` each) and, for IVF-PQ, of the
update's predecessor, a new    vector blocks it re-ranks with; the readers check the rest of the structure
generation before publishing)  (LMDB headers, counts, removed ids)
update                         + the sizes of the predecessor's vector blocks (carried forward) and the
                               sha256 of the files it reads and copies: the delta layer and the trained
                               lists, small by construction
compaction                     + the sha256 of everything it rebuilds from: both metadata layers, the
                               trained lists and every vector block
``moco index --verify``        the sha256 of every file and block (then opens the generation)
=============================  ===========================================================================

Manifests written before checksums were recorded have neither field: they open with nothing to compare.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.indexer.layout import (
    DELTA_INDEX_FILE,
    DELTA_META_DIR,
    ENCODER_FILE,
    LMDB_DATA_FILE,
    META_DIR,
    REMOVED_FILE,
    SHARED_FILES,
    TRAINED_FILE,
    GenerationPaths,
    IndexLayout,
    generation_number,
)
from moco_retrieval.indexer.manifest import IndexManifest, file_sha256

LOG = logging.getLogger(__name__)

# The files an update reads or copies from its predecessor (the delta layer and the trained lists): hashed
# before every update, which costs what changed since the last compaction.
UPDATE_READS = (DELTA_INDEX_FILE, REMOVED_FILE, f"{DELTA_META_DIR}/{LMDB_DATA_FILE}", TRAINED_FILE)
# ... and what a compaction rebuilds from (besides the vector blocks)
COMPACTION_READS = (f"{META_DIR}/{LMDB_DATA_FILE}", f"{DELTA_META_DIR}/{LMDB_DATA_FILE}", TRAINED_FILE)
ALL = True  # ``hashed=ALL``: every recorded file


def record(path: Path, sha256: str | None = None) -> dict:
    """``{"bytes", "sha256"}`` of a file (``sha256`` when the caller already has it)."""
    digest = sha256 or file_sha256(path)
    if digest is None:
        raise ArtifactError(f"cannot read {path} to record its checksum; rebuild with `moco index --rebuild`")
    return {"bytes": path.stat().st_size, "sha256": digest}


def record_files(gen: GenerationPaths, known: dict[str, dict]) -> dict[str, dict]:
    """The records of every data file present in ``gen`` (for ``IndexManifest.files``).

    Args:
        known: records to take as they are, unread: the predecessor's, for files shared with it by hard links
            (the same bytes; reading them would cost the whole corpus per update), and the encoder's (whose
            sha256 the run computed). If such a file changed since, the size check before publishing says so.
    """
    return {name: dict(known[name]) if name in known else record(path) for name, path in gen.files().items()}


def carried(manifest: IndexManifest | None, names: Collection[str] = SHARED_FILES) -> dict[str, dict]:
    """The predecessor's records of the files named (those it has)."""
    if manifest is None:
        return {}
    return {name: manifest.files[name] for name in names if name in manifest.files}


def encoder_record(gen: GenerationPaths, sha256: str) -> dict[str, dict]:
    """The encoder copy's record, from the sha256 the run computed of the model it copied."""
    return {ENCODER_FILE: {"bytes": gen.encoder.stat().st_size, "sha256": sha256}}


def record_blocks(layout: IndexLayout, names: list[str], known: dict[str, dict]) -> dict[str, dict]:
    """The records of the files of the named vector blocks (for ``IndexManifest.block_files``): ``known`` ones
    (the predecessor's, those a BlockWriter just wrote) as they are, the others hashed now (blocks of a
    predecessor written before checksums were recorded: once)."""
    out = {}
    for name in names:
        for path in layout.vector_block(name):
            out[path.name] = dict(known[path.name]) if path.name in known else record(path)
    return out


# -- checks ---------------------------------------------------------------------------------------------------
@dataclass
class Checked:
    """What :func:`check_files` looked at."""

    files: int = 0  # files whose size was checked
    hashed: int = 0  # ... and whose sha256 was
    bytes_hashed: int = 0
    seconds: float = 0.0


def _problem(path: Path, want: dict, hashed: bool) -> str | None:
    """What is wrong with ``path`` against its record, or ``None``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if size != want["bytes"]:
        return f"{path} has {size:,} bytes where its manifest recorded {want['bytes']:,} (truncated or replaced)"
    if hashed:
        digest = file_sha256(path)
        if digest is None:
            return f"{path} cannot be read"
        if digest != want["sha256"]:
            return (
                f"{path} is damaged: its sha256 is {digest[:12]}, its manifest recorded {want['sha256'][:12]} "
                "(the same size, other bytes)"
            )
    return None


def _problems(
    layout: IndexLayout,
    manifest: IndexManifest,
    gen: GenerationPaths,
    hashed,
    blocks: bool,
    hashed_blocks: bool,
    checked: Checked,
    ignore: Collection[str] = (),
):
    wanted = [
        (gen.file(name), want, hashed is ALL or name in hashed)
        for name, want in manifest.files.items()
        if name not in ignore
    ]
    if blocks:
        wanted += [(layout.block_file(name), want, hashed_blocks) for name, want in manifest.block_files.items()]
    for path, want, do_hash in wanted:
        problem = _problem(path, want, do_hash)
        checked.files += 1
        if do_hash:
            checked.hashed += 1
            checked.bytes_hashed += want["bytes"]
        if problem:
            yield problem


def check_files(
    layout: IndexLayout,
    generation: str,
    manifest: IndexManifest,
    hashed: Collection[str] | bool = (),
    blocks: bool = False,
    hashed_blocks: bool = False,
    ignore: Collection[str] = (),
) -> Checked:
    """Check the files of ``generation`` against the records of its ``manifest`` (see the module docstring).

    Args:
        hashed: names of :data:`indexer.layout.GENERATION_FILES` whose sha256 is checked too (``ALL``: every
            one); the others have their size checked.
        blocks: check the sizes of the vector blocks' files too; hashed_blocks: and their sha256.
        ignore: files not to look at (an update does not use its predecessor's encoder copy unless it still
            hashes to the model: see ``indexer.commit._copy_encoder``).

    Raises:
        ArtifactError: the first file missing, of another size, or (where hashed) of other bytes, naming it,
            and an older generation that passes the same check, if there is one.
    """
    tic = time.perf_counter()
    checked = Checked()
    gen = layout.generation(generation)
    for problem in _problems(layout, manifest, gen, hashed, blocks, hashed_blocks, checked, ignore):
        raise ArtifactError(f"{problem}; {remedy(layout, generation, hashed, blocks, hashed_blocks)}")
    checked.seconds = time.perf_counter() - tic
    return checked


def remedy(
    layout: IndexLayout,
    damaged: str,
    hashed: Collection[str] | bool = (),
    blocks: bool = False,
    hashed_blocks: bool = False,
) -> str:
    """What to do about a damaged generation: make an older one that passes the same check live (when there is
    one: it shares the base's files by hard links, so it rarely does when those are damaged), or rebuild."""
    for other in reversed(layout.generation_names()):
        if generation_number(other) >= generation_number(damaged):
            continue
        try:
            manifest = IndexManifest.read(layout.generation(other).manifest)
        except ArtifactError:
            continue
        if not manifest.files or any(
            _problems(layout, manifest, layout.generation(other), hashed, blocks, hashed_blocks, Checked())
        ):
            continue
        return (
            f"generation {other} passes the same check: make it live with `echo {other} > "
            f"{layout.current_file}` (without the changes since), or rebuild with `moco index --rebuild`"
        )
    return "rebuild with `moco index --rebuild`"


@dataclass
class Verified:
    """The result of :func:`verify_index_dir`."""

    index_dir: str
    generation: str
    checked: Checked
    recorded: bool  # the manifest records checksums (written by this version or a later one)
    count: int


def verify_index_dir(path: str | os.PathLike) -> Verified:
    """``moco index --verify``: the sha256 of every file and vector block of the live generation against its
    manifest, then the generation opened as a server opens it.

    Raises:
        ArtifactError: not an index directory, a damaged pointer, or a damaged or unreadable generation.
    """
    from moco_retrieval.indexer.index_dir import IndexDirectory  # index_dir checks sizes with this module

    layout = IndexLayout(Path(path).absolute())
    if not layout.root.is_dir():
        raise ArtifactError(f"index directory not found: {layout.root}; build one with `moco index`")
    live = layout.current()
    if live is None:
        raise ArtifactError(f"{layout.root} is not an index directory (nothing published); build one with `moco index`")
    if not layout.generation(live).root.is_dir():
        raise layout.damaged_pointer(f"names {live}, which is not there")
    manifest = IndexManifest.read(layout.generation(live).manifest)
    checked = check_files(layout, live, manifest, hashed=ALL, blocks=True, hashed_blocks=True)
    with IndexDirectory(layout.root, live) as directory:
        count = directory.index.ntotal
    return Verified(str(layout.root), live, checked, bool(manifest.files), int(count))
