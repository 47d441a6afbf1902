"""The training loop, for one CPU process, one GPU, or many under torchrun: :func:`setup`, :func:`run_epoch`
and :func:`train_step`, tied together by :func:`train`.

Order of work: validate everything and scan the folder before writing anything; decode new images into the
image cache; resolve the recipe; build the model and resume from ``checkpoint_last.pt`` when the run directory
has one; then per epoch train, monitor k-NN accuracy, write ``metrics.jsonl``, the plot and an atomic
checkpoint. A ``--time-budget`` run plans its length from the first minute's throughput and stops on time.
"""
from __future__ import annotations

import json
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from moco_retrieval.contracts.atomic import link_or_copy_atomic, write_text_atomic
from moco_retrieval.contracts.errors import ConfigError, DataError, OutputError
from moco_retrieval.contracts.images import no_images_message, walk_image_files
from moco_retrieval.trainer import dist
from moco_retrieval.trainer.batch_augment import TwoViewAugment
from moco_retrieval.trainer.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    LAST,
    load_checkpoint,
    rng_state,
    save_atomic,
    set_rng_state,
)
from moco_retrieval.trainer.config import RESUME_MUST_MATCH, TrainConfig
from moco_retrieval.trainer.data import CachedBatchDataset, epoch_sampler, training_loader
from moco_retrieval.trainer.device import resolve_amp, resolve_device
from moco_retrieval.trainer.image_cache import ImageCache, cache_side
from moco_retrieval.trainer.monitor import KnnMonitor
from moco_retrieval.trainer.plots import plot_metrics
from moco_retrieval.trainer.recipes import (
    MONITOR_EVALUATIONS,
    resolve_before_training,
    resolve_schedule,
)
from moco_retrieval.trainer.schedule import Schedule, TimeBudget
from moco_retrieval.trainer.variants import Variant, variant_for

LOG = logging.getLogger(__name__)

# Short epochs (50 steps of 2 s on a CPU) would spend a large share of the run writing 130 MB checkpoints and
# plots: checkpoint_last.pt is written at epoch ends at most this often (and always at the end, on Ctrl-C, at
# --save-every epochs and every --save-every-steps), the plot likewise.
CHECKPOINT_INTERVAL = 60.0
PLOT_INTERVAL = 30.0

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
    knn_before: float | None = None  # k-NN top-1 at random initialisation (when the monitor ran at step 0)
    stopped_by: str = "epochs"  # epochs, stop-at-epoch, time budget, steps


@dataclass
class Session:
    """Everything a run holds while it trains (built by :func:`setup`)."""

    cfg: TrainConfig
    variant: Variant
    device: torch.device
    run_dir: Path
    paths: list[str]
    model: torch.nn.Module
    ddp_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    augment: TwoViewAugment
    loader: torch.utils.data.DataLoader
    steps_per_epoch: int
    schedule: Schedule
    amp: bool
    skipped: dict[str, str]
    monitor: KnnMonitor | None = None
    budget: TimeBudget | None = None
    epoch: int = 0  # epochs complete
    batch_in_epoch: int = 0  # batches of the next epoch complete
    step: int = 0
    resumed: bool = False
    eval_seconds: float = 0.0  # measured duration of one k-NN evaluation
    save_seconds: float = 1.0  # measured duration of one checkpoint write (a guess until the first)
    last_save: float = field(default_factory=time.perf_counter)
    saved_step: int = 0  # the step checkpoint_last.pt holds (what a Ctrl-C would otherwise lose is after it)
    last_plot: float = 0.0
    generator: torch.Generator = field(default_factory=torch.Generator)

    @property
    def is_main(self) -> bool:
        return dist.rank() == 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _step_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, step, rank): augmentations resume exactly at any step."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + 17) % 2**63


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 10_007 + rank * 101) % 2**63


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write to run directory {run_dir}: {exc.strerror or exc}") from exc


