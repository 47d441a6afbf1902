"""The training loop: one function, :func:`train`, for one CPU process, one GPU, or many under torchrun.

Order of work: validate everything (device, data, batch and queue sizes, the run directory) before writing
anything; build the model, resume from ``checkpoint_last.pt`` when the run directory has one; then per epoch
train, monitor k-NN accuracy, write ``metrics.jsonl``, the plot and an atomic checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from contracts.atomic import link_or_copy_atomic, write_text_atomic
from contracts.errors import ConfigError, DataError, OutputError
from trainer import dist
from trainer.build import (
    build_model,
    build_optimizer,
    build_transform,
    key_momentum_at,
    lr_at,
    memory_format,
)
from trainer.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    LAST,
    load_checkpoint,
    rng_state,
    save_atomic,
    set_rng_state,
)
from trainer.config import RESUME_MUST_MATCH, TrainConfig
from trainer.data import FolderDataset, training_loader
from trainer.device import resolve_device
from trainer.imagefolder import scan_image_folder
from trainer.monitor import KnnMonitor
from trainer.plots import plot_metrics

LOG = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
PLOT = "metrics.png"
CONFIG = "config.json"
SKIPPED = "skipped_files.txt"


@dataclass
class TrainResult:
    run_dir: Path
    epochs_done: int
    steps: int
    loss: float | None
    knn_acc: float | None
    images: int
    skipped: int
    model: torch.nn.Module | None = None  # the trained MoCo model (unwrapped from DDP), on its device


MIN_BN_GROUP = 16


def resolve_bn_splits(requested: int, per_process_batch: int, world_size: int) -> int:
    """Split-BN groups: as requested, or in one process up to 8 groups of at least ``MIN_BN_GROUP`` images
    (1 under DDP, where shuffle-BN across processes does the job)."""
    if requested:
        if per_process_batch % requested:
            raise ConfigError(f"--bn-splits {requested} must divide the per-process batch {per_process_batch}")
        return requested
    if world_size > 1:
        return 1
    # groups of fewer than ~16 images give BN statistics too noisy to learn from (measured: 4 per group stalls)
    return max(g for g in range(1, 9) if per_process_batch % g == 0 and per_process_batch // g >= MIN_BN_GROUP or g == 1)


def fit_queue_to_data(queue_size: int, batch_size: int, num_images: int) -> int:
    """The MoCo v2 queue length to use: ``queue_size``, capped at half the images (a multiple of the batch).

    A queue as long as an epoch holds an older key of every image, so each query would meet its own image as
    a negative and training collapses (seen on small folders: loss climbs to log(K+1), k-NN accuracy falls).
    MoCo's ImageNet setting keeps K at 5% of the images; half is the most that still works.
    """
    limit = num_images // 2 // batch_size * batch_size
    if queue_size <= limit:
        return queue_size
    if limit < batch_size:
        raise DataError(
            f"{num_images} images are too few for MoCo v2 with --batch-size {batch_size}: the queue needs at least "
            f"two batches of other images; add images or lower --batch-size"
        )
    LOG.warning("--queue-size %d is more than half of the %d images; using %d so the queue never holds the "
                "query's own image", queue_size, num_images, limit)
    return limit


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, epoch, rank): resuming at an epoch boundary is exact."""
    return (seed * 1_000_003 + epoch * 10_007 + rank * 101) % 2**63


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write to run directory {run_dir}: {exc.strerror or exc}") from exc


def _check_resume_matches(cfg: TrainConfig, saved: dict, path: Path) -> None:
    diffs = [f"{k}={saved.get(k)!r} (now {getattr(cfg, k)!r})" for k in RESUME_MUST_MATCH if saved.get(k) != getattr(cfg, k)]
    if diffs:
        raise ConfigError(
            f"{path} was trained with {', '.join(diffs)}; rerun with the same options or use a new --out"
        )


def _append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric rows logged after the checkpoint we resume from (they will be logged again)."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
        write_text_atomic(path, "".join(row + "\n" for row in rows))


def _write_skipped(path: Path, skipped: dict[str, str]) -> None:
    write_text_atomic(path, "".join(f"{rel}\t{reason}\n" for rel, reason in sorted(skipped.items())))


def _find_knn_folder(cfg: TrainConfig, labeled_training_data: bool) -> str | None:
    if cfg.knn_every == 0:
        return None
    if cfg.knn_dir:
        return cfg.knn_dir
    return cfg.data_dir if labeled_training_data else None


def train(cfg: TrainConfig, resume: str | Path | None = None, stop_at_epoch: int | None = None) -> TrainResult:
    """Train MoCo as configured; resume automatically from ``cfg.out_dir/checkpoint_last.pt`` if it exists.

    Args:
        cfg: the run's configuration.
        resume: a checkpoint file or run directory to continue from (default: the run directory's own).
        stop_at_epoch: stop after this many epochs (of ``cfg.epochs``); the schedules still span ``cfg.epochs``
            and a later call continues the same run.

    Raises:
        ConfigError, DataError, OutputError, ArtifactError: before anything is written to the run directory.
    """
    info = dist.world_info_from_env()
    device = resolve_device(cfg.device, info.local_rank)
    dist.init(device)
    try:
        return _train(cfg, device, resume, stop_at_epoch)
    finally:
        dist.cleanup()


