"""Serving latency and throughput of ``POST /api/search`` under concurrent loopback load (JSON out).

Starts ``moco serve --no-ui`` as its own process on a free loopback port (so the load generator does not
share its interpreter), then for each ``--concurrency`` level sends ``--requests`` uploads from that many
client threads (after ``--warmup`` untimed ones). Reports client-side latency p50/p95/p99, throughput, and
the server's own split of each request into decode, queue, embed, search and metadata (embed and search
are per micro-batch: the batch's time, shared by the requests in it) plus the mean batch size.

Without ``--index-dir`` it builds one first: the demo's generated shapes (``--corpus`` images, 32 px)
embedded by a randomly initialised ResNet-18 exported to ONNX (serving cost does not depend on training).

    python bench/serve_latency.py --corpus 2000 --concurrency 1 4 16 --requests 300
    python bench/serve_latency.py --index-dir demo/index --queries demo/data --concurrency 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("decode", "queue", "embed", "search", "metadata", "total")


def build_bench_index(work: Path, corpus: int, device: str, stem: str = "auto") -> tuple[Path, Path]:
    """Generated shapes + random-init ResNet-18 (32 px, ``stem``) -> ``(index dir, image folder)``."""
    import torch

    from moco_retrieval.indexer.build import IndexConfig, build_index_dir
    from moco_retrieval.trainer.checkpoint import (
        CHECKPOINT_FORMAT,
        CHECKPOINT_VERSION,
        LAST,
        save_atomic,
    )
    from moco_retrieval.trainer.config import TrainConfig
    from moco_retrieval.trainer.demo_data import CLASSES, write_demo_dataset
    from moco_retrieval.trainer.export import export_encoder
    from moco_retrieval.trainer.variants import build_model

    data, index = work / "images", work / "index"
    if (index / "CURRENT").is_file():  # built by an earlier run
        return index, data
    if not data.is_dir():
        write_demo_dataset(data, per_class=max(1, corpus // len(CLASSES)), size=32, seed=0)
    run = work / "run"
    cfg = TrainConfig(
        data_dir=str(data),
        out_dir=str(run),
        arch="resnet18",
        stem=stem,
        image_size=32,
        epochs=1,
        batch_size=32,
        queue_size=128,
        workers=0,
        device="cpu",
        knn_every=0,
        run_id="bench",
    )
    torch.manual_seed(0)
    run.mkdir(parents=True, exist_ok=True)
    save_atomic(
        {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "run_id": "bench",
            "config": cfg.to_dict(),
            "model": build_model(cfg, bn_splits=1).state_dict(),
            "epoch": 0,
            "step": 0,
        },
        run / LAST,
    )
    encoder = export_encoder(run, work / "encoder.onnx", verify=False, image_size=cfg.image_size).path
    build_index_dir(IndexConfig(str(data), str(encoder), str(index), workers=0, progress=False, device=device))
    return index, data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    index: Path, port: int, device: str, threads: int | None, ui: bool = False, metrics: bool = True
) -> subprocess.Popen:
    cmd = (
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(index),
            "--port",
            str(port),
            "--device",
            device,
            "--poll-seconds",
            "0",
        ]
        + ([] if ui else ["--no-ui"])
        + ([] if metrics else ["--no-metrics"])
    )
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    line = proc.stdout.readline()
    if f":{port}/" not in line:
        proc.kill()
        raise RuntimeError(f"moco serve did not start: {line!r}")
    return proc


def percentiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1000
    return {
        "p50_ms": float(np.percentile(a, 50)),
        "p95_ms": float(np.percentile(a, 95)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
    }


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores of this machine spent busy so far (Linux /proc/stat; 0.0 elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_level(
    url: str, payloads: list[bytes], concurrency: int, requests: int, warmup: int, k: int, server_pid: int
) -> dict:
    import httpx

    local = threading.local()

    def one(i: int):
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=60)
        data = payloads[i % len(payloads)]
        tic = time.perf_counter()
        r = client.post(f"{url}/api/search", params={"k": k}, files={"image": ("q.png", data, "image/png")})
        latency = time.perf_counter() - tic
        r.raise_for_status()
        body = r.json()
        return latency, body["timings"], body["batch_size"]

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(warmup)))
        tic, server_cpu, client_cpu = time.perf_counter(), process_cpu_seconds(server_pid), time.process_time()
        busy = machine_busy_seconds()
        results = list(pool.map(one, range(requests)))
        wall = time.perf_counter() - tic
        server_cpu = process_cpu_seconds(server_pid) - server_cpu
        client_cpu = time.process_time() - client_cpu
        other_cpu = machine_busy_seconds() - busy - server_cpu - client_cpu
    latencies = [r[0] for r in results]
    server = {phase: percentiles([r[1][phase] for r in results]) for phase in PHASES}
    return {
        "concurrency": concurrency,
        "requests": requests,
        "seconds": wall,
        "throughput_rps": requests / wall,
        "latency": percentiles(latencies),
        "server_phases": server,
        "mean_batch_size": float(np.mean([r[2] for r in results])),
        # CPU per request of each side (both share the machine's cores)
        "server_cpu_ms_per_request": 1000 * server_cpu / requests,
        "client_cpu_ms_per_request": 1000 * client_cpu / requests,
        # CPU the rest of the machine took meanwhile, in cores (other processes: noise in the figures)
        "other_cpu_cores": max(0.0, other_cpu / wall),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index-dir", type=Path, default=None, help="serve this index (default: build one in --work)")
    p.add_argument("--queries", type=Path, default=None, help="folder of query images (default: the indexed ones)")
    p.add_argument(
        "--work", type=Path, default=None, help="where to build the index (default bench/results/serve_work_<stem>)"
    )
    p.add_argument(
        "--stem",
        default="auto",
        choices=("auto", "small", "imagenet"),
        help="ResNet-18 stem of the built index's encoder: auto = small at 32 px (3x3 stride 1, about "
        "16x the compute), imagenet = the demo's (7x7 stride 2 + max-pool)",
    )
    p.add_argument("--ui", action="store_true", help="mount the Gradio UI too (as `moco serve` does by default)")
    p.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve without /metrics (to measure what the Prometheus metrics cost)",
    )
    p.add_argument("--corpus", type=int, default=2000, help="images in the built index (default 2000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="client threads per level")
    p.add_argument("--requests", type=int, default=300, help="timed requests per level")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests per level")
    p.add_argument("-k", type=int, default=10, help="neighbours per query")
    p.add_argument("--device", default="cpu", help="encoder device of the server: auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="encoder threads of the server")
    p.add_argument("--out", type=Path, default=Path("bench/results/serve_latency.json"))
    args = p.parse_args()

    index, images = args.index_dir, args.queries
    if index is None:
        work = args.work or Path(f"bench/results/serve_work_{args.stem}")
        index, built_images = build_bench_index(work, args.corpus, args.device, args.stem)
        images = images or built_images
    if images is None:
        images = Path(
            json.loads((index / "generations" / (index / "CURRENT").read_text().strip() / "manifest.json").read_text())[
                "image_root"
            ]
        )
    files = sorted(p for p in images.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
    payloads = [f.read_bytes() for f in files[:: max(1, len(files) // 64)]][:64]
    manifest = json.loads(
        (index / "generations" / (index / "CURRENT").read_text().strip() / "manifest.json").read_text()
    )

    port = free_port()
    server = start_server(index, port, args.device, args.threads, args.ui, args.metrics)
    try:
        levels = []
        for c in args.concurrency:
            level = run_level(f"http://127.0.0.1:{port}", payloads, c, args.requests, args.warmup, args.k, server.pid)
            lat = level["latency"]
            print(
                f"concurrency {c:3d}: {level['throughput_rps']:7.1f} req/s  p50 {lat['p50_ms']:6.1f} ms  "
                f"p95 {lat['p95_ms']:6.1f} ms  p99 {lat['p99_ms']:6.1f} ms  batch {level['mean_batch_size']:.1f}  "
                f"cpu/req server {level['server_cpu_ms_per_request']:.1f} client {level['client_cpu_ms_per_request']:.1f} ms  "
                + "  ".join(f"{ph} {level['server_phases'][ph]['p50_ms']:.1f}" for ph in PHASES[:-1])
                + " (p50 ms)"
            )
            levels.append(level)
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = {
        "benchmark": "serve_latency",
        "endpoint": "POST /api/search",
        "k": args.k,
        "index": {
            "count": manifest["count"],
            "factory": manifest["factory"],
            "embedding_dim": manifest["embedding_dim"],
            "model": manifest.get("model"),
        },
        "query_bytes_mean": float(np.mean([len(p) for p in payloads])),
        "device": args.device,
        "threads": args.threads,
        "stem": args.stem if args.index_dir is None else None,
        "ui": args.ui,
        "metrics": args.metrics,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "levels": levels,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
