"""The ``serve`` phase of ``bench/index_scale.py``: memory and throughput of serving one large index from 1, 2
and 4 processes (JSON rows appended to the same file).

For each worker count N:

The index files and vector blocks are read once first (a warm page cache, as for a server that has been
running). With ``--cold`` they are dropped from the page cache instead (``posix_fadvise(DONTNEED)`` on each
file): a server just started, or an index larger than the page cache, measures the disk. Either way each
process reports its per-query latency (p50 / p99) and what one query read from the disk (``read_bytes`` of
``/proc/self/io``, major page faults): the I/O a query costs, and so the disk it needs.

- **search**: N processes (spawned, like ``moco serve --workers N``) each open the live generation with
  :class:`indexer.index_dir.IndexDirectory` (memory-mapped, as the server does), search ``WARMUP`` queries
  untimed (paging the index in; not with ``--cold``), then search held-out query vectors one at a time (k=10,
  one FAISS thread each: the server's micro-batch of one) for ``--seconds``;
  reported: total queries/s, recall@10 of those results against exact search over the live vectors, and each
  process's RSS, PSS and private memory (``/proc/<pid>/smaps_rollup``) after searching;
- **http** (``--http``): ``moco serve --workers N --no-ui`` itself, uploads of 32 px images from 2N client
  threads: requests/s and each worker's RSS / PSS / private memory (image decode + the ONNX encoder + search).

Shared pages (the memory-mapped index) count fully in each RSS; PSS splits them between the processes; the
private memory is what one more worker adds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.scale_data import CHUNK, chunk_vectors, record

REPO = Path(__file__).resolve().parents[1]
WARMUP = 20  # untimed queries per process before the clock starts


def smaps(pid: int | str = "self") -> dict[str, int]:
    """RSS, PSS and private (clean + dirty) bytes of a process."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        values[key] = int(value.split()[0]) * 1024
    return {"rss": values["Rss"], "pss": values["Pss"], "private": values["Private_Clean"] + values["Private_Dirty"]}


