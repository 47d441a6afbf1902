"""One published index generation opened for serving: its FAISS index and LMDB metadata (read-only) plus the
encoder that made its vectors, checked against each other before any query is answered.

A :class:`ServedGeneration` is reference-counted: requests hold it while they run, and when a newer
generation replaces it, it is closed only after the last request using it has finished.

LMDB allows one open environment per store per process, so engines of one process that serve the same
generation share its :class:`IndexDirectory` (:func:`open_directory`); it is closed with its last user.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import faiss
import numpy as np

from moco_retrieval.contracts.errors import ArtifactError, ConfigError
from moco_retrieval.indexer.filters import IdFilter
from moco_retrieval.indexer.encoder import OnnxEncoder
from moco_retrieval.indexer.factory import Factory
from moco_retrieval.indexer.index_dir import IndexDirectory
from moco_retrieval.indexer.layout import current_generation
from moco_retrieval.indexer.manifest import check_encoder_copy

LOG = logging.getLogger(__name__)

# Inner products of L2-normalized vectors lie in [-1, 1]. Scores of exact storage (float32 rows; candidates
# re-ranked with the float16 blocks, whose rounding moves a score by at most 2^-11 by Cauchy-Schwarz) stay
# within SCORE_SLACK of that range; compressed codes searched without re-ranking (a custom factory string such as
# "IVF256,SQ8") only approximate them. Past the slack a result is damage, never served.
SCORE_SLACK = 1e-3
LOSSY_SCORE_SLACK = 0.5

FILTER_CACHE = 64  # label / path-prefix bitmaps kept per generation (125 KB each per million ids)

_shared_lock = threading.Lock()
_shared: dict[tuple[str, str], list] = {}  # (index dir, generation) -> [IndexDirectory, users]


def open_directory(index_dir: str | os.PathLike, faiss_gpu: str = "none") -> IndexDirectory:
    """The live generation of ``index_dir``, shared with its other users in this process (memory-mapped,
    so other processes serving it share its pages too; ``faiss_gpu``: see ``indexer.faiss_gpu``).

    Raises:
        ArtifactError: missing, not an index directory, or unreadable.
    """
    path = Path(index_dir)
    if not path.is_dir():
        raise ArtifactError(f"index directory not found: {path}; build one with `moco index`")
    name = current_generation(path)
    key = (str(path.resolve()), name)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = [IndexDirectory(path, name, faiss_gpu_mode=faiss_gpu), 0]
        entry[1] += 1
        return entry[0]


def close_directory(directory: IndexDirectory) -> None:
    """Release one user of a directory from :func:`open_directory`; the last one closes it."""
    key = (str(Path(directory.path).resolve()), directory.generation)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or entry[0] is not directory:
            directory.close()
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _shared[key]
    directory.close()


class ServedGeneration:
    """An open generation: ``directory`` (IndexDirectory), ``encoder`` (OnnxEncoder), ``name``.

    All FAISS calls go through :meth:`search` / :meth:`vector`, serialized by one lock (FAISS GPU indexes
    and some CPU index types are not safe to call from several threads at once).
    """

    def __init__(self, directory: IndexDirectory, encoder: OnnxEncoder, faiss_threads: int | None = None):
        self.directory = directory
        self.faiss_threads = faiss_threads
        self.encoder = encoder
        self.manifest = directory.manifest
        self.name = directory.generation
        self._faiss_lock = threading.Lock()
        self._refs_lock = threading.Lock()
        self._refs = 0
        self._retired = False
        self._closed = False
        self._labels: dict[str, int] | None = None
        self._filters_lock = threading.Lock()
        self._filter_bits: dict[tuple[str, str], np.ndarray] = {}  # (kind, key) -> bits, least recently used first
        exact = (
            Factory.parse(self.manifest.factory).kind in ("flat", "hnsw", "ivf")
            or "refine" in self.manifest.search_params
        )
        self._score_slack = SCORE_SLACK if exact else LOSSY_SCORE_SLACK
        self._damage_logged = False

    @classmethod
    def open(
        cls,
        index_dir: str | os.PathLike,
        *,
        model: str | os.PathLike | None,
        reuse: OnnxEncoder | None,
        device: str,
        threads: int | None,
        faiss_threads: int | None,
        spin: bool,
        faiss_gpu: str,
    ) -> "ServedGeneration":
        """Open the live generation of ``index_dir`` with its own encoder (or ``model``) and check them. The
        options have no defaults here: they are :class:`~serve.engine.EngineConfig`'s, stated once there.

        Args:
            model: serve with this encoder file instead of the copy inside the index (must be the same model).
            reuse: an already open encoder, used instead of loading one when it is the model of this index.
            faiss_threads: OpenMP threads for FAISS searches (None: FAISS's default).
            faiss_gpu: search Flat / IVF indexes on GPUs: none, auto, one or all (``indexer.faiss_gpu``).
            spin: whether the encoder's CPU threads spin-wait between runs.

        Raises:
            ArtifactError: not an index directory, or the model does not match the index.
        """
        directory = open_directory(index_dir, faiss_gpu)
        try:
            manifest = directory.manifest
            if reuse is not None and model is None and reuse.sha256 == manifest.model_sha256:
                encoder = reuse
            else:
                if model is None:  # the index's own copy: refused (damaged, replaced) before ONNX Runtime parses it
                    check_encoder_copy(directory.encoder_path, manifest, str(index_dir))
                encoder = OnnxEncoder(
                    model if model is not None else directory.encoder_path, device=device, threads=threads, spin=spin
                )
            manifest.check_encoder(
                encoder.sha256,
                encoder.embedding_dim,
                encoder.path,
                str(index_dir),
                "serve it with the model it was built with, or rebuild it with `moco index "
                f"IMAGE_DIR --model {encoder.path} --out {index_dir}`",
            )
        except BaseException:
            close_directory(directory)
            raise
        return cls(directory, encoder, faiss_threads)

    # -- reference counting --------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Take a reference; False when the generation was already closed (take the current one instead)."""
        with self._refs_lock:
            if self._closed:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._refs_lock:
            self._refs -= 1
            close = self._retired and self._refs == 0 and not self._closed
            if close:
                self._closed = True
        if close:
            self._close_now()

    def retire(self) -> None:
        """A newer generation took over: close as soon as no request uses this one."""
        with self._refs_lock:
            self._retired = True
            close = self._refs == 0 and not self._closed
            if close:
                self._closed = True
        if close:
            self._close_now()

    def _close_now(self) -> None:
        LOG.debug("closing index generation %s", self.name)
        close_directory(self.directory)

    # -- FAISS -----------------------------------------------------------------------------------------------
    def labels(self) -> dict[str, int]:
        """label -> live item count, read once per generation (it scans every record)."""
        if self._labels is None:
            self._labels = self.directory.labels()
        return self._labels

    @property
    def ntotal(self) -> int:
        return int(self.directory.index.ntotal)

    def _id_bits(self, kind: str, key: str, read) -> np.ndarray:
        """A cached bool ``[next_id]`` of the ids ``read()`` returns (a label's, a path prefix's): this generation's
        ids never change, so each is read from LMDB once, not per request."""
        with self._filters_lock:
            bits = self._filter_bits.get((kind, key))
            if bits is not None:
                self._filter_bits[(kind, key)] = self._filter_bits.pop((kind, key))  # most recently used last
                return bits
        bits = np.zeros(int(self.manifest.next_id), dtype=bool)
        ids = read()
        bits[ids[(ids >= 0) & (ids < len(bits))]] = True
        with self._filters_lock:
            self._filter_bits[(kind, key)] = bits
            while len(self._filter_bits) > FILTER_CACHE:
                self._filter_bits.pop(next(iter(self._filter_bits)))
        return bits

    def id_filter(self, flt) -> "IdFilter | None":
        """The :class:`~indexer.filters.IdFilter` of a :class:`~serve.engine.SearchFilter` (``None`` when it
        restricts no id: no label, no prefix, nothing excluded).

        Raises:
            ConfigError: a label this index does not have (the message names those it has).
            ArtifactError: a label filter on an index built before label filters (rebuild it).
        """
        if flt is None or not (flt.labels or flt.path_prefix or flt.exclude):
            return None
        next_id = int(self.manifest.next_id)
        bits = None
        if flt.labels:
            known = self.labels()
            unknown = [label for label in flt.labels if label not in known]
            if unknown:
                raise ConfigError(
                    f"unknown label {', '.join(map(repr, unknown))}; the labels of this index: "
                    f"{', '.join(sorted(known)) or 'none (unlabeled corpus)'}"
                )
            bits = np.zeros(next_id, dtype=bool)
            for label in flt.labels:
                bits |= self._id_bits("label", label, lambda label=label: self.directory.label_ids(label))
        if flt.path_prefix:
            prefix = self._id_bits("prefix", flt.path_prefix, lambda: self.directory.path_prefix_ids(flt.path_prefix))
            bits = prefix.copy() if bits is None else bits & prefix
        if bits is None:
            bits = np.ones(next_id, dtype=bool)
        exclude = np.asarray(flt.exclude, dtype=np.int64)
        bits[exclude[(exclude >= 0) & (exclude < next_id)]] = False
        return IdFilter.of_bits(bits)

    def search(
        self, xq: np.ndarray, k: int, filt: "IdFilter | None" = None, depth: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """Inner-product search: ``xq`` float32 ``[n, d]`` -> ``(D, I)`` float32 / int64 ``[n, k]`` (-1 pads);
        only ids of ``filt`` when given; ``depth`` times the tuned nprobe / efSearch (``LayeredIndex.search``).

        Raises:
            ArtifactError: a result no intact index can give (see :meth:`_check_results`).
        """
        k = max(1, min(k, self.ntotal))
        with self._faiss_lock:
            if self.faiss_threads is not None:  # an OpenMP setting is per calling thread: set it in this one
                faiss.omp_set_num_threads(self.faiss_threads)
            xq = np.ascontiguousarray(xq, dtype=np.float32)
            index = self.directory.index
            D, I = index.search(xq, k) if filt is None and depth <= 1 else index.search(xq, k, filt, depth)
        self._check_results(D, I)
        return D, I

    @property
    def can_range_search(self) -> bool:
        """Whether :meth:`range_search` is exact here (see ``LayeredIndex.can_range_search``)."""
        return bool(getattr(self.directory.index, "can_range_search", False))

    def range_search(self, xq: np.ndarray, radius: float, depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Every item scoring at least ``radius`` with the one query ``xq`` float32 ``[d]``: ``(D, I)``, best first;
        ``depth`` times the tuned nprobe (``LayeredIndex.range_search``).

        Raises:
            ArtifactError: a result no intact index can give (see :meth:`_check_results`).
        """
        with self._faiss_lock:
            if self.faiss_threads is not None:
                faiss.omp_set_num_threads(self.faiss_threads)
            xq = np.ascontiguousarray(xq[None], dtype=np.float32)
            ((D, I),) = self.directory.index.range_search(xq, radius, depth)
        self._check_results(D[None], I[None])
        return D, I

    def _check_results(self, D: np.ndarray, I: np.ndarray) -> None:
        """Refuse results that only damaged bytes make: a score outside [-1 - slack, 1 + slack] (or NaN) on
        normalized vectors, an id never given out. Damage inside vectors.faiss or delta.faiss otherwise came back
        as results that look normal (one id first for every query at a score of 1e36)."""
        found = I >= 0
        bad = (found & ~(np.abs(D) <= 1.0 + self._score_slack)) | (I < -1) | (I >= self.manifest.next_id)
        if not bad.any():
            return
        q, j = (int(a[0]) for a in np.nonzero(bad))
        what = (
            f"item {int(I[q, j])} at a score of {float(D[q, j]):.4g}, outside [-1, 1] for normalized vectors"
            if 0 <= I[q, j] < self.manifest.next_id
            else f"the id {int(I[q, j])}, which it never gave out"
        )
        message = (
            f"generation {self.name} of {self.directory.path} answered {what}: its FAISS files are damaged; "
            f"check it with `moco index --verify --out {self.directory.path}` and rebuild with "
            "`moco index --rebuild`"
        )
        if not self._damage_logged:  # once per generation: a damaged index under load would flood the log
            LOG.error("refused a search result: %s", message)
            self._damage_logged = True
        raise ArtifactError(message)

    def vector(self, item_id: int) -> np.ndarray | None:
        """The stored vector ``[d]`` of ``item_id``, or ``None`` when this index type cannot give it back."""
        with self._faiss_lock:
            try:
                return np.asarray(self.directory.index.reconstruct(int(item_id)), dtype=np.float32)
            except RuntimeError:  # no direct map (IVF) or the id is not in the index
                return None
