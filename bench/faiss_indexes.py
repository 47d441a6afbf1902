"""FAISS index benchmark: build time, search QPS and recall@10 of flat, HNSW, IVF and IVF-PQ (JSON out).

Vectors are random but clustered (Gaussian blobs around ``--clusters`` random centres, L2-normalized, the
shape of real embeddings), dimension 512 by default. Each index is built by ``indexer.faiss_index`` exactly
as ``moco index`` builds it (``auto``'s factory for that type, IVF trained on a sample, nprobe / efSearch
tuned to recall@10 >= 0.95 on a sample of database vectors). Then held-out queries are searched in one batch
of ``--queries`` (k=10) and recall@10 is measured against exact search of the same queries.

    python bench/faiss_indexes.py                       # 100k vectors
    python bench/faiss_indexes.py --sizes 100000 1000000  # add the 1M case (minutes and ~2 GB of RAM)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import faiss
import numpy as np

from moco_retrieval.app.cli import setup_logging
from moco_retrieval.indexer.faiss_index import build_index, choose_factory, exact_knn, recall_at_k

OUT = Path(__file__).resolve().parent / "results"


def clustered(n: int, d: int, clusters: int, seed: int, spread: float = 0.6) -> np.ndarray:
    """(n, d) float32 L2-normalized rows around ``clusters`` random centres (generated in chunks)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(12345).normal(size=(clusters, d)).astype(np.float32)
    out = np.empty((n, d), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        x = centres[rng.integers(0, clusters, m)] + spread * rng.normal(size=(m, d)).astype(np.float32)
        out[start : start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def run(n: int, d: int, types: list[str], queries: int, clusters: int) -> list[dict]:
    xb = clustered(n, d, clusters, seed=0)
    xq = clustered(queries, d, clusters, seed=1)
    ids = np.arange(n, dtype=np.int64)

    def blocks():
        for start in range(0, n, 65_536):
            yield ids[start : start + 65_536], xb[start : start + 65_536]

    tic = time.perf_counter()
    _, I_ref = exact_knn(xq, blocks, 10)
    ground_truth_s = time.perf_counter() - tic
    rows = []
    for index_type in types:
        factory = choose_factory(index_type, n, d)
        tic = time.perf_counter()
        built = build_index(factory, d, n, blocks)
        build_s = time.perf_counter() - tic
        built.index.search(xq[:10], 10)  # warm-up
        tic = time.perf_counter()
        _, I = built.index.search(xq, 10)
        search_s = time.perf_counter() - tic
        row = {
            "n": n,
            "d": d,
            "index_type": index_type,
            "factory": factory,
            "search_params": built.search_params,
            "build_s": round(build_s, 3),
            "trained_on": built.trained_on,
            "built_on_gpu": built.on_gpu,
            "qps": round(queries / search_s, 1),
            "recall_at_10": round(recall_at_k(I, I_ref), 4),
            "recall_at_10_tuning_sample": built.recall_at_10,
            "bytes_per_vector": round(len(faiss.serialize_index(built.index)) / n, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.append({"n": n, "exact_ground_truth_s": round(ground_truth_s, 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000], help="corpus sizes (default 100000)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--types", nargs="+", default=["flat", "hnsw", "ivf", "ivfpq"])
    p.add_argument("--queries", type=int, default=1000, help="held-out queries searched in one batch")
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None, help="FAISS OpenMP threads (default: all cores)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/faiss_indexes_<host>.json)")
    args = p.parse_args()
    setup_logging()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    rows = []
    for n in args.sizes:
        rows += run(n, args.dim, args.types, args.queries, args.clusters)
    result = {
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "faiss": faiss.__version__,
            "gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0,
            "omp_threads": faiss.omp_get_max_threads(),
        },
        "results": rows,
    }
    out = Path(args.out) if args.out else OUT / f"faiss_indexes_{platform.node() or 'host'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