def _queries(work: Path, n: int, d: int) -> np.ndarray:
    return np.concatenate([chunk_vectors(c, d, seed=7) for c in range(1 + n // CHUNK)])[:n]


def _ground_truth(work: Path, index_dir: Path, xq: np.ndarray, k: int = 10) -> np.ndarray:
    """Exact top-k ids of ``xq`` over the live vectors of the live generation (cached per generation)."""
    from moco_retrieval.indexer.faiss_index import exact_knn
    from moco_retrieval.indexer.index_dir import IndexDirectory
    from moco_retrieval.indexer.layout import IndexLayout
    from moco_retrieval.indexer.metadata import MetadataStore
    from moco_retrieval.indexer.vectors import live_blocks

    with IndexDirectory.open(index_dir) as d:
        gen, blocks = d.generation, d.manifest.vector_blocks
        delta = d.generation_path / "delta.lmdb"
        with MetadataStore(d.generation_path / "meta.lmdb", delta=delta if delta.is_dir() else None) as store:
            live = store.live_ids()
    cache = work / f"truth_{gen}_{len(xq)}.npy"
    if cache.is_file():
        return np.load(cache)
    tic = time.perf_counter()
    _, I = exact_knn(xq, live_blocks(IndexLayout(index_dir), blocks, live), k)
    print(f"ground truth of {len(xq)} queries over {len(live)} vectors: {time.perf_counter() - tic:.1f} s", flush=True)
    np.save(cache, I)
    return I


def _io() -> tuple[int, int]:
    """Bytes this process has caused to be read from the disk, and its major page faults."""
    import resource

    read = next(
        int(line.split()[1]) for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("read_bytes")
    )
    return read, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _search_worker(index_dir: str, xq: np.ndarray, seconds: float, cold: bool, start, done, results) -> None:
    import faiss

    from moco_retrieval.indexer.index_dir import IndexDirectory

    faiss.omp_set_num_threads(1)
    with IndexDirectory.open(index_dir) as d:
        loaded = smaps()
        if not cold:
            for q in xq[:WARMUP]:  # page the mapped index in (a cold page cache is a disk benchmark)
                d.index.search(q[None], 10)
        start.wait()
        found, latency, n, io0, tic = [], [], 0, _io(), time.perf_counter()
        while time.perf_counter() - tic < seconds:
            t = time.perf_counter()
            _, I = d.index.search(xq[n % len(xq)][None], 10)
            latency.append(time.perf_counter() - t)
            found.append((n % len(xq), I[0]))
            n += 1
        elapsed = time.perf_counter() - tic
        io1 = _io()
        done.wait()  # every process still has the index mapped: shared pages are counted as shared
        memory = smaps()
        done.wait()
        results.put(
            {
                "queries": n,
                "seconds": elapsed,
                "latency": latency,
                "read_bytes": io1[0] - io0[0],
                "major_faults": io1[1] - io0[1],
                "memory_loaded": loaded,
                "memory": memory,
                "found": found[: len(xq)],
            }
        )


def warm_page_cache(index_dir: Path) -> float:
    """Read the live generation's FAISS files and vector blocks once, so that every worker count is measured
    with the index in the page cache (as a server that has been running is); returns the seconds it took."""
    tic = time.perf_counter()
    for path in _index_files(index_dir):
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - tic


def _index_files(index_dir: Path) -> list[Path]:
    """The live generation's FAISS files and vector blocks: what a search may read."""
    from moco_retrieval.indexer.index_dir import IndexDirectory
    from moco_retrieval.indexer.layout import IndexLayout

    with IndexDirectory.open(index_dir) as d:
        files = [p for p in d.generation_path.iterdir() if p.suffix in (".faiss", ".ivfdata", ".npy")]
        return files + [p for b in d.manifest.vector_blocks for p in IndexLayout(index_dir).vector_block(b)]


def drop_page_cache(index_dir: Path) -> int:
    """Evict the live generation's files from the page cache (``POSIX_FADV_DONTNEED``); their bytes."""
    total = 0
    for path in _index_files(index_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def search_level(
    index_dir: Path, xq: np.ndarray, truth: np.ndarray, workers: int, seconds: float, cold: bool = False
) -> dict:
    from moco_retrieval.indexer.faiss_index import recall_at_k

    ctx = multiprocessing.get_context("spawn")
    start, done, results = ctx.Event(), ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_search_worker, args=(str(index_dir), xq, seconds, cold, start, done, results))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    time.sleep(0.5)
    start.set()
    rows = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    qps = sum(r["queries"] / r["seconds"] for r in rows)
    hits = [(i, I) for r in rows for i, I in r["found"]]
    recall = recall_at_k(np.stack([I for _, I in hits]), truth[[i for i, _ in hits]])
    latency = np.concatenate([r["latency"] for r in rows])
    queries = sum(r["queries"] for r in rows)
    return {
        "workers": workers,
        "page_cache": "cold" if cold else "warm",
        "qps": round(qps, 1),
        "recall_at_10": round(recall, 4),
        "latency_ms": {
            "p50": round(1000 * float(np.percentile(latency, 50)), 2),
            "p99": round(1000 * float(np.percentile(latency, 99)), 2),
        },
        "per_query": {
            "disk_read_bytes": round(sum(r["read_bytes"] for r in rows) / queries),
            "major_faults": round(sum(r["major_faults"] for r in rows) / queries, 2),
        },
        "memory": [r["memory"] for r in rows],
        "memory_loaded": [r["memory_loaded"] for r in rows],
    }


def http_level(index_dir: Path, workers: int, seconds: float) -> dict:
    """``moco serve --workers N``: requests/s of 32 px uploads, and each worker's memory."""
    import io
    import logging
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from PIL import Image

    logging.getLogger("httpx").setLevel(logging.WARNING)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(index_dir),
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--no-ui",
            "--device",
            "cpu",
            "--poll-seconds",
            "0",
            "--faiss-gpu",
            "none",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO)),
    )
    try:
        line = proc.stdout.readline()
        if f":{port}/" not in line:
            raise RuntimeError(f"moco serve did not start: {line!r}")
        rng = np.random.default_rng(0)
        payloads = []
        for _ in range(32):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
            payloads.append(buffer.getvalue())
        url = f"http://127.0.0.1:{port}/api/search"
        pids: set[str] = set()
        phases: list[dict] = []
        local = threading.local()

        def one(i: int):
            # keep-alive, but a new connection every 25 requests: the kernel picks a worker per connection
            if getattr(local, "used", 25) >= 25:
                if getattr(local, "client", None) is not None:
                    local.client.close()
                local.client, local.used = httpx.Client(timeout=60), 0
            local.used += 1
            tic = time.perf_counter()
            r = local.client.post(url, params={"k": 10}, files={"image": ("q.png", payloads[i % 32])})
            r.raise_for_status()
            pids.add(r.headers["x-moco-worker"])
            phases.append({**r.json()["timings"], "client": time.perf_counter() - tic})

        with ThreadPoolExecutor(2 * workers) as pool:
            list(pool.map(one, range(8 * workers)))  # warm-up: every worker loaded and answering
            n, tic = 0, time.perf_counter()
            while time.perf_counter() - tic < seconds:
                list(pool.map(one, range(n, n + 16)))
                n += 16
            elapsed = time.perf_counter() - tic
        memory = [smaps(pid) for pid in sorted(pids)]
        timed = phases[8 * workers :]
        median_ms = {k: round(1000 * float(np.median([t[k] for t in timed])), 2) for k in timed[0]}
        return {
            "workers": workers,
            "requests_per_s": round(n / elapsed, 1),
            "workers_seen": len(pids),
            "median_ms": median_ms,
            "memory": memory,
            "supervisor": smaps(proc.pid),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def phase_serve(args, work: Path) -> None:
    from moco_retrieval.indexer.index_dir import IndexDirectory

    index_dir = work / "index"
    with IndexDirectory.open(index_dir) as d:
        manifest = d.manifest
    xq = _queries(work, args.queries, manifest.embedding_dim)
    truth = _ground_truth(work, index_dir, xq)
    info = {
        "count": manifest.count,
        "factory": manifest.factory,
        "search_params": manifest.search_params,
        "on_disk": manifest.on_disk,
        "generation": manifest.generation,
        "delta_count": manifest.delta_count,
        "removed_count": manifest.removed_count,
    }
    if not args.cold:
        print(f"page cache warmed in {warm_page_cache(index_dir):.1f} s", flush=True)
    for workers in args.workers:
        if args.cold:
            print(
                f"dropped {drop_page_cache(index_dir) / 2**30:.1f} GiB of index files from the page cache", flush=True
            )
        row = search_level(index_dir, xq, truth, workers, args.seconds, cold=args.cold)
        record(args, "serve_search", {"index": info, **row})
    if args.http:
        for workers in args.workers:
            record(args, "serve_http", {"index": info, **http_level(index_dir, workers, args.seconds)})
    print(json.dumps(info))
