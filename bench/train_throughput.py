"""Training throughput in images/s (JSON out): compute-only next to end-to-end, fp32 and bf16.

- ``compute``: the real optimizer step (:func:`trainer.train.train_step`: forward of both encoders, loss,
  backward, optimizer) on two fixed batches of views already on the device: the ceiling.
- ``phases`` (``--data DIR --phases``): the end-to-end step split into waiting for the batch, the copy to the
  device, the augmentations and the optimizer step, each timed with the device synchronised.
- ``end-to-end`` (``--data DIR``): a real image folder through the real run: the image cache, the loader, the
  batched augmentations on the device and the same step (:func:`trainer.train.setup` and
  :func:`trainer.train.run_epoch`), with the monitor and checkpoints off. The cache is built (or found)
  before the clock starts, as in training.

Each measurement runs ``--warmup`` steps untimed, then ``--steps`` timed steps.

    # the configuration of issue 11: ResNet-18, ImageNet stem, 32 px, batch 128, queue 4096, 2 workers
    python bench/train_throughput.py --data /work/bench-data/fmnist10k --arch resnet18 --stem imagenet \\
        --image-size 32 --batch-size 128 --queue-size 4096 --amp both --out bench/results/train_throughput_e2e_cpu.json
    # GPU: MoCo v2 ResNet-50 at 224 px, bf16, the largest batch (doubling from --batch-size) that fits
    python bench/train_throughput.py --arch resnet50 --image-size 224 --device cuda --amp on --batch-size 256 \\
        --max-batch 4096 --out bench/results/train_throughput_gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine  # noqa: E402
from moco_retrieval.trainer.config import VITS, TrainConfig  # noqa: E402
from moco_retrieval.trainer.data import epoch_sampler  # noqa: E402
from moco_retrieval.trainer.device import cpu_has_native_bf16, resolve_device  # noqa: E402
from moco_retrieval.trainer.small_map_conv import use_plain_convs  # noqa: E402
from moco_retrieval.trainer.recipes import resolve_before_training, resolve_schedule  # noqa: E402
from moco_retrieval.trainer.train import run_epoch, setup, train_step  # noqa: E402
from moco_retrieval.trainer.variants import variant_for  # noqa: E402


def compute_only(cfg: TrainConfig, steps: int, warmup: int, plain_convs: bool = False) -> dict:
    """images/s of :func:`train_step` alone on synthetic views of ``cfg``'s size (``plain_convs``: with every
    convolution a plain ``nn.Conv2d``, as before :mod:`trainer.small_map_conv`)."""
    device = resolve_device(cfg.device)
    torch.manual_seed(0)
    variant = variant_for(cfg)
    # as many images as keep --queue-size uncapped (recipes.fit_queue_to_data caps it at half the images)
    images = max(10_000, 64 * cfg.batch_size, 2 * (cfg.queue_size or 0))
    cfg = resolve_before_training(cfg, variant, images, 1, device.type == "cuda")
    cfg = resolve_schedule(cfg, variant, 1000, 100)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.cuda.reset_peak_memory_stats(device)
    layout = variant.memory_format
    model = variant.build_model(cfg, _bn_splits(cfg)).to(device, memory_format=layout)
    if plain_convs:
        use_plain_convs(model)
    if cfg.compile:
        model.compile_encoders()
    optimizer = variant.build_optimizer(cfg, model)
    x1 = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=device).contiguous(memory_format=layout)
    x2 = torch.randn_like(x1)
    side = cfg.resolved_small_crop_size
    small = (
        torch.randn(cfg.small_crops * cfg.batch_size, 3, side, side, device=device).contiguous(memory_format=layout)
        if cfg.small_crops
        else None
    )
    for _ in range(warmup):
        train_step(model, optimizer, x1, x2, 1e-3, 0.99, bool(cfg.amp), small)
    _sync(device)
    tic = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, x1, x2, 1e-3, 0.99, bool(cfg.amp), small)
    _sync(device)
    elapsed = time.perf_counter() - tic
    return _row("compute, plain convolutions" if plain_convs else "compute", cfg, device, steps, elapsed, optimizer)


def end_to_end(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    """images/s of the real loop (cache -> loader -> batched augmentation -> step) on ``cfg.data_dir``."""
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory() as run_dir:
        t, p = _setup_quiet(cfg, run_dir, device)

        def advance(n: int) -> None:
            target = p.step + n
            while p.step < target:
                run_epoch(t, p, p.epoch, target)
                if p.batch_in_epoch >= t.steps_per_epoch:
                    p.epoch, p.batch_in_epoch = p.epoch + 1, 0

        advance(warmup)
        _sync(device)
        tic = time.perf_counter()
        advance(steps)
        _sync(device)
        elapsed = time.perf_counter() - tic
        row = _row("end-to-end", p.cfg, device, steps, elapsed, t.optimizer)
        row.update(images=len(t.paths), loader_workers=t.loader.num_workers, data_dir=str(cfg.data_dir))
        return row


def phases(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    """Where an end-to-end step's time goes: the same loop as :func:`trainer.train.run_epoch` with the device
    synchronised after each phase (waiting for the loader's batch, the copy to the device, the two augmented
    views, the optimizer step), in ms per step. The synchronisations cost a little overlap, so the phases add up
    to slightly more than an unsynchronised step."""
    device = resolve_device(cfg.device)
    times = {"batch_wait": [], "to_device": [], "augment": [], "step": []}
    with tempfile.TemporaryDirectory() as run_dir:
        t, p = _setup_quiet(cfg, run_dir, device)
        done, last = 0, 0.0
        while done < max(1, warmup) + steps:
            epoch_sampler(t.loader).set_epoch(p.epoch)
            for pixels, sizes, _, _ in t.loader:
                _sync(device)
                t0 = time.perf_counter()
                pixels, sizes = pixels.to(t.device, non_blocking=True), sizes.to(t.device)
                _sync(device)
                t1 = time.perf_counter()
                x1, x2 = t.augment(pixels, sizes, t.generator)
                small = t.augment.small_crops(pixels, sizes, t.generator)
                _sync(device)
                t2 = time.perf_counter()
                train_step(t.ddp_model, t.optimizer, x1, x2, 1e-3, 0.99, t.amp, small)
                _sync(device)
                t3 = time.perf_counter()
                if done >= max(1, warmup):  # the first batch starts the loader's workers: never timed
                    for name, seconds in zip(times, (t0 - last, t1 - t0, t2 - t1, t3 - t2)):
                        times[name].append(seconds)
                last, done = t3, done + 1
                if done >= max(1, warmup) + steps:
                    break
            p.epoch += 1
    ms = {name: 1000 * sum(v) / len(v) for name, v in times.items()}
    row = _row("phases", p.cfg, device, steps, sum(ms.values()) * steps / 1000, t.optimizer)
    row.update({f"{name}_ms": round(v, 2) for name, v in ms.items()}, images=len(t.paths))
    return row


def _setup_quiet(cfg: TrainConfig, run_dir: str, device: torch.device):
    """:func:`trainer.train.setup` of ``cfg`` in ``run_dir`` with the monitor, checkpoints and step log off."""
    return setup(cfg.replace(out_dir=run_dir, knn_every=0, save_every_steps=0, log_every=10**9), device)


def _bn_splits(cfg: TrainConfig) -> int:
    """The split-BN groups of one process training ``cfg``, as :func:`trainer.train.setup` picks them."""
    return variant_for(cfg).bn_splits(cfg.bn_splits, cfg.batch_size, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _row(mode: str, cfg: TrainConfig, device: torch.device, steps: int, elapsed: float, optimizer) -> dict:
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "mode": mode,
        "moco_version": cfg.moco_version,
        "arch": cfg.arch,
        "image_size": cfg.image_size,
        "stem": cfg.resolved_stem if cfg.arch not in VITS else None,
        "batch_size": cfg.batch_size,
        "queue_size": cfg.queue_size,
        "device": str(device),
        "amp": bool(cfg.amp),
        "compile": cfg.compile,
        "optimizer": type(optimizer).__name__,
        "steps": steps,
        "seconds": elapsed,
        "images_per_s": steps * cfg.batch_size / elapsed,
        "peak_gpu_memory_gib": peak,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "bn_splits": _bn_splits(cfg),
    }


def fits(cfg: TrainConfig) -> bool:
    """True when one training step at ``cfg.batch_size`` runs without running out of GPU memory."""
    try:
        compute_only(cfg, steps=1, warmup=0)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def largest_fitting_batch(cfg: TrainConfig, limit: int) -> int | None:
    """The largest ``cfg.batch_size * 2**i <= limit`` whose step fits in memory (None: not even the first)."""
    best, batch = None, cfg.batch_size
    while batch <= limit:
        if not fits(cfg.replace(batch_size=batch, queue_size=batch * 32)):
            break
        print(f"  batch {batch} fits", flush=True)
        best, batch = batch, batch * 2
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="image folder: also measure end to end through the real loader")
    p.add_argument("--moco-version", type=int, nargs="+", default=[2])
    p.add_argument("--arch", nargs="+", default=["resnet18"])
    p.add_argument("--image-size", type=int, nargs="+", default=[32])
    p.add_argument("--stem", default="imagenet")
    p.add_argument("--patch-size", type=int, default=0, help="ViT patch size (0 = auto by image size)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--queue-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bn-splits", type=int, default=0, help="v2: split-BN groups (0 = auto, as moco train)")
    p.add_argument("--small-crops", type=int, default=0, help="v2: multi-crop's small crops per image (0 = none)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=("off", "on", "both"), default="both", help="bf16 autocast")
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--max-batch",
        type=int,
        default=0,
        help="GPU: double --batch-size up to this while a step fits in memory, then measure the largest",
    )
    p.add_argument("--phases", action="store_true", help="with --data: also time each phase of an end-to-end step")
    p.add_argument(
        "--plain-convs",
        action="store_true",
        help="also time the compute step with plain nn.Conv2d layers (no small-map matrix products)",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1, help="alternate the modes this many times (median reported)")
    p.add_argument("--out", default="bench/results/train_throughput.json")
    args = p.parse_args(argv)
    amps = {"off": [False], "on": [True], "both": [False, True]}[args.amp]
    results = []
    for version in args.moco_version:
        for arch in args.arch:
            if version == 2 and arch in VITS:
                print(f"skipping MoCo v2 with {arch}: v2 trains ResNets only")
                continue
            for size in args.image_size:
                for amp in amps:
                    cfg = TrainConfig(
                        data_dir=args.data or "-",
                        out_dir="-",
                        moco_version=version,
                        arch=arch,
                        stem=args.stem,
                        patch_size=args.patch_size,
                        image_size=size,
                        batch_size=args.batch_size,
                        epochs=1000,
                        queue_size=args.queue_size if version == 2 else None,
                        device=args.device,
                        amp=amp,
                        compile=args.compile,
                        workers=args.workers,
                        bn_splits=args.bn_splits,
                        small_crops=args.small_crops if version == 2 else 0,
                        knn_every=0,
                    )
                    if args.max_batch:
                        batch = largest_fitting_batch(cfg, args.max_batch)
                        if batch is None:
                            print(f"skipping v{version} {arch} {size}px: batch {args.batch_size} does not fit")
                            continue
                        cfg = cfg.replace(batch_size=batch, queue_size=batch * 32 if version == 2 else None)
                    runs: dict[str, list[dict]] = {"compute": [], "end-to-end": []}
                    for _ in range(args.repeat):
                        runs["compute"].append(compute_only(cfg, args.steps, args.warmup))
                        if args.plain_convs:
                            plain = compute_only(cfg, args.steps, args.warmup, plain_convs=True)
                            runs.setdefault("compute, plain convolutions", []).append(plain)
                        if args.data:
                            runs["end-to-end"].append(end_to_end(cfg, args.steps, args.warmup))
                        if args.data and args.phases:
                            runs.setdefault("phases", []).append(phases(cfg, args.steps, args.warmup))
                    for mode, rows in runs.items():
                        if not rows:
                            continue
                        rows.sort(key=lambda r: r["images_per_s"])
                        row = dict(rows[len(rows) // 2], all_images_per_s=[round(r["images_per_s"], 1) for r in rows])
                        print(json.dumps(row), flush=True)
                        results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "train_throughput",
                "host": platform.node(),
                "machine": machine(),
                "cpu_threads": torch.get_num_threads(),
                "cpu_native_bf16": cpu_has_native_bf16(),
                "torch": torch.__version__,
                "command": " ".join(sys.argv),
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