def _merge_saved(cfg: TrainConfig, saved: dict, path: Path) -> TrainConfig:
    """The config of a resumed run: what the user set now, the saved value for everything left unset (the
    recipe's choices are kept, never re-derived); refuses a change to the fields that define the run."""
    values = cfg.to_dict()
    for name, value in saved.items():
        if name in values and (values[name] is None or (name == "stem" and values[name] == "auto")):
            values[name] = value
    values["derived"] = saved.get("derived", {})
    values["run_id"] = saved.get("run_id", "")
    merged = TrainConfig.from_dict(values)
    diffs = [f"{k}={saved.get(k)!r} (now {getattr(merged, k)!r})" for k in RESUME_MUST_MATCH
             if k in saved and saved.get(k) != getattr(merged, k)]
    if diffs:
        raise ConfigError(f"{path} was trained with {', '.join(diffs)}; rerun with the same options or use a new --out")
    return merged


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


# -- setup ---------------------------------------------------------------------------------------------------------
def _scan_and_cache(cfg: TrainConfig, is_main: bool) -> tuple[list, object, dict[str, str]]:
    """The readable images of the folder (in walk order), their cached pixels and the skipped files."""
    found = walk_image_files(cfg.data_dir)
    skipped = {f.path: f.skip_reason for f in found if f.skip_reason}
    usable = [f for f in found if f.skip_reason is None]
    if not usable:
        raise DataError(no_images_message(cfg.data_dir, len(skipped)))
    cached, failed = ImageCache(cfg.data_dir, cache_side(cfg.image_size), cfg.cache_dir).update(
        usable, workers=cfg.workers, progress=is_main)
    skipped.update(failed)
    readable = [f for f in usable if f.path not in failed]
    if not readable:
        raise DataError(no_images_message(cfg.data_dir, len(skipped)))
    return readable, cached, skipped


