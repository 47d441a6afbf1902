"""Peak server memory (RSS) while hostile or large uploads arrive at once (JSON out).

Starts ``moco serve --no-ui`` over an index (``--index-dir``, e.g. one built by ``bench/serve_latency.py``)
from the source tree ``--src`` (so the same script measures an older checkout too), then for each scenario
resets the server's peak-RSS counter (``/proc/PID/clear_refs``), sends ``--clients`` uploads at once and reads
the peak back (``VmHWM``):

- ``line_1x250000``: the 565-byte 1x250,000 PNG (fits the pixel limit; resized it was 32x8,000,000);
- ``jpeg_24mp``: a 6000x4000 JPEG photo-like gradient (a large, valid upload);
- ``png_24mp_rgba``: a 6000x4000 RGBA PNG (a large, valid upload with transparency);
- ``small``: 32 px PNGs (the baseline);
- ``png_31mib_noise``: 31 MiB PNGs of noise, just under the upload limit (the fault matrix sent 100 at once).

    python bench/serve_memory.py --index-dir bench/results/serve_work_imagenet/index --out bench/results/serve_memory.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=90) if fmt == "JPEG" else image.save(buffer, format=fmt)
    return buffer.getvalue()


def scenarios() -> dict[str, bytes]:
    h, w = 4000, 6000
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([(x / w) * 255, (y / h) * 255, ((x + y) % 256)], axis=-1).astype(np.uint8)
    alpha = ((x // 500 + y // 500) % 2 * 255).astype(np.uint8)[..., None]
    return {
        "line_1x250000": _encode(Image.new("L", (1, 250_000)), "PNG"),
        "jpeg_24mp": _encode(Image.fromarray(rgb), "JPEG"),
        "png_24mp_rgba": _encode(Image.fromarray(np.concatenate([rgb, alpha], axis=-1), "RGBA"), "PNG"),
        "small": _encode(Image.fromarray(rgb[:32, :32]), "PNG"),
        # the fault matrix's case: 31 MiB uploads (noise does not compress), just under the 32 MiB limit
        "png_31mib_noise": _encode(
            Image.fromarray(np.random.default_rng(0).integers(0, 256, (3300, 3300, 3), dtype=np.uint8)), "PNG"
        ),
    }


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index-dir", type=Path, required=True, help="an index directory to serve")
    p.add_argument("--src", type=Path, default=ROOT, help="the source tree whose `moco serve` runs (default: this one)")
    p.add_argument("--clients", type=int, default=8, help="uploads sent at once per scenario (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="times each scenario's burst is sent (default 3)")
    p.add_argument("--label", default="", help="a name for this measurement, stored in the JSON")
    p.add_argument("--scenario", action="append", help="only these scenarios (repeatable; default all)")
    p.add_argument("--out", type=Path, default=Path("bench/results/serve_memory.json"))
    args = p.parse_args()
    import httpx

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(args.src.resolve()), PYTHONUNBUFFERED="1")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moco_retrieval",
            "serve",
            str(args.index_dir.resolve()),
            "--port",
            str(port),
            "--no-ui",
            "--device",
            "cpu",
            "--poll-seconds",
            "0",
        ],
        cwd=args.src,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        if f":{port}/" not in server.stdout.readline():
            raise RuntimeError("moco serve did not start")
        url = f"http://127.0.0.1:{port}/api/search"
        results = {}
        with httpx.Client(timeout=300) as client:

            def post(data: bytes) -> int:
                return client.post(url, files={"image": ("q.png", data, "image/png")}).status_code

            made = scenarios()
            post(made["small"])  # warm: the first request loads what every request uses
            for name, data in made.items():
                if args.scenario and name not in args.scenario:
                    continue
                Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
                base = status_kib(server.pid, "VmRSS")
                tic = time.perf_counter()
                with ThreadPoolExecutor(args.clients) as pool:
                    statuses = [s for _ in range(args.rounds) for s in pool.map(post, [data] * args.clients)]
                results[name] = {
                    "upload_bytes": len(data),
                    "statuses": sorted(set(statuses)),
                    "rss_before_mib": base / 1024,
                    "peak_rss_mib": status_kib(server.pid, "VmHWM") / 1024,
                    "peak_over_before_mib": (status_kib(server.pid, "VmHWM") - base) / 1024,
                    "seconds": time.perf_counter() - tic,
                }
                print(
                    f"{name:>14}: {len(data):>9} bytes  statuses {results[name]['statuses']}  RSS "
                    f"{base / 1024:7.0f} MiB -> peak {results[name]['peak_rss_mib']:7.0f} MiB  "
                    f"({results[name]['seconds']:.1f} s)"
                )
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = {
        "benchmark": "serve_memory",
        "label": args.label,
        "clients": args.clients,
        "rounds": args.rounds,
        "src": str(args.src),
        "index": str(args.index_dir),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "scenarios": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
