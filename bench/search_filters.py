"""Issue 24's measurements at scale: filtered search, near-duplicates, folder classification.

Phases (each writes one JSON file under ``bench/results/``; run each alone, with nothing else on the machine):

- **filters**: ``--n`` x 512 synthetic vectors (``bench.scale_data``: Gaussian blobs, the shape of real
  embeddings) in the real FAISS build path (``indexer.faiss_index.build_index``: trained, filled, its nprobe /
  efSearch tuned to recall@10 >= 0.95), searched through ``indexer.searcher.LayeredIndex`` as the server does,
  with a removed-ids selector (1% removed) and a delta (1% added). Filters keep 50%, 5% and 0.1% of the ids
  (``indexer.filters.IdFilter``; the bitmaps the server builds from its label range scans). Reported per index
  type and filter: queries/s one query at a time (one FAISS thread: the server's micro-batch of one), recall@10
  against exact filtered search over the allowed live vectors, and the path taken (exact scoring of the allowed
  ids, or the selector with raised depth) - also with the depth raise switched off, to show what it buys.
- **thresholds**: ``min_score`` searches on the same indexes: an HNSW base scanned exactly over its flat storage
  against the growing search used past ``indexer.searcher.HNSW_SCAN_MAX`` (queries/s, recall of the items above
  thresholds met by the first 11, 41 and 81).
- **duplicates**: ``indexer.duplicates.duplicate_groups`` over the same IVF index (every item searched for its 10
  nearest with its stored vector; 1% of items planted as near-copies): wall time, items/s, groups found.
- **classify**: ``moco classify INDEX_DIR FOLDER --out rows.csv`` over ``--images`` generated PNGs against a
  small real index (a random-weight ResNet-18 exported to ONNX, 32 px), next to the encoder alone on the same
  images decoded beforehand (the indexer's decode) in the CLI's batches: images/s of each, and of the CLI less
  its fixed start (the same command over one image).

    python -m bench.search_filters filters --n 1000000
    python -m bench.search_filters thresholds --n 200000 --factories IDMap2,HNSW32 --queries 100
    python -m bench.search_filters duplicates --n 1000000
    python -m bench.search_filters classify --images 10000
    python -m bench.search_filters all --n 20000 --images 200 --work /tmp/sf   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from bench.scale_data import CHUNK, DIM, chunk_vectors  # noqa: E402

OUT = REPO / "bench" / "results"
KEEP = (0.5, 0.05, 0.001)  # fractions of the ids a filter keeps
K = 10


def _write(name: str, args, rows: list[dict]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = Path(args.out_dir) / name
    body = {
        "benchmark": "search_filters",
        "command": " ".join(sys.argv),
        "machine": machine(),
        "rows": rows,
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def _corpus(n: int, d: int = DIM) -> np.ndarray:
    return np.concatenate([chunk_vectors(c, d) for c in range(1 + (n - 1) // CHUNK)])[:n]


def _layered(factory: str, xb: np.ndarray):
    """A LayeredIndex over ``xb``: base of 99% (1% of it removed), delta of the last 1%; its exact vectors."""
    import faiss

    from moco_retrieval.indexer.faiss_index import build_index
    from moco_retrieval.indexer.searcher import LayeredIndex

    n, d = xb.shape
    n_base = int(n * 0.99)
    ids = np.arange(n, dtype=np.int64)
    built = build_index(factory, d, n_base, lambda: iter([(ids[:n_base], xb[:n_base])]), use_gpu=False)
    delta = faiss.index_factory(d, "IDMap2,Flat", faiss.METRIC_INNER_PRODUCT)
    delta.add_with_ids(xb[n_base:], ids[n_base:])
    removed = ids[:n_base:100]

    class Vectors:  # the stored vectors, as BlockVectors gives them
        def get(self, wanted):
            wanted = np.asarray(wanted)
            ok = (wanted >= 0) & (wanted < n)
            return ok, xb[np.where(ok, wanted, 0)]

    return LayeredIndex(built.index, delta, removed, built.search_params, vectors=Vectors()), built, removed


def phase_filters(args) -> None:
    import faiss

    from moco_retrieval.indexer import searcher
    from moco_retrieval.indexer.filters import IdFilter

    faiss.omp_set_num_threads(1)
    xb = _corpus(args.n)
    xq = np.concatenate([chunk_vectors(c, DIM, seed=7) for c in range(1 + args.queries // CHUNK)])[: args.queries]
    rows = []
    for factory in args.factories:
        tic = time.perf_counter()
        index, built, removed = _layered(factory, xb)
        build_s = time.perf_counter() - tic
        live = np.ones(args.n, dtype=bool)
        live[removed] = False
        rng = np.random.default_rng(0)
        for keep in args.keep:
            bits = rng.random(args.n) < keep  # ids of a label: spread over the corpus, as labels are
            filt = IdFilter.of_bits(bits)
            allowed = np.flatnonzero(bits & live)
            ref = np.argsort(-(xq @ xb[allowed].T), axis=1)[:, :K]
            truth = allowed[ref]
            # True: the rule as built; False: the plain selector at the unfiltered depth (what a naive filter
            # gets); an int: the selector at that fixed depth factor (to choose the rule from)
            for raise_depth in (True, False, *args.depth_factors):
                saved = (searcher.answered_exactly, searcher.depth_factor)
                if raise_depth is not True:
                    fixed = 1 if raise_depth is False else raise_depth
                    searcher.answered_exactly = lambda kept, total: False
                    searcher.depth_factor = lambda kept, total, f=fixed: f
                try:
                    index.search(xq[:5], K, filt)  # warm up
                    tic = time.perf_counter()
                    found = [index.search(q[None], K, filt)[1][0] for q in xq]
                    seconds = time.perf_counter() - tic
                finally:
                    searcher.answered_exactly, searcher.depth_factor = saved
                want = max(1, min(K, len(allowed)))  # a filter keeping fewer than K items has fewer to find
                recall = float(np.mean([len(set(f.tolist()) & set(t.tolist())) / want for f, t in zip(found, truth)]))
                if raise_depth is True:
                    exact = searcher.answered_exactly(filt.count(), index.ntotal)
                    path = "exact" if exact else f"selector x{searcher.depth_factor(filt.count(), index.ntotal)}"
                else:
                    path = f"selector x{1 if raise_depth is False else raise_depth}"
                row = {
                    "factory": factory,
                    "n": args.n,
                    "params": built.search_params,
                    "build_s": round(build_s, 1),
                    "keep": keep,
                    "kept": int(len(allowed)),
                    "raise_depth": raise_depth,
                    "path": path,
                    "qps": round(len(xq) / seconds, 1),
                    "recall_at_10": round(recall, 4),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    _write(args.name or f"search_filters_{args.n}.json", args, rows)


def phase_thresholds(args) -> None:
    """Threshold search (``min_score``) on each factory: an HNSW part scanned exactly over its flat storage
    against the growing search the engine does past ``searcher.HNSW_SCAN_MAX`` (its first ``--threshold-k``
    at the tuned depth, then again with the depth raised by ``filters.threshold_factor`` of the items above),
    for thresholds met by the first 11, 41 and 81 items: queries/s (one at a time, one FAISS thread) and the
    recall of the items above the threshold."""
    import faiss

    from moco_retrieval.indexer import searcher
    from moco_retrieval.indexer.filters import threshold_factor

    faiss.omp_set_num_threads(1)
    xb = _corpus(args.n)
    xq = np.concatenate([chunk_vectors(c, DIM, seed=7) for c in range(1 + args.queries // CHUNK)])[: args.queries]
    rows = []
    for factory in args.factories:
        index, built, removed = _layered(factory, xb)
        live = np.ones(args.n, dtype=bool)
        live[removed] = False
        scores = xq @ xb[live].T
        ranked = -np.sort(-scores, axis=1)
        for rank in (10, 40, 80):
            radius = ranked[:, rank] - 1e-4
            truth = [set(np.flatnonzero(live)[scores[q] >= radius[q]].tolist()) for q in range(len(xq))]
            for path in ("scan", "grown"):
                searcher.HNSW_SCAN_MAX = args.n if path == "scan" else 0
                index.__dict__.pop("_scans", None)
                if path == "scan" and not index.can_range_search:
                    continue
                found = []
                tic = time.perf_counter()
                for q in range(len(xq)):
                    if path == "scan":
                        ((D, I),) = index.range_search(xq[q : q + 1], float(radius[q]))
                    else:
                        D, I = index.search(xq[q : q + 1], args.threshold_k)
                        above = int(np.count_nonzero((I[0] >= 0) & (D[0] >= radius[q])))
                        if threshold_factor(above) > 1:
                            D, I = index.search(xq[q : q + 1], args.threshold_k, depth=threshold_factor(above))
                        D, I = D[0], I[0]
                    found.append(set(I[(I >= 0) & (D >= radius[q])].tolist()))
                seconds = time.perf_counter() - tic
                recall = sum(len(f & t) for f, t in zip(found, truth)) / sum(len(t) for t in truth)
                row = {
                    "factory": factory,
                    "n": args.n,
                    "params": built.search_params,
                    "above": rank + 1,
                    "path": path,
                    "qps": round(len(xq) / seconds, 1),
                    "recall": round(recall, 4),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    _write(args.name or f"search_thresholds_{args.n}.json", args, rows)


def phase_duplicates(args) -> None:
    import faiss

    from moco_retrieval.indexer.duplicates import duplicate_groups

    faiss.omp_set_num_threads(args.threads)
    xb = _corpus(args.n)
    rng = np.random.default_rng(1)
    copies = rng.choice(args.n, size=args.n // 100, replace=False)  # 1% near-copies of another item
    sources = rng.choice(args.n, size=len(copies), replace=False)
    xb[copies] = xb[sources] + 0.05 * rng.standard_normal((len(copies), DIM), dtype=np.float32) / np.sqrt(DIM)
    xb[copies] /= np.linalg.norm(xb[copies], axis=1, keepdims=True)
    index, built, _ = _layered(args.dup_factory, xb)
    tic = time.perf_counter()
    groups = duplicate_groups(index, args.threshold)
    seconds = time.perf_counter() - tic
    row = {
        "factory": args.dup_factory,
        "n": args.n,
        "params": built.search_params,
        "threshold": args.threshold,
        "threads": args.threads,
        "seconds": round(seconds, 1),
        "items_per_s": round(index.ntotal / seconds, 1),
        "groups": len(groups),
        "items_in_groups": sum(len(g.ids) for g in groups),
        "planted_pairs": len(copies),
    }
    print(json.dumps(row), flush=True)
    _write(args.name or f"search_duplicates_{args.n}.json", args, [row])


def _moco_classify(index: Path, queries: Path, out: Path) -> float:
    """Seconds of one ``moco classify INDEX QUERIES --out OUT`` process, start to end."""
    import subprocess

    tic = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "moco_retrieval", "-q", "classify", str(index), str(queries), "--out", str(out)]
        + ["--device", "cpu", "--no-progress"],
        check=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    return time.perf_counter() - tic


def phase_classify(args) -> None:
    import csv

    from PIL import Image

    from bench.index_scale import make_encoder
    from moco_retrieval.app.query_files import decode_workers
    from moco_retrieval.indexer.build import IndexConfig, build_index_dir
    from moco_retrieval.indexer.decode import decode_files
    from moco_retrieval.indexer.encoder import OnnxEncoder, read_encoder_metadata
    from moco_retrieval.serve.config import EngineConfig

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    encoder = make_encoder(work)
    rng = np.random.default_rng(3)

    def write_images(root: Path, n: int) -> None:
        colours = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
        for i in range(n):
            name, rgb = list(colours.items())[i % 4]
            (root / name).mkdir(parents=True, exist_ok=True)
            img = np.asarray(rgb, dtype=np.float64) + rng.normal(0, 25, (32, 32, 3))
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / name / f"{i:06d}.png")

    corpus, queries, index = work / "corpus", work / "queries", work / "index"
    if not index.is_dir():
        write_images(corpus, args.corpus)
        build_index_dir(IndexConfig(str(corpus), str(encoder), str(index), workers=0, progress=False, device="cpu"))
    if not queries.is_dir():
        write_images(queries, args.images)
    one = work / "one_query"  # the CLI's fixed cost: imports, opening the index and the encoder
    if not one.is_dir():
        write_images(one, 1)
    paths = sorted(str(p.relative_to(queries)) for p in queries.rglob("*.png"))
    cfg = EngineConfig()  # the CLI's: its batch, encoder threads and spin

    # (b) the whole CLI: processes decoding, the encoder in whole batches, vector search, the CSV
    out = work / "rows.csv"
    start_s = _moco_classify(index, one, work / "one.csv")
    cli_s = _moco_classify(index, queries, out)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(paths) and not any(r["error"] for r in rows), "every query must be answered"

    # (a) the encoder alone on the same pixels (the indexer's decode, done beforehand), in the CLI's batches
    meta = read_encoder_metadata(encoder)
    pixels = np.stack([d.pixels for d in decode_files(queries, paths, meta["image_size"], meta["resize"], 0)])
    alone = {}
    for spin in (cfg.spin, not cfg.spin):
        enc = OnnxEncoder(encoder, device="cpu", threads=cfg.threads, spin=spin)
        enc.embed(pixels[: 2 * cfg.max_batch])  # warm up
        tic = time.perf_counter()
        for start in range(0, len(pixels), cfg.max_batch):
            enc.embed(pixels[start : start + cfg.max_batch])
        alone[spin] = len(pixels) / (time.perf_counter() - tic)
    row = {
        "images": len(paths),
        "corpus": args.corpus,
        "batch": cfg.max_batch,
        "decode_processes": decode_workers(len(paths), cfg.max_batch, cfg.decode_slots),
        "encoder_spin": cfg.spin,
        "encoder_alone_images_per_s": round(alone[cfg.spin], 1),
        "encoder_alone_images_per_s_by_spin": {str(spin).lower(): round(v, 1) for spin, v in alone.items()},
        "classify_cli_s": round(cli_s, 2),
        "classify_images_per_s": round(len(paths) / cli_s, 1),
        "classify_cli_start_s": round(start_s, 2),
        "classify_images_per_s_after_start": round(len(paths) / max(1e-9, cli_s - start_s), 1),
        "note": "encoder alone: opened as the CLI opens it (EngineConfig threads and spin; the other spin beside "
        "it), on pixels decoded beforehand, batches of max_batch. CLI: the whole process; after_start subtracts "
        "the time of the same command over one image (imports, opening the index and the encoder).",
    }
    print(json.dumps(row), flush=True)
    _write(args.name or f"search_classify_{args.images}.json", args, [row])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("filters", "thresholds", "duplicates", "classify", "all"))
    p.add_argument("--n", type=int, default=1_000_000, help="filters / duplicates: vectors (512-d)")
    p.add_argument("--queries", type=int, default=200, help="filters: query vectors")
    p.add_argument(
        "--factories",
        nargs="+",
        default=["IVF1024,Flat", "IDMap2,HNSW32"],
        help="filters: index types (FAISS factory strings)",
    )
    p.add_argument("--keep", nargs="+", type=float, default=list(KEEP), help="filters: fractions of the ids kept")
    p.add_argument(
        "--depth-factors",
        nargs="*",
        type=int,
        default=[],
        help="filters: also search with the selector at these fixed depth factors (nprobe / efSearch times F)",
    )
    p.add_argument("--threshold-k", type=int, default=1000, help="thresholds: k of the growing search (max_k)")
    p.add_argument("--dup-factory", default="IVF1024,Flat", help="duplicates: index type")
    p.add_argument("--threshold", type=float, default=0.95, help="duplicates: similarity threshold")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="duplicates: FAISS threads")
    p.add_argument("--images", type=int, default=10_000, help="classify: query images in the folder")
    p.add_argument("--corpus", type=int, default=2_000, help="classify: indexed images")
    p.add_argument("--work", default=None, help="classify: scratch folder (default: a temporary one)")
    p.add_argument("--out-dir", default=str(OUT), help="folder the JSON files go to")
    p.add_argument("--name", default=None, help="JSON file name (default: by phase and size)")
    args = p.parse_args()
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="search_filters-")
    phases = ("filters", "thresholds", "duplicates", "classify") if args.phase == "all" else (args.phase,)
    run = {"filters": phase_filters, "thresholds": phase_thresholds, "duplicates": phase_duplicates}
    for phase in phases:
        {**run, "classify": phase_classify}[phase](args)


if __name__ == "__main__":
    main()
