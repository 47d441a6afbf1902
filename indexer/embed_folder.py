"""``moco embed DIR --model encoder.onnx --out FILE``: a folder's embeddings as Parquet, without keeping an index.

It is ``moco index`` into a work index beside the output (``FILE.work/``, exact search: nothing to train),
then ``moco embeddings`` of that index (``indexer.embeddings_file``: the same columns, ``id`` numbering the
files in path order), then the work folder is deleted. So it is resumable as ``moco index`` is: stopped at any
point, the identical command goes on from the last finished shard (or, when only the Parquet file was left to
write, embeds nothing). A work folder made with another model or folder is started over.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from moco_retrieval.contracts.errors import ArtifactError, ConfigError
from moco_retrieval.indexer.build import IndexResult, build_index_dir
from moco_retrieval.indexer.config import IndexConfig
from moco_retrieval.indexer.embeddings_file import EmbeddingsFile, write_embeddings
from moco_retrieval.indexer.encoder import read_encoder_metadata
from moco_retrieval.indexer.layout import IndexLayout
from moco_retrieval.indexer.manifest import IndexManifest, file_sha256

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbedResult:
    """What :func:`embed_folder` did: the index run over the folder, and the file(s) it wrote."""

    index: IndexResult
    written: EmbeddingsFile


def work_dir_for(out: str | Path) -> Path:
    """Where ``moco embed --out FILE`` keeps its resumable work: ``FILE.work`` beside it."""
    out = Path(out).absolute()
    return out.with_name(out.name + ".work")


def embed_folder(cfg: IndexConfig, npy: bool = False) -> EmbedResult:
    """Embed ``cfg.image_dir`` with ``cfg.model`` and write the vectors to ``cfg.out_dir`` (a file here).

    Args:
        cfg: the options of ``moco index`` (its ``out_dir`` is the Parquet file; the index type is fixed).
        npy: vectors to ``FILE.npy`` and the other columns to ``FILE.parquet`` (see ``indexer.embeddings_file``).

    Raises:
        what ``build_index_dir`` and ``write_embeddings`` raise: DataError (a missing or empty folder),
        ArtifactError (not an encoder), OutputError (unwritable output), ConfigError.
    """
    read_encoder_metadata(cfg.model)  # a missing or foreign model fails before anything is created
    out = Path(cfg.out_dir).absolute()
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; moco embed writes a file (e.g. --out {out / 'items.parquet'})")
    work = work_dir_for(out)
    _start_over_if_foreign(work, cfg)
    result = build_index_dir(replace(cfg, out_dir=str(work), index_type="flat", compact="never"))
    written = write_embeddings(work, out, npy=npy, progress=cfg.progress)
    shutil.rmtree(work, ignore_errors=True)
    return EmbedResult(result, written)


def _start_over_if_foreign(work: Path, cfg: IndexConfig) -> None:
    """Remove a work folder left by a run with another model or folder (its shards cannot be used)."""
    layout = IndexLayout(work)
    try:
        live = layout.current()
        if live is None:
            return
        manifest = IndexManifest.read(layout.generation(live).manifest)
    except ArtifactError as exc:
        LOG.warning("%s is damaged (%s); starting over", work, exc)
        shutil.rmtree(work, ignore_errors=True)
        return
    same_folder = Path(manifest.image_root) == Path(cfg.image_dir).absolute()
    if not same_folder or manifest.model_sha256 != file_sha256(cfg.model):
        LOG.info("%s was made from another %s; starting over", work, "folder" if not same_folder else "model")
        shutil.rmtree(work, ignore_errors=True)