def _train(cfg: TrainConfig, device: torch.device, resume, stop_at_epoch) -> TrainResult:
    rank, world = dist.rank(), dist.world_size()
    is_main = rank == 0
    run_dir = Path(cfg.out_dir)

    # ---- validate everything before writing anything --------------------------------------------------
    if cfg.batch_size % world:
        raise ConfigError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {world} processes")
    per_process_batch = cfg.batch_size // world
    images = scan_image_folder(cfg.data_dir)
    if len(images) < cfg.batch_size:
        raise DataError(
            f"{cfg.data_dir} has {len(images)} readable images, fewer than one batch ({cfg.batch_size}); "
            f"add images or lower --batch-size"
        )
    # split-BN is v2's stand-in for shuffle-BN; v3 compares in-batch keys from the momentum encoder and needs none
    bn_splits = resolve_bn_splits(cfg.bn_splits, per_process_batch, world) if cfg.moco_version == 2 else 1
    if cfg.moco_version == 2:
        cfg = cfg.replace(queue_size=fit_queue_to_data(cfg.queue_size, cfg.batch_size, len(images)))
    knn_folder = _find_knn_folder(cfg, len(images.classes) >= 2 and None not in images.labels)
    monitor = None
    if knn_folder is not None and is_main:
        monitor = KnnMonitor(knn_folder, cfg.image_size, cfg.knn_k, cfg.knn_temperature, cfg.knn_max_images,
                             batch_size=max(64, per_process_batch), workers=min(cfg.workers, 2))

    resume_path = Path(resume) if resume else run_dir / LAST
    if resume_path.is_dir():
        resume_path = resume_path / LAST
    ckpt = None
    if resume or resume_path.exists():
        ckpt = load_checkpoint(resume_path)
        _check_resume_matches(cfg, ckpt["config"], resume_path)
        cfg = cfg.replace(run_id=ckpt["run_id"])
    else:
        cfg = cfg.replace(run_id=dist.broadcast_object(cfg.run_id or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)))
    if is_main:
        _check_writable(run_dir)
    dist.barrier()

    # ---- model, optimizer, state ---------------------------------------------------------------------
    seed_everything(cfg.seed)
    layout = memory_format(cfg)
    model = build_model(cfg, bn_splits).to(device, memory_format=layout)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN time and keep its fastest kernels
    optimizer = build_optimizer(cfg, model)
    start_epoch, step, start_batch = 0, 0, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, step, start_batch = ckpt["epoch"], ckpt["step"], ckpt.get("batch_in_epoch", 0)
        set_rng_state(ckpt["rng"])
        if is_main:
            LOG.info("resuming %s from epoch %d, batch %d (step %d)", run_dir, start_epoch + 1 if start_batch else start_epoch,
                     start_batch, step)
            _truncate_metrics(run_dir / METRICS, step)
    if world > 1 and cfg.moco_version == 3 and device.type == "cuda":
        # v3 normalises over the global batch (SyncBN, as in the paper); torch's SyncBN has no CPU kernel, so
        # gloo/CPU runs keep per-process BN. Conversion reuses the Parameter objects: the optimizer stays valid.
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.compile:
        model.encoder_q.compile()
        model.encoder_k.compile()
    ddp_model = model
    if world > 1:
        ddp_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    amp = cfg.amp if cfg.amp is not None else device.type == "cuda"

    dataset = FolderDataset(images, build_transform(cfg))
    loader = training_loader(dataset, per_process_batch, cfg.workers, rank, world, cfg.seed, device.type == "cuda")
    steps_per_epoch = len(loader)
    if start_batch >= steps_per_epoch:  # interrupted after the last batch of an epoch: that epoch is done
        start_epoch, start_batch = start_epoch + 1, 0
    skipped = {rel: reason for rel, reason in images.skipped}
    if is_main:
        write_text_atomic(run_dir / CONFIG, cfg.to_json() + "\n")
        _write_skipped(run_dir / SKIPPED, skipped)
        LOG.info(
            "training MoCo v%d %s on %d images (%d skipped) for %d epochs: %d processes x %d images, %d steps/epoch, "
            "device %s, amp %s, bn splits %d", cfg.moco_version, cfg.arch, len(images), len(skipped), cfg.epochs,
            world, per_process_batch, steps_per_epoch, device, amp, bn_splits,
        )

    end_epoch = min(cfg.epochs, stop_at_epoch) if stop_at_epoch is not None else cfg.epochs
    loss_value, knn_acc = None, None
    if monitor is not None and start_epoch == 0 and end_epoch > 0:
        knn_acc = monitor.evaluate(model.backbone, device)
        LOG.info("k-NN top-1 before training: %.2f%% (%d images from %s)", 100 * knn_acc, len(monitor), monitor.folder)
        _append_jsonl(run_dir / METRICS, {"kind": "epoch", "epoch": 0, "step": 0, "knn_acc": knn_acc})
    for epoch in range(start_epoch, end_epoch):
        ddp_model.train()
        seed = _epoch_seed(cfg.seed, epoch, rank)
        seed_everything(seed)
        loader.sampler.set_epoch(epoch)
        first_batch = start_batch if epoch == start_epoch else 0  # resuming inside an epoch: same order, rest of it
        loader.sampler.skip = first_batch * per_process_batch
        # the bar is for terminals (disable=None: off when stderr is not a TTY); logs get one line per epoch
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=None if is_main else True, leave=False,
                   dynamic_ncols=True)
        tic, seen, losses = time.perf_counter(), 0, []
        done = first_batch  # batches of this epoch whose optimizer step is complete
        try:
            for batch_index, ((x1, x2), _, index, ok) in enumerate(bar, start=first_batch):
                if not ok.all():
                    for i in index[~ok].tolist():
                        skipped.setdefault(images.paths[i], "could not be decoded during training")
                lr = lr_at(cfg, step, steps_per_epoch)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_mult", 1.0)
                m = key_momentum_at(cfg, step, steps_per_epoch)
                x1 = x1.to(device, non_blocking=True, memory_format=layout)
                x2 = x2.to(device, non_blocking=True, memory_format=layout)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    loss = ddp_model(x1, x2, m)
                if not torch.isfinite(loss):
                    raise ConfigError(f"loss became {loss.item()} at step {step}; lower --lr or disable --amp")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                done = batch_index + 1
                seen += cfg.batch_size
                losses.append(loss.item())
                images_per_s = seen / (time.perf_counter() - tic)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.4f}", img_s=f"{images_per_s:.0f}")
                if is_main and step % cfg.log_every == 0:
                    _append_jsonl(run_dir / METRICS, {"kind": "step", "epoch": epoch, "step": step, "loss": losses[-1],
                                                      "lr": lr, "momentum": m, "images_per_s": images_per_s})
                if cfg.save_every_steps and step % cfg.save_every_steps == 0 and done < steps_per_epoch and is_main:
                    _save(run_dir, cfg, model, optimizer, epoch, step, batch_in_epoch=done)
        except KeyboardInterrupt:
            if is_main and world == 1 and done > first_batch:  # under DDP other ranks may be inside a collective
                _save(run_dir, cfg, model, optimizer, epoch, step, batch_in_epoch=done)
                LOG.warning("interrupted: saved %s at epoch %d, batch %d (step %d)", run_dir / LAST, epoch + 1,
                            done, step)
            raise
        bar.close()
        loss_value = float(dist.all_reduce_mean(torch.tensor(float(np.mean(losses)))).item())
        epoch_time = time.perf_counter() - tic
        new_skips = dist.gather_objects({k: v for k, v in skipped.items()})
        for part in new_skips:
            skipped.update(part)
        knn_acc = None
        if monitor is not None and ((epoch + 1) % cfg.knn_every == 0 or epoch + 1 == end_epoch):
            knn_acc = monitor.evaluate(model.backbone, device)
        if is_main:
            row = {"kind": "epoch", "epoch": epoch + 1, "step": step, "loss": loss_value, "lr": lr,
                   "epoch_time_s": epoch_time, "images_per_s": seen / epoch_time, "knn_acc": knn_acc}
            _append_jsonl(run_dir / METRICS, row)
            _write_skipped(run_dir / SKIPPED, skipped)
            knn_text = f", k-NN top-1 {100 * knn_acc:.2f}%" if knn_acc is not None else ""
            LOG.info("epoch %d/%d: loss %.4f, %.0f images/s%s", epoch + 1, cfg.epochs, loss_value, seen / epoch_time, knn_text)
            _save(run_dir, cfg, model, optimizer, epoch + 1, step)
            if (epoch + 1) % cfg.save_every == 0 or epoch + 1 == cfg.epochs:
                link_or_copy_atomic(run_dir / LAST, run_dir / f"checkpoint_{epoch + 1:04d}.pt")
            plot_metrics(run_dir / METRICS, run_dir / PLOT)
        dist.barrier()
    if ckpt is not None and end_epoch <= start_epoch:
        LOG.info("%s already trained for %d of %d epochs; nothing to do", run_dir, start_epoch, cfg.epochs)
    return TrainResult(run_dir, max(start_epoch, end_epoch), step, loss_value, knn_acc, len(images), len(skipped), model)


def _save(run_dir: Path, cfg: TrainConfig, model, optimizer, epoch: int, step: int, batch_in_epoch: int = 0) -> None:
    """Write checkpoint_last.pt: ``epoch`` epochs complete plus ``batch_in_epoch`` batches of the next one."""
    save_atomic({
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "run_id": cfg.run_id,
        "config": cfg.to_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "step": step,
        "rng": rng_state(),
        "torch_version": torch.__version__,
    }, run_dir / LAST)
