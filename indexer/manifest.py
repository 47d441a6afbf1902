"""``manifest.json``: what one published generation of an index directory holds, written by ``moco index``
(:mod:`indexer.build`) and read by :mod:`indexer.index_dir` and :mod:`serve`.

:class:`IndexManifest` is the one type for it: :meth:`IndexManifest.write` and :meth:`IndexManifest.read`
round-trip it through JSON, :meth:`IndexManifest.read` refuses files that are not ours or are newer than this
code, and :meth:`IndexManifest.check_encoder` is the one check that an encoder made these vectors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from moco_retrieval.contracts.atomic import write_json_atomic
from moco_retrieval.contracts.errors import ArtifactError


def file_sha256(path: str | os.PathLike) -> str | None:
    """The hex sha256 of a file's bytes (streamed), or ``None`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


INDEX_FORMAT = "moco-retrieval/index"
# 2: base + delta + removed ids (version 1 directories read as base-only). The checksums (files, block_files) were
# added to version 2 compatibly: older readers ignore them, and manifests without them open with nothing to verify.
INDEX_FORMAT_VERSION = 2


@dataclass
class IndexManifest:
    """One generation of an index directory (see ``docs/ARCHITECTURE.md``, "Index directory")."""

    generation: str  # this generation's name, e.g. g000003
    model_sha256: str  # sha256 of the encoder.onnx that made the vectors
    embedding_dim: int  # D of every vector
    factory: str  # FAISS factory string of vectors.faiss
    count: int  # live items (== base_count - removed_count + delta_count)
    next_id: int  # the first id never used (ids are never reused)
    image_root: str  # absolute folder that item paths are relative to
    created_at: str = ""  # ISO 8601 UTC of the first generation of this directory
    updated_at: str = ""  # ISO 8601 UTC of this generation
    model: dict = field(default_factory=dict)  # the encoder's arch, moco_version, image_size, resize, run_id
    metric: str = "inner_product"  # FAISS metric (on L2-normalized vectors: cosine similarity)
    normalized: bool = True  # vectors are L2-normalized
    dtype: str = "float32"  # vector dtype before any compression
    index_type: str = "auto"  # what --index-type asked for
    search_params: dict = field(default_factory=dict)  # tuned {"nprobe": n} / {"efSearch": n} / {}
    recall_at_10: float | None = None  # measured against exact search (1.0 for exact indexes)
    exact: bool = False  # the index is exact (Flat)
    trained_on: int = 0  # vectors the index was trained on (IVF)
    built_on_gpu: bool = False  # training / adding ran on a GPU
    duplicates: int = 0  # live items whose content (sha256) an earlier item already has
    skipped: int = 0  # unreadable files remembered in meta.lmdb
    labels: dict = field(default_factory=dict)  # label -> live item count
    labels_csv: str | None = None  # the --labels CSV, when labels came from one
    vector_blocks: list = field(default_factory=list)  # vectors/<name>.{ids,vec}.npy blocks this generation uses
    block_dtype: str = "float32"  # dtype of the rows of new vector blocks (float16 for IVF-PQ)
    on_disk: bool = False  # the base's inverted lists are in vectors.ivfdata, read from disk
    base_count: int | None = None  # vectors in vectors.faiss (None in version 1: count)
    base_next_id: int | None = None  # ids below this are in the base, the others in the delta (None: next_id)
    delta_count: int = 0  # vectors in delta.faiss (items added since the base)
    removed_count: int = 0  # base ids in removed.npy (removed since the base)
    base_generation: str = ""  # the generation whose build or compaction made the base
    last_update: dict = field(default_factory=dict)  # added, updated, removed, unchanged by the run that made it
    # {"bytes", "sha256"} of every data file, by its path in the generation folder (layout.GENERATION_FILES), and
    # of each file of its vector blocks, by its name in vectors/: what indexer.integrity checks. Empty in
    # manifests written before they were recorded (same format version: older readers ignore the fields).
    files: dict = field(default_factory=dict)
    block_files: dict = field(default_factory=dict)
    library_versions: dict = field(default_factory=dict)  # faiss, lmdb, onnxruntime, numpy
    format: str = INDEX_FORMAT
    format_version: int = INDEX_FORMAT_VERSION

    # -- JSON -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        """Write ``manifest.json`` atomically."""
        write_json_atomic(Path(path), self.to_dict())

    @classmethod
    def read(cls, path: str | os.PathLike) -> "IndexManifest":
        """Read and check a generation's ``manifest.json``.

        Fields this version does not know (written by a newer minor version) are ignored.

        Raises:
            ArtifactError: missing, not JSON, not an index manifest, of a newer format, or incomplete.
        """
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"index manifest not found: {path}; build the index with `moco index`") from None
        except (OSError, ValueError) as exc:
            raise ArtifactError(
                f"unreadable index manifest {path} ({exc}); rebuild with `moco index --rebuild`"
            ) from exc
        if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
            raise ArtifactError(f"{path} is not a moco-retrieval index manifest; build the index with `moco index`")
        if not isinstance(raw.get("format_version"), int) or raw["format_version"] > INDEX_FORMAT_VERSION:
            raise ArtifactError(
                f"{path} has index format {raw.get('format_version')}, newer than this "
                f"moco-retrieval reads ({INDEX_FORMAT_VERSION}); upgrade moco-retrieval"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            manifest = cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:  # a required field is missing
            raise ArtifactError(
                f"index manifest {path} is incomplete ({exc}); rebuild with `moco index --rebuild`"
            ) from exc
        if manifest.base_count is None:  # version 1: everything is in the base
            manifest.base_count = manifest.count
        if manifest.base_next_id is None:
            manifest.base_next_id = manifest.next_id
        return manifest

    # -- checks -----------------------------------------------------------------------------------------------
    def check_encoder(self, sha256: str, embedding_dim: int, path, where: str, remedy: str) -> None:
        """Refuse an encoder that did not make these vectors.

        Args:
            sha256, embedding_dim: the encoder file's sha256 and the dimension it declares.
            path: the encoder file, for the message.
            where: the index directory, for the message.
            remedy: what the user should do, appended to the message.

        Raises:
            ArtifactError: another model (sha256), or vectors of another dimension.
        """
        if sha256 != self.model_sha256:
            raise ArtifactError(
                f"index {where} was built with another model ({self.model_sha256[:12]}; "
                f"{path} is {sha256[:12]}); {remedy}"
            )
        if embedding_dim != self.embedding_dim:
            raise ArtifactError(
                f"index {where} holds {self.embedding_dim}-d vectors, but {path} makes {embedding_dim}-d ones; {remedy}"
            )


def check_encoder_copy(path: str | os.PathLike, manifest: IndexManifest, where: str) -> None:
    """Refuse a generation's own ``encoder.onnx`` that is no longer the model its manifest names (its sha256),
    before anything parses it: a damaged copy failed inside ONNX Runtime with a traceback, or read as the
    user's choice of another model.

    Raises:
        ArtifactError: missing, unreadable or damaged.
    """
    digest = file_sha256(path)
    if digest is None:
        raise ArtifactError(
            f"{path} is missing or unreadable; rebuild with `moco index --rebuild`, or pass "
            "--model with the encoder the index was built with"
        )
    if digest != manifest.model_sha256:
        raise ArtifactError(
            f"index {where} was built with another model ({manifest.model_sha256[:12]}) than its own "
            f"copy {path} ({digest[:12]}): the copy is damaged or was replaced; rebuild with "
            "`moco index --rebuild`, or pass --model with the encoder the index was built with"
        )
