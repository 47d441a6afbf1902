"""``EngineConfig``: every option of how ``moco serve`` (and ``moco search`` / ``classify``) opens and serves an
index, with its default and its reason, stated once. The commands' flags are generated from it
(``contracts.options``). Light to import (no FAISS, no ONNX Runtime): ``moco --help`` builds every command's flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.contracts.knn import KNN_K
from moco_retrieval.contracts.options import option

MAX_K = 1000
MAX_QUERIES = 64  # images or ids one batch request may hold: 64 of the largest uploads is 2 GiB, past the budget
DUPLICATE_THRESHOLD = 0.95  # cosine similarity at which two images count as near-duplicates (moco duplicates too)


@dataclass
class EngineConfig:
    """How the engine opens and serves an index."""

    model: str | None = option(
        None,
        "use this encoder instead of the copy inside INDEX_DIR (it must be the model "
        "the index was built with; anything else is refused)",
        "encoder",
        metavar="ENCODER_ONNX",
    )
    device: str = option(
        "auto", "where the encoder runs: auto uses the GPU when usable", "encoder", choices=("auto", "cpu", "cuda")
    )
    # Encoder CPU threads (default: the usable cores). Measured with bench/serve_latency.py on 2 cores: with the
    # bench's small-stem ResNet-18 (10 ms of CPU per image, the encoder is the bottleneck) 2 threads served 122
    # req/s at 8 clients against 93 with 1; with the ImageNet stem (0.8 ms) 1 and 2 were within noise.
    threads: int | None = option(None, "encoder CPU threads (default: all usable cores)", "encoder")
    # Encoder threads spin-wait between runs (ONNX Runtime's default). Off: a server's runs come and go, and
    # spinning threads take the cores the HTTP work needs (measured, 2 cores, 8 clients, ImageNet-stem
    # ResNet-18: server CPU per request 4.2 -> 2.9 ms; 1 client: 10.7 -> 4.0 ms).
    spin: bool = False
    max_batch: int = 32  # most query images embedded together
    # How long the batcher waits for more concurrent queries after the first one. 0: a batch is whatever waits
    # when the worker is free (under load the queue fills while it runs, so batches still form), and a lone
    # query never waits (measured, 1 client: p50 6.7 -> 3.4 ms against the former 2 ms; see
    # docs/ARCHITECTURE.md, "Measured lessons").
    max_wait_ms: float = 0.0
    # Decodes running at once (default: the usable cores); more wait. Bounds the memory of concurrent uploads.
    # `moco search|classify` over many images: the decoding processes (default: the cores but one, as `moco index`).
    decode_slots: int | None = None
    poll_seconds: float = option(
        1.0, "how often to check INDEX_DIR for a newly published index, in seconds (0: never)", "index"
    )
    max_k: int = MAX_K  # the largest k a query may ask for (and what a min_score search returns at most)
    knn_k: int = option(
        KNN_K, "neighbours that vote when classifying (the API's and the web app's default k of classify)", "search"
    )
    max_queries: int = option(MAX_QUERIES, "most images or ids in one batch request (more: 413)", "search")
    # FAISS OpenMP threads of the threads that search (None leaves FAISS's default). Queries come one micro-batch at a
    # time, where starting an OpenMP team costs more than it saves: measured 12 ms vs 0.5 ms per single
    # query on a 2,000-item flat index with 2 busy cores. Raise it for big batches on large IVF/HNSW indexes.
    faiss_threads: int | None = 1
    faiss_gpu: str = option(
        "auto",
        "search Flat / IVF indexes on GPU 0 (one), sharded over all GPUs (all), or on "
        "the CPU (none); auto uses all GPUs when FAISS sees any",
        "index",
        choices=("auto", "none", "one", "all"),
    )

    def __post_init__(self):
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.max_wait_ms < 0 or self.poll_seconds < 0:
            raise ConfigError("max_wait_ms and poll_seconds must not be negative")
        if self.max_k < 1:
            raise ConfigError(f"max_k must be at least 1, got {self.max_k}")
        if not 1 <= self.knn_k <= self.max_k:
            raise ConfigError(f"--knn-k must be from 1 to {self.max_k}, got {self.knn_k}")
        if self.max_queries < 1:
            raise ConfigError(f"--max-queries must be at least 1, got {self.max_queries}")
        if self.faiss_threads is not None and self.faiss_threads < 1:
            raise ConfigError(f"faiss_threads must be at least 1, got {self.faiss_threads}")
        if self.decode_slots is not None and self.decode_slots < 1:
            raise ConfigError(f"decode_slots must be at least 1, got {self.decode_slots}")
