"""Filtered and threshold search on a real index, against exact search over its stored vectors (issue 24).

The synthetic benchmark (``bench/search_filters.py``) spreads a filter's ids at random over the corpus; on real
images a label's items cluster, and a query from one class filtered to another is the hard case for HNSW,
whose filtered beam stays near the query. Over an index built with labels (``moco index FOLDER --index-type
hnsw``, a folder per class), for ``--queries`` stored items as queries:

- **label filter**, the query's own label and a label three classes on: recall@10 against the exact best ten of
  that label, and ms a query through ``serve.engine.SearchEngine`` (one FAISS thread);
- **threshold** (``min_score`` met by the first 11 / 41 / 81): recall of the items above it, with HNSW parts
  scanned exactly (``indexer.searcher.HNSW_SCAN_MAX``) and searched with a growing k (the limit set to 0).

    moco index /work/datasets/fashion_mnist_split/train --model M --out /tmp/idx56h --index-type hnsw
    python bench/search_real.py /tmp/idx56h --out bench/results/search_real_fmnist56k_hnsw.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402


def _label_filters(engine, xb, ids, labels, picks) -> dict:
    from moco_retrieval.serve.engine import SearchFilter

    names = sorted(set(labels))
    out = {}
    for kind in ("own", "other"):
        found, seconds = 0, 0.0
        for qi in picks:
            q = xb[qi]
            label = labels[qi] if kind == "own" else names[(names.index(labels[qi]) + 3) % len(names)]
            tic = time.perf_counter()
            (res,) = engine.search_vectors(q[None], k=10, flt=SearchFilter(labels=(label,)))
            seconds += time.perf_counter() - tic
            scores = np.where(labels == label, xb @ q, -9.0)
            found += len({h["id"] for h in res.hits} & set(ids[np.argsort(-scores)[:10]].tolist()))
        out[f"label_{kind}"] = {
            "recall_at_10": round(found / (10 * len(picks)), 4),
            "ms": round(1e3 * seconds / len(picks), 2),
        }
    return out


def _thresholds(engine, xb, ids, picks) -> dict:
    found = wanted = 0
    seconds = 0.0
    for qi in picks:
        scores = xb @ xb[qi]
        ranked = np.sort(scores)[::-1]
        for rank in (10, 40, 80):
            min_score = float(ranked[rank]) - 1e-4
            tic = time.perf_counter()
            (res,) = engine.search_vectors(xb[qi][None], min_score=min_score)
            seconds += time.perf_counter() - tic
            want = set(ids[scores >= min_score].tolist())
            found, wanted = found + len({h["id"] for h in res.hits} & want), wanted + len(want)
    return {"recall": round(found / wanted, 4), "ms": round(1e3 * seconds / (3 * len(picks)), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("index_dir")
    p.add_argument("--queries", type=int, default=60, help="stored items used as queries")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args()

    from moco_retrieval.indexer import searcher
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    row = {"benchmark": "search_real", "command": " ".join(sys.argv), "machine": machine()}
    for scan_max, path in ((searcher.HNSW_SCAN_MAX, "scan"), (0, "grown")):
        searcher.HNSW_SCAN_MAX = scan_max
        engine = SearchEngine(args.index_dir, EngineConfig(device="cpu", threads=1, poll_seconds=0))
        try:
            index = engine._current.directory.index
            ids = index.ids()
            ok, xb = index.vectors.get(ids)
            xb = xb.astype(np.float32)
            labels = np.array([r["label"] for r in engine._current.directory.records(ids.tolist())])
            picks = np.random.default_rng(0).choice(len(ids), min(args.queries, len(ids)), replace=False)
            row["index"] = {"items": int(len(ids)), "factory": engine._current.manifest.factory}
            if path == "scan":
                row.update(_label_filters(engine, xb, ids, labels, picks))
            row[f"threshold_{path}"] = _thresholds(engine, xb, ids, picks[: max(1, len(picks) // 2)])
        finally:
            engine.close()
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