def setup(cfg: TrainConfig, device: torch.device, resume: str | Path | None = None) -> Session:
    """Validate, scan and cache the data, resolve the recipe, build (or resume) the model, optimizer and loader.

    Raises:
        ConfigError, DataError, OutputError, ArtifactError: before anything is written to the run directory.
    """
    rank, world = dist.rank(), dist.world_size()
    is_main = rank == 0
    run_dir = Path(cfg.out_dir)
    if cfg.batch_size is not None and cfg.batch_size % world:
        raise ConfigError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {world} processes")
    resume_path = Path(resume) if resume else run_dir / LAST
    if resume_path.is_dir():
        resume_path = resume_path / LAST
    ckpt = load_checkpoint(resume_path) if resume or resume_path.exists() else None
    if ckpt is not None:
        cfg = _merge_saved(cfg, ckpt["config"], resume_path)
    files, cached, skipped = _scan_and_cache(cfg, is_main)
    variant = variant_for(cfg)
    cfg = resolve_before_training(cfg, variant, len(files), world, device.type == "cuda")
    if ckpt is None:
        cfg = cfg.replace(run_id=dist.broadcast_object(cfg.run_id or time.strftime("%Y%m%d-%H%M%S-")
                                                       + secrets.token_hex(3)))
    per_process_batch = cfg.batch_size // world
    labels = [f.label for f in files]
    knn_folder = _find_knn_folder(cfg, len(set(labels)) >= 2 and None not in labels)
    monitor = None
    if knn_folder is not None and is_main:
        monitor = KnnMonitor(knn_folder, cfg.image_size, cfg.knn_k, cfg.knn_temperature, cfg.knn_max_images,
                             batch_size=max(64, per_process_batch), cache_root=cfg.cache_dir, workers=cfg.workers)
    if is_main:
        _check_writable(run_dir)
    dist.barrier()

    # ---- model, optimizer, state ---------------------------------------------------------------------------
    seed_everything(cfg.seed)
    layout = variant.memory_format
    bn_splits = variant.bn_splits(cfg.bn_splits, per_process_batch, world)
    model = variant.build_model(cfg, bn_splits).to(device, memory_format=layout)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN time and keep its fastest kernels
    optimizer = variant.build_optimizer(cfg, model)
    session_state = {}
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        session_state = {"epoch": ckpt["epoch"], "step": ckpt["step"], "batch_in_epoch": ckpt.get("batch_in_epoch", 0)}
        set_rng_state(ckpt["rng"])
    if variant.sync_bn(world, device):
        # conversion reuses the Parameter objects: the optimizer stays valid
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.compile:
        model.encoder_q.compile()
        model.encoder_k.compile()
    ddp_model = model
    if world > 1:
        ddp_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    amp, amp_why = resolve_amp(cfg.amp, device)

    labels_index = {name: i for i, name in enumerate(sorted({x for x in labels if x is not None}))}
    dataset = CachedBatchDataset(cached, [labels_index.get(x, -1) for x in labels])
    loader_workers = min(cfg.workers, 2) if device.type == "cuda" else 0  # on a CPU, gathering rows costs < 1 ms
    loader = training_loader(dataset, per_process_batch, loader_workers, rank, world, cfg.seed,
                             device.type == "cuda")
    steps_per_epoch = len(loader)
    augment = TwoViewAugment(variant.views(), cfg.image_size, layout)

    budget = None
    saved_schedule = (ckpt or {}).get("schedule", {})
    if cfg.budget_seconds is not None:
        budget = TimeBudget(cfg.budget_seconds, spent=saved_schedule.get("spent_seconds", 0.0),
                            total_steps=saved_schedule.get("total_steps", 0))
        total = budget.total_steps or _provisional_total(cfg, steps_per_epoch)
        if budget.calibrated:
            cfg = resolve_schedule(cfg, variant, total, steps_per_epoch)
    else:
        cfg = resolve_schedule(cfg, variant, (cfg.epochs or 200) * steps_per_epoch, steps_per_epoch)
        total = cfg.epochs * steps_per_epoch
    s = Session(cfg=cfg, variant=variant, device=device, run_dir=run_dir, paths=[f.path for f in files], model=model,
                ddp_model=ddp_model, optimizer=optimizer, augment=augment, loader=loader,
                steps_per_epoch=steps_per_epoch, schedule=_schedule(cfg, variant, total, steps_per_epoch), amp=amp,
                skipped=skipped, monitor=monitor, budget=budget, resumed=ckpt is not None, **session_state)
    s.generator = torch.Generator(device=device)
    if s.batch_in_epoch >= steps_per_epoch:  # interrupted after the last batch of an epoch: that epoch is done
        s.epoch, s.batch_in_epoch = s.epoch + 1, 0
    if is_main:
        if ckpt is not None:
            LOG.info("resuming %s from epoch %d, batch %d (step %d)", run_dir,
                     s.epoch + 1 if s.batch_in_epoch else s.epoch, s.batch_in_epoch, s.step)
            _truncate_metrics(run_dir / METRICS, s.step)
        write_text_atomic(run_dir / CONFIG, cfg.to_json() + "\n")
        _write_skipped(run_dir / SKIPPED, skipped)
        plan = (f"for {cfg.time_budget} (steps planned after the first minute)" if budget is not None
                and not budget.calibrated else f"for {cfg.epochs} epochs ({s.schedule.total_steps} steps)")
        LOG.info("training %s %s on %d images (%d skipped) %s: %d processes x %d images, %d steps/epoch, device "
                 "%s, bf16 %s (%s), bn splits %d, recipe %s", variant.name, cfg.arch, len(files), len(skipped), plan,
                 world, per_process_batch, steps_per_epoch, device, "on" if amp else "off", amp_why, bn_splits,
                 cfg.recipe)
        for name, item in cfg.derived.items():
            LOG.debug("  %s = %s: %s", name, item["value"], item["why"])
    return s


