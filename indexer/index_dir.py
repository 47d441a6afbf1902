"""Reading an index directory: one consistent, read-only view of one published generation.

The server opens an :class:`IndexDirectory`, polls :func:`current_generation` (one small file read) and opens
a new one when it changes. A view stays valid while the next generation is published (the previous
generation is kept until the publish after that, and open files survive deletion on POSIX anyway).
Reads are lock-free and safe from any thread: each call uses its own LMDB read transaction on stores that
no writer ever touches again.

The FAISS base is memory-mapped where its type allows (IVF lists, flat codes, HNSW storage; on-disk IVF-PQ
lists always are), so every process serving the same generation shares one copy of its pages in the page
cache instead of holding its own: ``moco serve --workers N`` costs little more memory than one worker.
With ``faiss_gpu`` (``auto``, ``one``, ``all``) Flat and IVF bases are also copied to the GPU for search
(:mod:`indexer.faiss_gpu`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import faiss

from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.indexer import faiss_gpu
from moco_retrieval.indexer.faiss_index import read_index
from moco_retrieval.indexer.integrity import check_files
from moco_retrieval.indexer.layout import IndexLayout, current_generation
from moco_retrieval.indexer.manifest import IndexManifest
from moco_retrieval.indexer.metadata import MetadataStore
from moco_retrieval.indexer.records import ItemRecord
from moco_retrieval.indexer.searcher import LayeredIndex, open_vectors_lazily
from moco_retrieval.indexer.update import read_delta, read_removed
from moco_retrieval.indexer.vectors import BlockVectors

LOG = logging.getLogger(__name__)

__all__ = ["IndexDirectory", "current_generation"]


class IndexDirectory:
    """The live generation of an index directory.

    Attributes:
        path: the index directory; generation: the generation's name; generation_path: its folder.
        manifest: the generation's :class:`~indexer.manifest.IndexManifest`.
        index: a :class:`~indexer.searcher.LayeredIndex` (base - removed + delta) with FAISS's ``search``,
            ``reconstruct``, ``ntotal`` and ``d``: explicit int64 ids, inner product on L2-normalized vectors,
            the tuned search parameters (nprobe / efSearch / refine) applied.
        encoder_path: the copy of ``encoder.onnx`` the vectors were made with.
    """

    def __init__(self, path: Path, generation: str, mmap: bool = True, faiss_gpu_mode: str = "none"):
        self.path = Path(path)
        self.generation = generation
        layout = IndexLayout(self.path)
        gen = layout.generation(generation)
        self.generation_path = gen.root
        if not gen.root.is_dir():
            raise layout.damaged_pointer(f"names {generation}, which is not there")
        self.manifest = m = IndexManifest.read(gen.manifest)
        # the size of every recorded file (a stat each), and of the blocks IVF-PQ re-ranks with: a damaged file
        # is named here, before FAISS or LMDB read it (indexer.integrity: what is hashed when)
        check_files(layout, generation, m, blocks="refine" in m.search_params)
        base = read_index(gen.index, m.factory, on_disk=m.on_disk, mmap=mmap)
        if base.ntotal != m.base_count or base.d != m.embedding_dim:
            raise ArtifactError(
                f"{gen.index} holds {base.ntotal} {base.d}-d vectors, its manifest counts "
                f"{m.base_count} {m.embedding_dim}-d; rebuild with `moco index --rebuild`"
            )
        delta = read_delta(gen, m, m.factory, mmap=mmap)
        for part in (base, delta):
            if part is not None:
                _apply_search_params(part, m.search_params)
        removed = read_removed(gen, m)
        if "refine" in m.search_params:  # IVF-PQ re-ranks with the stored vectors: open them now
            vectors = BlockVectors(layout, m.vector_blocks)
        else:  # only for reconstruct() of index types that cannot; opened if ever needed
            vectors = open_vectors_lazily(lambda: BlockVectors(layout, m.vector_blocks))
        gpu = faiss_gpu.gpu_copy_for_search(base, m.search_params, faiss_gpu_mode, m.on_disk)
        self.index = LayeredIndex(base, delta, removed, m.search_params, vectors=vectors, gpu=gpu)
        if self.index.ntotal != m.count:
            raise ArtifactError(
                f"generation {generation} of {self.path} holds {self.index.ntotal} items, its "
                f"manifest counts {m.count}; rebuild with `moco index --rebuild`"
            )
        self.encoder_path = gen.encoder
        if not self.encoder_path.is_file():
            raise ArtifactError(f"{self.encoder_path} is missing; rebuild with `moco index --rebuild`")
        self._store = MetadataStore(gen.meta, delta=gen.delta_meta if gen.delta_meta.is_dir() else None)
        self._image_root = Path(m.image_root)

    @classmethod
    def open(cls, path: str | os.PathLike, mmap: bool = True, faiss_gpu_mode: str = "none") -> "IndexDirectory":
        """Open the live generation of the index directory ``path``.

        Args:
            mmap: map the base index from its file where the type allows (else read it into memory).
            faiss_gpu_mode: ``none``, ``auto``, ``one`` or ``all`` (see :mod:`indexer.faiss_gpu`).

        Raises:
            ArtifactError: missing, not an index directory, or unreadable.
        """
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"index directory not found: {path}; build one with `moco index`")
        return cls(path, current_generation(path), mmap=mmap, faiss_gpu_mode=faiss_gpu_mode)

    def __repr__(self) -> str:
        return (
            f"IndexDirectory({str(self.path)!r}, generation={self.generation}, count={self.manifest.count}, "
            f"factory={self.manifest.factory!r})"
        )

    def __enter__(self) -> "IndexDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def record(self, id: int) -> ItemRecord | None:
        """The item ``id`` (path relative to the image folder; ``record["path"]`` reads as ``record.path``).

        ``None`` when the id is unknown or was removed (tombstoned).
        """
        return self._store.record(int(id))

    def records(self, ids) -> list[ItemRecord | None]:
        """:meth:`record` for many ids (FAISS's ``I`` row, with its -1 for missing results) in one transaction."""
        return self._store.records([int(i) for i in ids])

    def image_path(self, id: int) -> Path | None:
        """The original image file of item ``id`` (absolute), or ``None`` for an unknown id."""
        rec = self.record(id)
        return None if rec is None else self._image_root / rec.path

    def labels(self) -> dict[str, int]:
        """label -> number of live items carrying it (unlabeled items are not counted)."""
        return dict(self.manifest.labels)

    def label_ids(self, label: str):
        """Sorted int64 ids of the live items of ``label`` (a range scan of the metadata's ``labels``).

        Raises:
            ArtifactError: an index built before label filters (rebuild it)."""
        return self._store.label_ids(label)

    def path_prefix_ids(self, prefix: str):
        """Sorted int64 ids of the live items whose relative path starts with ``prefix`` (a range scan)."""
        return self._store.path_prefix_ids(prefix)

    def id_of_path(self, path: str) -> int | None:
        """The live id of an image by its path relative to the image folder."""
        return self._store.id_of_path(path)

    def close(self) -> None:
        self._store.close()


def _apply_search_params(index: faiss.Index, params: dict) -> None:
    """Set the tuned nprobe / efSearch on the index object too (for searches without explicit parameters)."""
    space = faiss.ParameterSpace()
    for name in ("nprobe", "efSearch"):
        if name in params:
            try:
                space.set_index_parameter(index, name, int(params[name]))
            except RuntimeError:  # a delta of another type (IDMap2,Flat beside HNSW) has no such parameter
                pass
