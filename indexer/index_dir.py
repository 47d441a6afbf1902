"""Reading an index directory: one consistent, read-only view of one published generation.

The server opens an :class:`IndexDirectory`, polls :func:`current_generation` (one small file read) and opens
a new one when it changes. A view stays valid while the next generation is published (the previous
generation is kept until the publish after that, and open files survive deletion on POSIX anyway).
Reads are lock-free and safe from any thread: each call uses its own LMDB read transaction on a store that
no writer ever touches again.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import faiss

from contracts.errors import ArtifactError
from indexer.layout import IndexLayout, current_generation
from indexer.manifest import IndexManifest
from indexer.metadata import MetadataStore

LOG = logging.getLogger(__name__)

__all__ = ["IndexDirectory", "current_generation"]


class IndexDirectory:
    """The live generation of an index directory.

    Attributes:
        path: the index directory; generation: the generation's name; generation_path: its folder.
        manifest: the generation's :class:`~indexer.manifest.IndexManifest`.
        index: CPU FAISS index with explicit int64 ids (inner product on L2-normalized vectors), its
            search parameter (nprobe / efSearch) already set to the tuned value.
        encoder_path: the copy of ``encoder.onnx`` the vectors were made with.
    """

    def __init__(self, path: Path, generation: str):
        self.path = Path(path)
        self.generation = generation
        gen = IndexLayout(self.path).generation(generation)
        self.generation_path = gen.root
        if not gen.root.is_dir():
            raise ArtifactError(f"{self.path}: generation {generation} is missing; rebuild with `moco index --rebuild`")
        self.manifest = IndexManifest.read(gen.manifest)
        try:
            self.index = faiss.read_index(str(gen.index))
        except RuntimeError as exc:
            raise ArtifactError(f"unreadable FAISS index {gen.index}; rebuild with `moco index --rebuild`") from exc
        if self.index.d != self.manifest.embedding_dim or self.index.ntotal != self.manifest.count:
            raise ArtifactError(f"{gen.index} does not match its manifest (dim {self.index.d}, "
                                f"{self.index.ntotal} vectors); rebuild with `moco index --rebuild`")
        self.encoder_path = gen.encoder
        if not self.encoder_path.is_file():
            raise ArtifactError(f"{self.encoder_path} is missing; rebuild with `moco index --rebuild`")
        self._store = MetadataStore(gen.meta, readonly=True)
        self._image_root = Path(self.manifest.image_root)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "IndexDirectory":
        """Open the live generation of the index directory ``path``.

        Raises:
            ArtifactError: missing, not an index directory, or unreadable.
        """
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"index directory not found: {path}; build one with `moco index`")
        return cls(path, current_generation(path))

    def __repr__(self) -> str:
        return (f"IndexDirectory({str(self.path)!r}, generation={self.generation}, count={self.manifest.count}, "
                f"factory={self.manifest.factory!r})")

    def __enter__(self) -> "IndexDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def record(self, id: int) -> dict | None:
        """The item ``id``: {id, path (relative), label, width, height, bytes, sha256, mtime, duplicate_of, ...}.

        ``None`` when the id is unknown or was removed (tombstoned).
        """
        return self._store.record(int(id))

    def records(self, ids) -> list[dict | None]:
        """:meth:`record` for many ids (FAISS's ``I`` row, with its -1 for missing results) in one transaction."""
        return self._store.records([int(i) for i in ids])

    def image_path(self, id: int) -> Path | None:
        """The original image file of item ``id`` (absolute), or ``None`` for an unknown id."""
        rec = self.record(id)
        return None if rec is None else self._image_root / rec["path"]

    def labels(self) -> dict[str, int]:
        """label -> number of live items carrying it (unlabeled items are not counted)."""
        return dict(self.manifest.labels)

    def id_of_path(self, path: str) -> int | None:
        """The live id of an image by its path relative to the image folder."""
        return self._store.id_of_path(path)

    def close(self) -> None:
        self._store.close()