def _provisional_total(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Before a budgeted run has measured itself: a placeholder length (one step per second of budget)."""
    return max(steps_per_epoch, int(cfg.budget_seconds))


def _schedule(cfg: TrainConfig, variant: Variant, total: int, steps_per_epoch: int) -> Schedule:
    warmup_epochs = cfg.warmup_epochs if cfg.warmup_epochs is not None else 0.0
    momentum = cfg.momentum if cfg.momentum is not None else 0.99
    return Schedule(peak_lr=cfg.effective_lr, warmup_steps=int(warmup_epochs * steps_per_epoch), total_steps=total,
                    m0=momentum, momentum_fn=variant.key_momentum)


# -- one step, one epoch -----------------------------------------------------------------------------------------
def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x1: torch.Tensor, x2: torch.Tensor,
               lr: float, m: float, amp: bool) -> torch.Tensor:
    """One optimizer step on two augmented views ``[N, 3, H, W]`` at learning rate ``lr`` and key momentum
    ``m``; returns the (detached) loss.

    Raises:
        ConfigError: the loss is not finite (the learning rate is too high for this model).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    with torch.autocast(x1.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = model(x1, x2, m)
    if not torch.isfinite(loss):
        raise ConfigError(f"loss became {loss.item()}; lower --lr or train without bf16 (--no-amp)")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _plan_total(s: Session) -> int:
    """The steps of a budgeted run that fit at the measured speed, keeping time for the monitor's evaluations,
    the checkpoints and the final evaluation."""
    saves = s.budget.remaining() / CHECKPOINT_INTERVAL + 2
    evaluations = (MONITOR_EVALUATIONS + 1) if s.monitor is not None else 0
    return s.budget.estimate_total(s.step, evaluations * s.eval_seconds + saves * s.save_seconds)


def _apply_plan(s: Session, total: int) -> None:
    """Fix a budgeted run's length and everything that depends on it."""
    budget = s.budget
    budget.total_steps = total
    s.cfg = resolve_schedule(s.cfg, s.variant, total, s.steps_per_epoch)
    s.schedule = _schedule(s.cfg, s.variant, total, s.steps_per_epoch)
    if s.is_main:
        rate = s.cfg.batch_size / budget.seconds_per_step if budget.seconds_per_step else float("nan")
        LOG.info("time budget %s: measured %.0f images/s, so %d steps (%.1f epochs), %d of them warm-up; %.0f s left",
                 s.cfg.time_budget, rate, total, total / s.steps_per_epoch, s.schedule.warmup_steps,
                 budget.remaining())
        write_text_atomic(s.run_dir / CONFIG, s.cfg.to_json() + "\n")


def _budget_control(s: Session) -> bool:
    """After a step of a budgeted run: plan the run once the calibration is due, and say whether to stop. Rank
    0's clock decides both for every rank (each rank must follow the same schedule and stop at the same step)."""
    plan = _plan_total(s) if s.budget.calibration_due() and s.is_main else None
    stop = s.budget.should_stop(s.step) if s.is_main else False
    plan, stop = dist.broadcast_object((plan, stop))
    if plan is not None:
        _apply_plan(s, plan)
        stop = stop or s.budget.should_stop(s.step)
    return stop


def run_epoch(s: Session, epoch: int, end_step: int) -> dict:
    """Train epoch ``epoch`` from batch ``s.batch_in_epoch`` until its end, ``end_step``, or the time budget.

    Returns:
        ``{"losses": [...], "seen": images, "seconds": s, "stopped": reason or None}``.
    """
    cfg, rank = s.cfg, dist.rank()
    sampler = epoch_sampler(s.loader)
    sampler.set_epoch(epoch)
    first_batch = s.batch_in_epoch
    sampler.skip = first_batch * (cfg.batch_size // dist.world_size())
    # the bar is for terminals (disable=None: off when stderr is not a TTY); logs get one line per epoch
    bar = tqdm(s.loader, desc=f"epoch {epoch + 1}" + (f"/{cfg.epochs}" if cfg.epochs else ""),
               disable=None if s.is_main else True, leave=False, dynamic_ncols=True)
    tic, seen, losses, stopped = time.perf_counter(), 0, [], None
    steps_this_epoch, last = 0, tic
    try:
        for pixels, sizes, _, _ in bar:
            s.generator.manual_seed(_step_seed(cfg.seed, s.step, rank))
            pixels = pixels.to(s.device, non_blocking=True)
            x1, x2 = s.augment(pixels, sizes.to(s.device), s.generator)
            lr, m = s.schedule.lr(s.step), s.schedule.momentum(s.step)
            loss = train_step(s.ddp_model, s.optimizer, x1, x2, lr, m, s.amp)
            losses.append(float(loss))
            s.step += 1
            s.batch_in_epoch += 1
            seen += cfg.batch_size
            steps_this_epoch += 1
            now = time.perf_counter()
            if s.budget is not None:  # the whole step: waiting for the batch, augmenting, training
                s.budget.record_step(steps_this_epoch - 1, now - last)
            last = now
            images_per_s = seen / (time.perf_counter() - tic)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.4f}", img_s=f"{images_per_s:.0f}")
            if s.is_main and s.step % cfg.log_every == 0:
                _append_jsonl(s.run_dir / METRICS, {"kind": "step", "epoch": epoch, "step": s.step, "loss": losses[-1],
                                                    "lr": lr, "momentum": m, "images_per_s": images_per_s,
                                                    "elapsed_s": _elapsed(s)})
            if cfg.save_every_steps and s.step % cfg.save_every_steps == 0 and s.batch_in_epoch < s.steps_per_epoch \
                    and s.is_main:
                save(s)
            if s.step >= end_step:
                stopped = "steps"
                break
            if s.budget is not None and _budget_control(s):
                stopped = "time budget"
                break
    finally:
        bar.close()
    return {"losses": losses, "seen": seen, "seconds": time.perf_counter() - tic, "stopped": stopped}


def _out_of_time(s: Session) -> bool:
    """Before an epoch of a budgeted run: whether the budget is already spent (rank 0's clock decides)."""
    return bool(dist.broadcast_object(s.budget.should_stop(s.step) if s.is_main else False))


def _elapsed(s: Session) -> float | None:
    return round(s.budget.elapsed(), 3) if s.budget is not None else None


def save(s: Session) -> None:
    """Write checkpoint_last.pt: ``s.epoch`` epochs complete plus ``s.batch_in_epoch`` batches of the next."""
    tic = time.perf_counter()
    schedule = {"total_steps": s.schedule.total_steps, "warmup_steps": s.schedule.warmup_steps}
    if s.budget is not None:
        schedule.update(total_steps=s.budget.total_steps, spent_seconds=s.budget.elapsed())
    save_atomic({
        "format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION, "run_id": s.cfg.run_id,
        "config": s.cfg.to_dict(), "model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
        "epoch": s.epoch, "batch_in_epoch": s.batch_in_epoch, "step": s.step, "rng": rng_state(),
        "schedule": schedule, "torch_version": str(torch.__version__),
    }, s.run_dir / LAST)
    s.last_save = time.perf_counter()
    s.save_seconds = s.last_save - tic
    s.saved_step = s.step


def _save_on_interrupt(s: Session) -> None:
    """Ctrl-C, mid-epoch or between epochs: keep the steps done since the last checkpoint (one process only:
    under DDP other ranks may be inside a collective)."""
    if s.is_main and dist.world_size() == 1 and s.step > s.saved_step:
        save(s)
        LOG.warning("interrupted: saved %s at epoch %d, batch %d (step %d)", s.run_dir / LAST, s.epoch + 1,
                    s.batch_in_epoch, s.step)


# -- the run --------------------------------------------------------------------------------------------------------
def _end_step(s: Session, stop_at_epoch: int | None) -> tuple[int, str]:
    if s.budget is not None:
        return 2**62, "time budget"
    if stop_at_epoch is not None and stop_at_epoch < s.cfg.epochs:
        return stop_at_epoch * s.steps_per_epoch, "stop-at-epoch"
    return s.cfg.epochs * s.steps_per_epoch, "epochs"


def run(s: Session, stop_at_epoch: int | None = None) -> TrainResult:
    """Train until the schedule, ``stop_at_epoch`` or the time budget ends; evaluate, log and checkpoint."""
    cfg = s.cfg
    end_step, reason = _end_step(s, stop_at_epoch)
    loss_value, knn_acc, knn_before = None, None, None
    if s.monitor is not None and s.step == 0 and end_step > 0:
        tic = time.perf_counter()
        knn_before = knn_acc = s.monitor.evaluate(s.model.backbone, s.device)
        s.eval_seconds = time.perf_counter() - tic
        LOG.info("k-NN top-1 before training: %.2f%% (%d images from %s)", 100 * knn_acc, len(s.monitor),
                 s.monitor.folder)
        _append_jsonl(s.run_dir / METRICS, {"kind": "epoch", "epoch": 0, "step": 0, "knn_acc": knn_acc,
                                            "elapsed_s": _elapsed(s)})
    stopped = None
    start_step = s.saved_step = s.step
    try:
        while s.step < end_step and stopped is None:
            if s.budget is not None and _out_of_time(s):
                stopped = "time budget"
                break
            epoch = s.epoch
            s.ddp_model.train()
            if s.batch_in_epoch == 0:  # inside an epoch the RNG states came back from the checkpoint
                seed_everything(_epoch_seed(cfg.seed, epoch, dist.rank()))
            stats = run_epoch(s, epoch, end_step)
            stopped = stats["stopped"]
            complete = s.batch_in_epoch >= s.steps_per_epoch
            if complete:
                s.epoch, s.batch_in_epoch = epoch + 1, 0
            tic = time.perf_counter()
            losses = stats["losses"] or [float("nan")]
            loss_value = float(dist.all_reduce_mean(torch.tensor(float(np.mean(losses)))).item())
            for part in dist.gather_objects(dict(s.skipped)):
                s.skipped.update(part)
            finished = stopped is not None or s.step >= end_step
            knn_acc = None
            knn_every = s.cfg.knn_every  # None until a budgeted run has planned its length
            if s.monitor is not None and (finished or (complete and knn_every and s.epoch % knn_every == 0)):
                t_eval = time.perf_counter()
                knn_acc = s.monitor.evaluate(s.model.backbone, s.device)
                s.eval_seconds = time.perf_counter() - t_eval
            if s.is_main:
                row = {"kind": "epoch", "epoch": epoch + 1 if complete else round(epoch + s.batch_in_epoch /
                                                                                  s.steps_per_epoch, 3),
                       "step": s.step, "loss": loss_value, "lr": s.schedule.lr(max(0, s.step - 1)),
                       "epoch_time_s": stats["seconds"], "images_per_s": stats["seen"] / max(1e-9, stats["seconds"]),
                       "knn_acc": knn_acc, "elapsed_s": _elapsed(s)}
                _append_jsonl(s.run_dir / METRICS, row)
                _write_skipped(s.run_dir / SKIPPED, s.skipped)
                knn_text = f", k-NN top-1 {100 * knn_acc:.2f}%" if knn_acc is not None else ""
                LOG.info("epoch %s: loss %.4f, %.0f images/s%s", row["epoch"], loss_value, row["images_per_s"], knn_text)
                keep = complete and (s.epoch % cfg.save_every == 0 or finished)
                if finished or keep or time.perf_counter() - s.last_save >= CHECKPOINT_INTERVAL:
                    save(s)
                if keep:
                    link_or_copy_atomic(s.run_dir / LAST, s.run_dir / f"checkpoint_{s.epoch:04d}.pt")
                if finished or time.perf_counter() - s.last_plot >= PLOT_INTERVAL:
                    plot_metrics(s.run_dir / METRICS, s.run_dir / PLOT)
                    s.last_plot = time.perf_counter()
            dist.barrier()
    except KeyboardInterrupt:
        _save_on_interrupt(s)
        raise
    if s.resumed and s.step == start_step:
        LOG.info("%s already trained (%d steps); nothing to do", s.run_dir, s.step)
    if stopped is None:
        stopped = reason
    elif stopped == "steps":
        stopped = reason
    return TrainResult(s.run_dir, s.epoch, s.step, loss_value, knn_acc, len(s.paths), len(s.skipped), s.model,
                       knn_before, stopped)


def train(cfg: TrainConfig, resume: str | Path | None = None, stop_at_epoch: int | None = None) -> TrainResult:
    """Train MoCo as configured; resume automatically from ``cfg.out_dir/checkpoint_last.pt`` if it exists.

    Args:
        cfg: the run's configuration (options left at None are chosen by ``cfg.recipe``).
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
        return run(setup(cfg, device, resume), stop_at_epoch)
    finally:
        dist.cleanup()
