"""Embedding throughput: images/s of the exported ONNX encoder on ONNX Runtime against the same backbone in
PyTorch eager, on the CPU (JSON out).

Both sides compute the same thing from the same uint8 ``[N, H, W, 3]`` batch: cast, normalize, transpose,
backbone, L2 normalization (PyTorch runs ``trainer.export.EncoderGraph`` eagerly under ``inference_mode``;
ONNX Runtime runs the exported file through ``indexer.encoder.OnnxEncoder``). Decoding and resizing are not
included. Both use the same number of intra-op threads. Each configuration runs ``--warmup`` untimed
batches, then ``--iters`` timed ones.

    python bench/embed_throughput.py --arch resnet18 --image-size 64 --batch-size 1 64 --threads 2
    python bench/embed_throughput.py --checkpoint runs/photos     # a trained run instead of a random init

Without ``--checkpoint`` a randomly initialised model of ``--arch`` is written to a temporary run directory
(throughput does not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from moco_retrieval.indexer.encoder import OnnxEncoder, available_cores
from moco_retrieval.trainer.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, LAST, save_atomic
from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.export import EncoderGraph, export_encoder, load_backbone
from moco_retrieval.trainer.variants import build_model


def random_run(run_dir: Path, moco_version: int, arch: str, image_size: int) -> Path:
    """A run directory holding a randomly initialised checkpoint of ``arch``."""
    cfg = TrainConfig(
        data_dir="-",
        out_dir=str(run_dir),
        moco_version=moco_version,
        arch=arch,
        image_size=image_size,
        batch_size=64,
        queue_size=64 * 16,
        run_id="bench",
    )
    model = build_model(cfg, bn_splits=1)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_atomic(
        {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "run_id": cfg.run_id,
            "config": cfg.to_dict(),
            "model": model.state_dict(),
            "epoch": 0,
            "step": 0,
        },
        run_dir / LAST,
    )
    return run_dir


def _time(fn, batch: np.ndarray, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn(batch)
    tic = time.perf_counter()
    for _ in range(iters):
        fn(batch)
    return time.perf_counter() - tic


def measure(
    run_dir: Path, onnx_path: Path, batch_sizes: list[int], threads: int, warmup: int, iters: int, fp16: bool
) -> list[dict]:
    torch.set_num_threads(threads)
    backbone, cfg, _ = load_backbone(run_dir)
    graph = EncoderGraph(backbone).eval()
    encoder = OnnxEncoder(onnx_path, device="cpu", threads=threads)
    size = cfg.image_size
    rows = []
    for n in batch_sizes:
        batch = np.random.default_rng(0).integers(0, 256, (n, size, size, 3), dtype=np.uint8)

        def torch_eager(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return graph(torch.from_numpy(x)).numpy()

        iters_n = max(2, iters // n) if n > 1 else iters  # similar wall time per configuration
        for runtime, fn in (("pytorch_eager", torch_eager), ("onnxruntime", encoder.embed)):
            seconds = _time(fn, batch, warmup, iters_n)
            row = {
                "runtime": runtime,
                "precision": "fp16" if fp16 and runtime == "onnxruntime" else "fp32",
                "moco_version": cfg.moco_version,
                "arch": cfg.arch,
                "image_size": size,
                "batch_size": n,
                "threads": threads,
                "batches": iters_n,
                "seconds": seconds,
                "images_per_s": n * iters_n / seconds,
            }
            print(json.dumps(row))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="run directory or checkpoint (default: random init)")
    p.add_argument("--moco-version", type=int, default=2)
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--threads", type=int, default=available_cores(), help="intra-op threads for both runtimes")
    p.add_argument("--fp16", action="store_true", help="time a float16 export on ONNX Runtime")
    p.add_argument("--iters", type=int, default=20, help="timed batches at batch size 1 (fewer for larger)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench/results/embed_throughput.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = (
            Path(args.checkpoint)
            if args.checkpoint
            else random_run(Path(tmp) / "run", args.moco_version, args.arch, args.image_size)
        )
        trained = load_backbone(run)[1].image_size  # the ONNX file embeds at the size PyTorch is timed at
        onnx_path = export_encoder(run, Path(tmp) / "encoder.onnx", fp16=args.fp16, image_size=trained).path
        results = measure(run, onnx_path, args.batch_size, args.threads, args.warmup, args.iters, args.fp16)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "embed_throughput",
                "host": platform.node(),
                "cpu_cores": available_cores(),
                "torch": torch.__version__,
                "onnxruntime": ort.__version__,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
