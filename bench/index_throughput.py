"""Indexing throughput: images/s of ``moco index`` end to end, of decoding alone and of the encoder alone.

Generates ``--images`` shapes at ``--image-px`` (PNG) once, exports a randomly initialised ResNet-18 encoder
at ``--model-px`` (or uses ``--model``), then measures, each from a fresh start:

- decode: ``indexer.decode.decode_files`` (read + sha256 + decode + resize) with 0..``--workers`` processes;
- encoder: ``OnnxEncoder.embed`` on already-preprocessed batches of ``--batch-size`` (all cores);
- end to end: ``build_index_dir`` into a new index directory (scan, decode in workers, embed, shards, LMDB,
  FAISS, publish), with its own breakdown (time waiting for decoded images vs time in the encoder).

If the end-to-end rate is close to the encoder rate and ``decode_wait`` is small, decoding is not the
bottleneck; decode images/s per worker tells how many workers a faster encoder (a GPU) would need.

    python bench/index_throughput.py --images 2000 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moco_retrieval.indexer.build import IndexConfig, build_index_dir
from moco_retrieval.indexer.decode import decode_files
from moco_retrieval.indexer.encoder import OnnxEncoder

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # for bench.index_scale
    sys.path.insert(0, str(REPO))

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--image-px", type=int, default=128, help="side of the generated PNGs (default 128)")
    p.add_argument("--model-px", type=int, default=64, help="encoder input size (default 64)")
    p.add_argument("--model", default=None, help="use this encoder.onnx instead of exporting one")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="decode worker counts to try")
    p.add_argument("--device", default="auto")
    p.add_argument("--work-dir", default=None, help="keep data here (default: a temp folder, deleted)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/index_throughput_<host>.json)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="moco-index-bench-"))
    try:
        data = work / "images"
        if not data.exists():
            from moco_retrieval.trainer.demo_data import write_demo_dataset

            write_demo_dataset(data, per_class=args.images // 8, size=args.image_px)
        paths = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.png"))
        from bench.index_scale import make_encoder

        model = Path(args.model) if args.model else make_encoder(work, args.model_px)
        encoder = OnnxEncoder(model, device=args.device)
        result = {
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "provider": encoder.provider},
            "images": len(paths),
            "image_px": args.image_px,
            "model_px": encoder.image_size,
            "arch": encoder.metadata["arch"],
            "batch_size": args.batch_size,
            "decode": [],
            "end_to_end": [],
        }

        for workers in [0] + [w for w in args.workers if w > 0]:
            tic = time.perf_counter()
            decoded = list(decode_files(data, paths, encoder.image_size, encoder.resize, workers))
            seconds = time.perf_counter() - tic
            row = {
                "workers": workers,
                "images_per_s": round(len(paths) / seconds, 1),
                "cpu_ms_per_image": round(1000 * sum(d.seconds for d in decoded) / len(decoded), 3),
            }
            print("decode", json.dumps(row), flush=True)
            result["decode"].append(row)

        pixels = np.stack([d.pixels for d in decoded])
        encoder.embed(pixels[: args.batch_size])  # warm-up
        tic = time.perf_counter()
        for start in range(0, len(pixels), args.batch_size):
            encoder.embed(pixels[start : start + args.batch_size])
        seconds = time.perf_counter() - tic
        result["encoder"] = {"images_per_s": round(len(pixels) / seconds, 1)}
        print("encoder", json.dumps(result["encoder"]), flush=True)

        for workers in args.workers:
            out = work / f"index_w{workers}"
            shutil.rmtree(out, ignore_errors=True)
            tic = time.perf_counter()
            r = build_index_dir(
                IndexConfig(
                    str(data),
                    str(model),
                    str(out),
                    batch_size=args.batch_size,
                    workers=workers,
                    device=args.device,
                    progress=False,
                )
            )
            total = time.perf_counter() - tic
            t = r.timings
            row = {
                "workers": workers,
                "images_per_s_total": round(r.count / total, 1),
                "images_per_s_embed_loop": round(r.embedded / t["embed"], 1),
                "seconds": {k: round(v, 3) for k, v in t.items()},
                "factory": r.factory,
            }
            print("end_to_end", json.dumps(row), flush=True)
            result["end_to_end"].append(row)
        path = Path(args.out) if args.out else OUT / f"index_throughput_{platform.node() or 'host'}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
