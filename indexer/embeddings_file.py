"""The live items of an index directory as one file others can read: Parquet, or ``.npy`` + Parquet metadata.

``moco embeddings INDEX_DIR --out FILE`` writes, for every live item of the live generation (ascending ids):

    id       int64     the item's id (what the index, the API and the LMDB metadata call it)
    path     string    its path relative to the image folder, readable (``\\xNN`` for bytes that are not UTF-8)
    path_bytes binary  the path's own bytes where the name is not UTF-8 (null otherwise), so nothing is lost
    label    string    its label (null when unlabeled)
    width, height int32  the original image's size
    sha256   string    of the file's bytes
    vector   fixed_size_list<float32>[D]   the L2-normalized embedding, as stored for the index

With ``npy=True`` (clip-retrieval's layout) the vectors go to ``FILE.npy`` as float32 ``[N, D]`` and the other
columns to ``FILE.parquet``, row ``i`` of one the item of row ``i`` of the other.

Rows are streamed a vector block at a time (``ROW_GROUP`` rows per Parquet row group), so the corpus never sits
in memory; both files appear under their final names only when complete (:mod:`contracts.atomic`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moco_retrieval.contracts.atomic import atomic_path, atomic_write
from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.layout import IndexLayout
from moco_retrieval.indexer.records import ItemRecord
from moco_retrieval.indexer.vectors import live_blocks

LOG = logging.getLogger(__name__)

ROW_GROUP = 65_536  # rows per Parquet row group: ~130 MB of 512-d vectors, a few MB of metadata


@dataclass(frozen=True)
class EmbeddingsFile:
    """What :func:`write_embeddings` wrote."""

    paths: tuple[Path, ...]
    rows: int
    dim: int
    generation: str
    seconds: float


def _schema(dim: int, with_vector: bool):
    import pyarrow as pa

    fields = [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("path", pa.string(), nullable=False),
        pa.field("path_bytes", pa.binary()),
        pa.field("label", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("sha256", pa.string()),
    ]
    if with_vector:
        fields.append(pa.field("vector", pa.list_(pa.float32(), dim), nullable=False))
    return pa.schema(fields)


def _raw_bytes(path: str) -> bytes | None:
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
        return None
    except UnicodeDecodeError:
        return raw


def _table(ids: np.ndarray, xb: np.ndarray | None, records: list[ItemRecord | None], schema):
    """One row group: ``ids`` [m], ``xb`` [m, D] float32 (or None), their records."""
    import pyarrow as pa

    missing = [int(i) for i, rec in zip(ids, records) if rec is None]
    if missing:
        raise ArtifactError(f"items {missing[:5]} have vectors but no metadata; rebuild with `moco index --rebuild`")
    columns = {
        "id": pa.array(ids, pa.int64()),
        "path": pa.array([display_name(r.path) for r in records], pa.string()),
        "path_bytes": pa.array([_raw_bytes(r.path) for r in records], pa.binary()),
        "label": pa.array([display_name(r.label) for r in records], pa.string()),
        "width": pa.array([r.width for r in records], pa.int32()),
        "height": pa.array([r.height for r in records], pa.int32()),
        "sha256": pa.array([r.sha256 for r in records], pa.string()),
    }
    if xb is not None:
        flat = pa.array(np.ascontiguousarray(xb, dtype=np.float32).reshape(-1), pa.float32())
        columns["vector"] = pa.FixedSizeListArray.from_arrays(flat, xb.shape[1])
    return pa.table(columns, schema=schema)


def _row_groups(directory: IndexDirectory, rows: int = ROW_GROUP):
    """``(ids [m], xb [m, D] float32)`` of the live items, in the order of the vector blocks (ids only grow, so
    ascending)."""
    layout = IndexLayout(directory.path)
    live = directory.index.ids()
    buffer_ids, buffer_x, held = [], [], 0
    for ids, xb in live_blocks(layout, directory.manifest.vector_blocks, live)():
        buffer_ids.append(ids)
        buffer_x.append(xb)
        held += len(ids)
        if held >= rows:
            yield np.concatenate(buffer_ids), np.concatenate(buffer_x)
            buffer_ids, buffer_x, held = [], [], 0
    if held:
        yield np.concatenate(buffer_ids), np.concatenate(buffer_x)


def write_embeddings(
    index_dir: str | os.PathLike,
    out: str | os.PathLike,
    npy: bool = False,
    row_group: int = ROW_GROUP,
    progress: bool = False,
) -> EmbeddingsFile:
    """Write the live items of ``index_dir`` to ``out`` (see the module docstring).

    Args:
        out: the Parquet file; with ``npy``, ``out`` with its suffix replaced by ``.npy`` and ``.parquet``.
        row_group: rows per Parquet row group (and per read of the vector blocks).

    Raises:
        ArtifactError: not an index directory, or vectors without metadata. OutputError: ``out`` not writable.
    """
    import pyarrow.parquet as pq
    from tqdm import tqdm

    tic = time.perf_counter()
    out = Path(out)
    with IndexDirectory.open(index_dir) as directory:
        dim, count = directory.manifest.embedding_dim, directory.manifest.count
        parquet_path = out.with_suffix(".parquet") if npy else out
        npy_path = out.with_suffix(".npy") if npy else None
        schema = _schema(dim, with_vector=not npy)
        written = 0
        with (
            atomic_path(parquet_path, "pass --out with a writable path") as tmp_parquet,
            atomic_write(npy_path) if npy else contextlib.nullcontext() as vectors_file,
        ):
            bar = tqdm(total=count, desc="writing embeddings", unit="item", disable=not progress, dynamic_ncols=True)
            if vectors_file is not None:  # header first: the row count is known, rows are appended as they come
                np.lib.format.write_array_header_2_0(
                    vectors_file, {"descr": "<f4", "fortran_order": False, "shape": (count, dim)}
                )
            with pq.ParquetWriter(tmp_parquet, schema) as writer:
                for ids, xb in _row_groups(directory, row_group):
                    records = directory.records(ids)
                    writer.write_table(_table(ids, None if npy else xb, records, schema), row_group_size=row_group)
                    if vectors_file is not None:
                        vectors_file.write(np.ascontiguousarray(xb, dtype="<f4").tobytes())
                    written += len(ids)
                    bar.update(len(ids))
            bar.close()
            if written != count:
                raise ArtifactError(
                    f"{index_dir} holds {written} live vectors but its manifest counts {count}; "
                    "rebuild with `moco index --rebuild`"
                )
        generation = directory.generation
    paths = (parquet_path,) if npy_path is None else (npy_path, parquet_path)
    seconds = time.perf_counter() - tic
    LOG.info(
        "wrote %d items (%d-d) of generation %s to %s in %.1f s",
        written,
        dim,
        generation,
        ", ".join(map(str, paths)),
        seconds,
    )
    return EmbeddingsFile(paths, written, dim, generation, seconds)
