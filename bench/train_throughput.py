"""Training throughput: images/s of full MoCo training steps for a fixed configuration (JSON out).

Measures the model side only (forward of both encoders, loss, backward, optimizer step) on synthetic
normalised images already on the device, so the figure does not depend on disk or JPEG decoding.
Each configuration runs ``--warmup`` steps untimed, then ``--steps`` timed steps.

    python bench/train_throughput.py --arch resnet18 --image-size 32 64 --batch-size 128 --device cpu
    # MoCo v3 at the paper's heads (projector 4096 -> 256, predictor), LARS for ResNet, AdamW for ViT;
    # v2 is skipped for ViTs (it trains ResNets only)
    python bench/train_throughput.py --moco-version 2 3 --arch resnet18 vit_tiny --image-size 32 --device cpu \
        --out bench/results/train_throughput_v3.json
    # GPU: the largest batch (doubling from --batch-size) that fits in bf16, then images/s at that batch
    python bench/train_throughput.py --moco-version 2 --arch resnet50 --image-size 224 --device cuda --amp \
        --batch-size 128 --max-batch 8192 --out bench/results/train_throughput_gpu.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch

from trainer.build import (
    build_model,
    build_optimizer,
    key_momentum_at,
    lr_at,
    memory_format,
)
from trainer.config import VITS, TrainConfig
from trainer.device import resolve_device
from trainer.train import resolve_bn_splits


def measure(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    device = resolve_device(cfg.device)
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as in training: fixed shapes, so cuDNN may pick the fastest kernels
        torch.cuda.reset_peak_memory_stats(device)
    layout = memory_format(cfg)
    model = build_model(cfg, resolve_bn_splits(cfg.bn_splits, cfg.batch_size, 1)).to(device, memory_format=layout)
    amp = bool(cfg.amp) if cfg.amp is not None else device.type == "cuda"
    if cfg.compile:
        model.encoder_q.compile()
        model.encoder_k.compile()
    optimizer = build_optimizer(cfg, model)
    x1 = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=device).contiguous(memory_format=layout)
    x2 = torch.randn_like(x1)

    def step(i: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, i, 1000) * group.get("lr_mult", 1.0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x1, x2, key_momentum_at(cfg, i, 1000))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for i in range(warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    tic = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - tic
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "moco_version": cfg.moco_version, "arch": cfg.arch, "image_size": cfg.image_size,
        "stem": cfg.resolved_stem if cfg.arch not in VITS else None, "batch_size": cfg.batch_size,
        "device": str(device), "amp": amp,
        "compile": cfg.compile, "optimizer": type(optimizer).__name__,
        "patch_size": cfg.resolved_patch_size if cfg.arch in VITS else None,
        "projector": f"{cfg.mlp_hidden or 'D'}->{cfg.dim}", "steps": steps, "seconds": elapsed,
        "images_per_s": steps * cfg.batch_size / elapsed, "peak_gpu_memory_gib": peak,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def fits(cfg: TrainConfig) -> bool:
    """True when one training step at ``cfg.batch_size`` runs without running out of GPU memory."""
    try:
        measure(cfg, steps=1, warmup=0)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def largest_fitting_batch(cfg: TrainConfig, limit: int) -> int | None:
    """The largest ``cfg.batch_size * 2**i <= limit`` whose training step fits in memory (None: not even the first)."""
    best, batch = None, cfg.batch_size
    while batch <= limit:
        if not fits(cfg.replace(batch_size=batch, queue_size=batch * 32)):
            break
        print(f"  batch {batch} fits")
        best, batch = batch, batch * 2
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moco-version", type=int, nargs="+", default=[2])
    p.add_argument("--arch", nargs="+", default=["resnet18"])
    p.add_argument("--image-size", type=int, nargs="+", default=[32, 64])
    p.add_argument("--stem", default="auto")
    p.add_argument("--patch-size", type=int, default=0, help="ViT patch size (0 = auto by image size)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-batch", type=int, default=0,
                   help="GPU: double --batch-size up to this while a step fits in memory, then measure the largest")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench/results/train_throughput.json")
    args = p.parse_args(argv)
    results = []
    for version in args.moco_version:
        for arch in args.arch:
            if version == 2 and arch in VITS:
                print(f"skipping MoCo v2 with {arch}: v2 trains ResNets only")
                continue
            for size in args.image_size:
                cfg = TrainConfig(
                    data_dir="-", out_dir="-", moco_version=version, arch=arch, stem=args.stem, patch_size=args.patch_size, image_size=size,
                    batch_size=args.batch_size, queue_size=args.batch_size * 32, device=args.device,
                    amp=args.amp, compile=args.compile,
                )
                if args.max_batch:
                    batch = largest_fitting_batch(cfg, args.max_batch)
                    if batch is None:
                        print(f"skipping v{version} {arch} {size}px: batch {args.batch_size} does not fit")
                        continue
                    cfg = cfg.replace(batch_size=batch, queue_size=batch * 32)
                row = measure(cfg, args.steps, args.warmup)
                if args.max_batch:  # the batch is the largest that fits unless the next doubling passed the limit
                    row["batch_search"] = {"from": args.batch_size, "limit": args.max_batch,
                                           "stopped_by": "limit" if cfg.batch_size * 2 > args.max_batch else "memory"}
                print(json.dumps(row))
                results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "train_throughput", "host": platform.node(), "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__, "results": results,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
