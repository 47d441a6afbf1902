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
import math
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from moco_retrieval.contracts.atomic import check_writable, link_or_copy_atomic, output_errors, write_text_atomic
from moco_retrieval.contracts.errors import ConfigError, DataError
from moco_retrieval.contracts.images import no_images_message, walk_image_files
from moco_retrieval.trainer import dist
from moco_retrieval.trainer.batch_augment import TwoViewAugment, adapted_views, small_crops_of
from moco_retrieval.trainer.checkpoint import (
    LAST,
    checkpoint_dict,
    load_checkpoint,
    rng_state,
    save_atomic,
    set_rng_state,
)
from moco_retrieval.trainer.config import RESUME_MUST_MATCH, TrainConfig, left_to_recipe
from moco_retrieval.trainer.data import CachedBatchDataset, epoch_sampler, training_loader
from moco_retrieval.trainer.device import check_cpu_bf16_shapes, resolve_amp, resolve_device
from moco_retrieval.trainer.image_cache import ImageCache, cache_side
from moco_retrieval.trainer.image_survey import survey_images
from moco_retrieval.trainer.monitor import KnnMonitor
from moco_retrieval.trainer.plots import plot_metrics
from moco_retrieval.trainer.pretrained import Pretrained, configure, load_into_model, read_pretrained
from moco_retrieval.trainer.recipes import (
    MONITOR_EVALUATIONS,
    check_batch_divides,
    resolve_before_training,
    resolve_model_and_size,
    resolve_schedule,
    set_derived,
)
from moco_retrieval.trainer.run_dir import RunDirLock
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
    init: str | None = None  # the --init weights the run started from (knn_before is theirs, not random init)
    knn_whitened: float | None = None  # the last k-NN top-1 with the features PCA-whitened, as `moco export` does
    steps_per_epoch: int = 0  # optimizer steps in one pass over the images

    @property
    def epochs_trained(self) -> float:
        """Passes over the images, fractions included (``epochs_done`` counts only the complete ones)."""
        return self.steps / self.steps_per_epoch if self.steps_per_epoch else float(self.epochs_done)


@dataclass(frozen=True)
class Trainee:
    """What is fixed for the whole run (built by :func:`setup`): the variant, the model and its optimizer, and
    how batches reach it."""

    variant: Variant
    device: torch.device
    run_dir: Path
    paths: list[str]  # the images trained on, in walk order
    model: torch.nn.Module
    ddp_model: torch.nn.Module  # ``model``, wrapped in DDP under torchrun
    optimizer: torch.optim.Optimizer
    augment: TwoViewAugment
    loader: torch.utils.data.DataLoader
    steps_per_epoch: int
    amp: bool
    monitor: KnnMonitor | None
    generator: torch.Generator  # the augmentations' random numbers, seeded per step

    @property
    def is_main(self) -> bool:
        return dist.rank() == 0


@dataclass
class Progress:
    """What moves while the run trains: its position, its plan and its clocks.

    ``cfg`` is the resolved configuration; a ``--time-budget`` run replaces it (and ``schedule``) once, when it
    has measured its speed and plans its length (:func:`_apply_plan`)."""

    cfg: TrainConfig
    schedule: Schedule
    budget: TimeBudget | None
    skipped: dict[str, str]  # relative path -> reason, of the files not trained on
    resumed: bool = False
    epoch: int = 0  # epochs complete
    batch_in_epoch: int = 0  # batches of the next epoch complete
    step: int = 0
    saved_step: int = 0  # the step checkpoint_last.pt holds (what a Ctrl-C would otherwise lose is after it)
    eval_seconds: float = 0.0  # measured duration of one k-NN evaluation
    save_seconds: float = 1.0  # measured duration of one checkpoint write (a guess until the first)
    last_save: float = field(default_factory=time.perf_counter)
    last_plot: float = 0.0


def position_text(p: Progress, steps_per_epoch: int) -> str:
    """Where a run stands, as the interrupt and the resume both say it: ``step 30 (epoch 6, 0 of 6 batches
    done)``; the epoch counts from 1, and a finished epoch reads as the next one with no batch done."""
    epoch, batch = p.epoch, p.batch_in_epoch
    if batch >= steps_per_epoch:
        epoch, batch = epoch + 1, 0
    return f"step {p.step} (epoch {epoch + 1}, {batch} of {steps_per_epoch} batches done)"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _step_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, step, rank): augmentations resume exactly at any step."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + 17) % 2**63


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 10_007 + rank * 101) % 2**63


def _merge_saved(cfg: TrainConfig, saved: dict, path: Path) -> TrainConfig:
    """The config of a resumed run: what the user set now, the saved value for everything left unset (the
    recipe's choices are kept, never re-derived); refuses a change to the fields that define the run.

    An option the user set and the recipe then changed (a --queue-size capped at half the images) counts as
    unchanged while the rerun asks for the same value again (the derived entry's ``requested``)."""
    values = cfg.to_dict()
    derived = saved.get("derived", {})
    for name, value in saved.items():
        if name not in values:
            continue
        asked_again = "requested" in derived.get(name, {}) and values[name] == derived[name]["requested"]
        if left_to_recipe(name, values[name]) or asked_again:
            values[name] = value
    values["derived"] = derived
    values["run_id"] = saved.get("run_id", "")
    merged = TrainConfig.from_dict(values)
    diffs = _must_match_diffs(merged, saved)
    if diffs:
        raise ConfigError(_mismatch_message(path, diffs, own_run=path.parent == Path(cfg.out_dir)))
    return merged


# what --init cannot change: the weights it loads decide these (the rest of RESUME_MUST_MATCH a new run may set)
_SHAPE_FIELDS = ("moco_version", "arch", "stem", "patch_size", "image_size", "dim", "mlp_hidden")


def _must_match_diffs(cfg: TrainConfig, saved: dict) -> dict[str, str]:
    """Field -> ``"field=saved (now value)"`` of each :data:`RESUME_MUST_MATCH` field the rerun changed."""
    return {
        k: f"{k}={saved.get(k)!r} (now {getattr(cfg, k)!r})"
        for k in RESUME_MUST_MATCH
        if k in saved and saved.get(k) != getattr(cfg, k)
    }


def _mismatch_message(path: Path, diffs: dict[str, str], own_run: bool) -> str:
    """The one line of a resume that changed what defines the run: how to resume it, and, where only its
    training changed (a longer --time-budget, another seed or queue), how to train on from its weights."""
    text = f"{path} was trained with {', '.join(diffs.values())}; "
    text += "rerun with the same options to resume it" if own_run else "resume it with the options it was trained with"
    if not set(diffs) & set(_SHAPE_FIELDS):
        return text + f", or train on from its weights in a new run: --init {path.parent} --out NEW_DIR"
    return text + (", or use a new --out" if own_run else "")


def _append_jsonl(path: Path, row: dict) -> None:
    with output_errors(path, "free some space or choose another --out"), open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric rows logged after the checkpoint we resume from (they will be logged again), and a line
    that a killed run left half-written (it failed every rerun with a JSONDecodeError)."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if _step_of(line) <= last_step]
        write_text_atomic(path, "".join(row + "\n" for row in rows))


def _step_of(line: str) -> float:
    """The ``step`` of a ``metrics.jsonl`` line; infinity (dropped) for a blank, torn or foreign one."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, TypeError, KeyError):
        return math.inf


def _write_skipped(path: Path, skipped: dict[str, str]) -> None:
    write_text_atomic(path, "".join(f"{rel}\t{reason}\n" for rel, reason in sorted(skipped.items())))


def _find_knn_folder(cfg: TrainConfig, labeled_training_data: bool) -> str | None:
    if cfg.knn_every == 0:
        return None
    if cfg.knn_dir:
        return cfg.knn_dir
    return cfg.data_dir if labeled_training_data else None


# -- setup ---------------------------------------------------------------------------------------------------------
def _scan(cfg: TrainConfig) -> tuple[list, dict[str, str]]:
    """The image files of the folder that can be opened (in walk order), and the skipped files."""
    found = walk_image_files(cfg.data_dir)
    skipped = {f.path: f.skip_reason for f in found if f.skip_reason}
    usable = [f for f in found if f.skip_reason is None]
    if not usable:
        raise DataError(no_images_message(cfg.data_dir, len(skipped)))
    return usable, skipped


def _fit_model_and_size(cfg: TrainConfig, usable: list, world: int, on_gpu: bool) -> TrainConfig:
    """``cfg`` with ``--arch`` and ``--image-size`` resolved when left at auto (the images' sizes surveyed
    first, for the size); a resumed run has both from its checkpoint."""
    if cfg.arch != "auto" and cfg.image_size is not None:
        return cfg
    survey = survey_images(cfg.data_dir, usable) if cfg.image_size is None else None
    if survey is not None:
        cfg = cfg.replace(extra={**cfg.extra, "image_survey": survey.to_dict()})
    return resolve_model_and_size(cfg, survey, len(usable), world, on_gpu)


def _cache(
    cfg: TrainConfig, usable: list, skipped: dict[str, str], is_main: bool
) -> tuple[list, object, dict[str, str]]:
    """The readable images of ``usable`` (in walk order), their cached pixels and the skipped files."""
    cached, failed = ImageCache(cfg.data_dir, cache_side(cfg.image_size), cfg.cache_dir).update(
        usable, workers=cfg.workers, progress=is_main, whole_folder=True
    )
    skipped.update(failed)
    readable = [f for f in usable if f.path not in failed]
    if not readable:
        raise DataError(no_images_message(cfg.data_dir, len(skipped)))
    return readable, cached, skipped


def _resume(cfg: TrainConfig, resume: str | Path | None) -> tuple[TrainConfig, dict | None, Path]:
    """``(cfg, checkpoint or None, its path)``: the run directory's (or ``resume``'s) checkpoint, and the
    config merged with the one it was trained with (see :func:`_merge_saved`)."""
    resume_path = Path(resume) if resume else Path(cfg.out_dir) / LAST
    if resume_path.is_dir():
        resume_path = resume_path / LAST
    ckpt = load_checkpoint(resume_path) if resume or resume_path.exists() else None
    if ckpt is not None:
        cfg = _merge_saved(cfg, ckpt["config"], resume_path)
    return cfg, ckpt, resume_path


def _build_model(
    cfg: TrainConfig, variant: Variant, device: torch.device, ckpt: dict | None, init: Pretrained | None = None
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, int, dict]:
    """``(model, ddp_model, optimizer, bn_splits, init report)``, with the checkpoint's weights and optimizer
    state, or (a new run with ``--init``) the source's weights (the report says what was loaded)."""
    world = dist.world_size()
    seed_everything(cfg.seed)
    bn_splits = variant.bn_splits(cfg.bn_splits, cfg.batch_size // world, world)
    model = variant.build_model(cfg, bn_splits)
    report = {}
    if init is not None and ckpt is None:
        report = load_into_model(init, model, cfg.image_size)
    model = model.to(device, memory_format=variant.memory_format)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN time and keep its fastest kernels
    optimizer = variant.build_optimizer(cfg, model)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
    if variant.sync_bn(world, device):
        # conversion reuses the Parameter objects: the optimizer stays valid
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.compile:
        model.compile_encoders()
    ddp_model = model
    if world > 1:
        ddp_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    return model, ddp_model, optimizer, bn_splits, report


def _build_loader(
    cfg: TrainConfig, variant: Variant, device: torch.device, cached, labels: list
) -> tuple[torch.utils.data.DataLoader, TwoViewAugment]:
    """The loader of cached rows (this process's share of each batch) and the two-view augmentation."""
    rank, world = dist.rank(), dist.world_size()
    labels_index = {name: i for i, name in enumerate(sorted({x for x in labels if x is not None}))}
    dataset = CachedBatchDataset(cached, [labels_index.get(x, -1) for x in labels])
    loader_workers = min(cfg.workers, 2) if device.type == "cuda" else 0  # on a CPU, gathering rows costs < 1 ms
    loader = training_loader(
        dataset, cfg.batch_size // world, loader_workers, rank, world, cfg.seed, device.type == "cuda"
    )
    views = adapted_views(variant.views(), cfg.crop_min_scale, cfg.blur)
    small = small_crops_of(views[0], cfg.small_crops, cfg.resolved_small_crop_size)
    return loader, TwoViewAugment(views, cfg.image_size, variant.memory_format, small)


def _plan(
    cfg: TrainConfig, variant: Variant, ckpt: dict | None, steps_per_epoch: int
) -> tuple[TrainConfig, Schedule, TimeBudget | None]:
    """``(cfg, schedule, budget)``: the run's length and everything that depends on it. A budgeted run keeps a
    provisional length until it has timed itself, unless its checkpoint already holds the plan."""
    saved = (ckpt or {}).get("schedule", {})
    if cfg.budget_seconds is None:
        cfg = resolve_schedule(cfg, variant, (cfg.epochs or 200) * steps_per_epoch, steps_per_epoch)
        return cfg, _schedule(cfg, variant, cfg.epochs * steps_per_epoch, steps_per_epoch), None
    budget = TimeBudget.resumed(cfg.budget_seconds, saved)
    total = budget.total_steps or _provisional_total(cfg, steps_per_epoch)
    if budget.calibrated:
        cfg = resolve_schedule(cfg, variant, total, steps_per_epoch)
    return cfg, _schedule(cfg, variant, total, steps_per_epoch), budget


def setup(
    cfg: TrainConfig, device: torch.device, resume: str | Path | None = None, lock: RunDirLock | None = None
) -> tuple[Trainee, Progress]:
    """Validate, scan and cache the data, resolve the recipe, build (or resume) the model, optimizer and loader,
    and plan the run: ``(what is fixed for the run, where it stands)``. ``lock`` (held by :func:`train`) is
    taken once the run directory exists, before anything is written there.

    Raises:
        ConfigError, DataError, OutputError, ArtifactError: before anything is written to the run directory.
    """
    world, is_main = dist.world_size(), dist.rank() == 0
    run_dir = Path(cfg.out_dir)
    if cfg.batch_size is not None:  # before the scan: a batch the user set fails at once
        check_batch_divides(cfg.batch_size, world)
    cfg, ckpt, resume_path = _resume(cfg, resume)
    init = None
    if ckpt is None and cfg.init:  # a resumed run has its weights; the file was read when it started
        init = read_pretrained(cfg.init)
        cfg = configure(cfg, init)
    usable, skipped = _scan(cfg)
    cfg = _fit_model_and_size(cfg, usable, world, device.type == "cuda")
    files, cached, skipped = _cache(cfg, usable, skipped, is_main)
    variant = variant_for(cfg)
    cfg = resolve_before_training(cfg, variant, len(files), world, device.type == "cuda")
    if ckpt is not None and _must_match_diffs(cfg, ckpt["config"]):
        # the options matched (_merge_saved), so the folder changed: fewer images cap the queue below the
        # checkpoint's, which its model cannot load
        raise DataError(
            f"{resume_path} was trained with {', '.join(_must_match_diffs(cfg, ckpt['config']).values())}, "
            f"which the {len(files)} readable images now in {cfg.data_dir} no longer allow; restore "
            "the images or use a new --out"
        )
    if ckpt is None:
        cfg = cfg.replace(
            run_id=dist.broadcast_object(cfg.run_id or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3))
        )
    per_process_batch = cfg.batch_size // world
    labels = [f.label for f in files]
    knn_folder = _find_knn_folder(cfg, len(set(labels)) >= 2 and None not in labels)
    monitor = None
    if knn_folder is not None and is_main:
        monitor = KnnMonitor(
            knn_folder,
            cfg.image_size,
            cfg.knn_k,
            cfg.knn_temperature,
            cfg.knn_max_images,
            batch_size=max(64, per_process_batch),
            cache_root=cfg.cache_dir,
            workers=cfg.workers,
        )
    amp, amp_why = resolve_amp(cfg.amp, device)
    if amp and device.type == "cpu":  # on a throwaway network, so that a refusal leaves no run directory
        sizes = [cfg.image_size] + ([cfg.resolved_small_crop_size] if cfg.small_crops else [])
        check_cpu_bf16_shapes(variant.build_model(cfg).backbone, sizes, cfg.arch)
    if is_main:
        check_writable(run_dir, "run directory", "choose a writable --out")
        if lock is not None:
            lock.acquire()
    dist.barrier()

    model, ddp_model, optimizer, bn_splits, init_report = _build_model(cfg, variant, device, ckpt, init)
    if init_report:
        cfg = cfg.replace(init_report=init_report)
    loader, augment = _build_loader(cfg, variant, device, cached, labels)
    steps_per_epoch = len(loader)
    cfg, schedule, budget = _plan(cfg, variant, ckpt, steps_per_epoch)
    trainee = Trainee(
        variant=variant,
        device=device,
        run_dir=run_dir,
        paths=[f.path for f in files],
        model=model,
        ddp_model=ddp_model,
        optimizer=optimizer,
        augment=augment,
        loader=loader,
        steps_per_epoch=steps_per_epoch,
        amp=amp,
        monitor=monitor,
        generator=torch.Generator(device=device),
    )
    progress = Progress(cfg=cfg, schedule=schedule, budget=budget, skipped=skipped, resumed=ckpt is not None)
    if ckpt is not None:
        progress.epoch, progress.step = ckpt["epoch"], ckpt["step"]
        progress.batch_in_epoch = ckpt.get("batch_in_epoch", 0)
    if progress.batch_in_epoch >= steps_per_epoch:  # interrupted after the last batch of an epoch: it is done
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
    if is_main:
        if ckpt is not None:
            LOG.info("resuming %s at %s", run_dir, position_text(progress, steps_per_epoch))
            _truncate_metrics(run_dir / METRICS, progress.step)
        else:  # a run killed before its first checkpoint left rows: this one logs them again
            _truncate_metrics(run_dir / METRICS, -1)
        write_text_atomic(run_dir / CONFIG, cfg.to_json() + "\n")
        _write_skipped(run_dir / SKIPPED, skipped)
        plan = (
            f"for {cfg.time_budget} (steps planned after the first minute)"
            if budget is not None and not budget.calibrated
            else f"for {cfg.epochs} epochs ({schedule.total_steps} steps)"
        )
        LOG.info(
            "training %s %s on %d images (%d skipped) %s: %d processes x %d images, %d steps/epoch, device "
            "%s, bf16 %s (%s), bn splits %d, recipe %s",
            variant.name,
            cfg.arch,
            len(files),
            len(skipped),
            plan,
            world,
            per_process_batch,
            steps_per_epoch,
            device,
            "on" if amp else "off",
            amp_why,
            bn_splits,
            cfg.recipe,
        )
        for name, item in cfg.derived.items():
            LOG.debug("  %s = %s: %s", name, item["value"], item["why"])
    return trainee, progress


def _provisional_total(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Before a budgeted run has measured itself: a placeholder length (one step per second of budget)."""
    return max(steps_per_epoch, int(cfg.budget_seconds))


def _schedule(cfg: TrainConfig, variant: Variant, total: int, steps_per_epoch: int) -> Schedule:
    warmup_epochs = cfg.warmup_epochs if cfg.warmup_epochs is not None else 0.0
    momentum = cfg.momentum if cfg.momentum is not None else 0.99
    return Schedule(
        peak_lr=cfg.effective_lr,
        warmup_steps=int(warmup_epochs * steps_per_epoch),
        total_steps=total,
        m0=momentum,
        momentum_fn=variant.key_momentum,
    )


# -- one step, one epoch -----------------------------------------------------------------------------------------
def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x1: torch.Tensor,
    x2: torch.Tensor,
    lr: float,
    m: float,
    amp: bool,
    small: torch.Tensor | None = None,
) -> torch.Tensor:
    """One optimizer step on two augmented views ``[N, 3, H, W]`` (and multi-crop's ``small`` crops,
    ``[S*N, 3, h, w]``) at learning rate ``lr`` and key momentum ``m``; returns the (detached) loss.

    Raises:
        ConfigError: the loss is not finite (the learning rate is too high for this model).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(x1.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = model(x1, x2, m, small)
    if not torch.isfinite(loss):
        raise ConfigError(f"loss became {loss.item()}; lower --lr or train without bf16 (--no-amp)")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _plan_total(t: Trainee, p: Progress) -> int:
    """The steps of a budgeted run that fit at the measured speed, keeping time for the monitor's evaluations,
    the checkpoints and the final evaluation.

    The evaluations reserved are those the plan still holds: about ``MONITOR_EVALUATIONS`` at epoch ends plus the
    final one, but only as many epochs as fit (a 60,000-image run of a few epochs evaluates a few times; keeping
    time for 11 left 60% of a 4-minute budget unused), less those already done when the run is re-planned."""
    saves = p.budget.remaining() / CHECKPOINT_INTERVAL + 2
    if t.monitor is None:
        return p.budget.estimate_total(p.step, saves * p.save_seconds)
    done = p.step // t.steps_per_epoch  # epochs complete
    evaluations = MONITOR_EVALUATIONS + 1
    for _ in range(4):  # fewer evaluations leave room for more steps, which may hold more epochs: settle it
        total = p.budget.estimate_total(p.step, evaluations * p.eval_seconds + saves * p.save_seconds)
        epochs = max(1, math.ceil(total / t.steps_per_epoch))
        every = p.cfg.knn_every or max(1, math.ceil(epochs / MONITOR_EVALUATIONS))
        needed = max(0, min(MONITOR_EVALUATIONS, epochs // every) - done // every) + 1  # epoch ends, the final one
        if needed == evaluations:
            break
        evaluations = needed
    return total


def _apply_plan(t: Trainee, p: Progress, total: int) -> None:
    """Fix a budgeted run's length and everything that depends on it: once after the first minute, and again
    at each of :data:`~trainer.schedule.REPLAN_FRACTIONS` of the budget, where only the length (the cosine's end,
    the epochs) changes; the warm-up, the key momentum and the monitor's interval stay as first planned."""
    budget = p.budget
    replan, before = budget.calibrated, budget.total_steps
    rate = p.cfg.batch_size / budget.seconds_per_step if budget.seconds_per_step else float("nan")  # what planned it
    budget.planned(total)
    at = " and ".join(f"{100 * f:g}%" for f in budget.replanned_at)
    p.cfg = resolve_schedule(p.cfg, t.variant, total, t.steps_per_epoch)
    if replan and "epochs" in p.cfg.derived:
        why = p.cfg.derived["epochs"]["why"] + f" (re-planned at {at} of it, last from {before})"
        p.cfg = set_derived(p.cfg, "epochs", p.cfg.epochs, why)
    p.schedule = _schedule(p.cfg, t.variant, total, t.steps_per_epoch)
    if t.is_main:
        LOG.info(
            "time budget %s%s: measured %.0f images/s, so %d steps (%.1f epochs), %d of them warm-up; %.0f s left",
            p.cfg.time_budget,
            f" re-planned at {100 * budget.replanned_at[-1]:g}% (was {before} steps)" if replan else "",
            rate,
            total,
            total / t.steps_per_epoch,
            p.schedule.warmup_steps,
            budget.remaining(),
        )
        write_text_atomic(t.run_dir / CONFIG, p.cfg.to_json() + "\n")


def _budget_control(t: Trainee, p: Progress) -> bool:
    """After a step of a budgeted run: plan the run once the calibration is due, and say whether to stop. Rank
    0's clock decides both for every rank (each rank must follow the same schedule and stop at the same step)."""
    due = p.budget.calibration_due() or p.budget.replan_due()
    plan = _plan_total(t, p) if due and t.is_main else None
    stop = p.budget.should_stop(p.step) if t.is_main else False
    plan, stop = dist.broadcast_object((plan, stop))
    if plan is not None:
        _apply_plan(t, p, plan)
        stop = stop or p.budget.should_stop(p.step)
    return stop


def run_epoch(t: Trainee, p: Progress, epoch: int, end_step: int) -> dict:
    """Train epoch ``epoch`` from batch ``p.batch_in_epoch`` until its end, ``end_step``, or the time budget.

    Returns:
        ``{"losses": [...], "seen": images, "seconds": s, "stopped": reason or None}``.
    """
    cfg, rank = p.cfg, dist.rank()
    sampler = epoch_sampler(t.loader)
    sampler.set_epoch(epoch)
    first_batch = p.batch_in_epoch
    sampler.skip = first_batch * (cfg.batch_size // dist.world_size())
    # the bar is for terminals (disable=None: off when stderr is not a TTY); logs get one line per epoch
    bar = tqdm(
        t.loader,
        desc=f"epoch {epoch + 1}" + (f"/{cfg.epochs}" if cfg.epochs else ""),
        disable=None if t.is_main else True,
        leave=False,
        dynamic_ncols=True,
    )
    tic, seen, losses, stopped = time.perf_counter(), 0, [], None
    last = tic
    try:
        for pixels, sizes, _, _ in bar:
            t.generator.manual_seed(_step_seed(cfg.seed, p.step, rank))
            pixels = pixels.to(t.device, non_blocking=True)
            sizes = sizes.to(t.device)
            x1, x2 = t.augment(pixels, sizes, t.generator)
            small = t.augment.small_crops(pixels, sizes, t.generator)
            lr, m = p.schedule.lr(p.step), p.schedule.momentum(p.step)
            loss = train_step(t.ddp_model, t.optimizer, x1, x2, lr, m, t.amp, small)
            losses.append(float(loss))
            p.step += 1
            p.batch_in_epoch += 1
            seen += cfg.batch_size
            now = time.perf_counter()
            if p.budget is not None:  # the whole step: waiting for the batch, augmenting, training
                p.budget.record_step(now - last)
            last = now
            images_per_s = seen / (time.perf_counter() - tic)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.4f}", img_s=f"{images_per_s:.0f}")
            if t.is_main and p.step % cfg.log_every == 0:
                _append_jsonl(
                    t.run_dir / METRICS,
                    {
                        "kind": "step",
                        "epoch": epoch,
                        "step": p.step,
                        "loss": losses[-1],
                        "lr": lr,
                        "momentum": m,
                        "images_per_s": images_per_s,
                        "elapsed_s": _elapsed(t, p),
                    },
                )
            if (
                cfg.save_every_steps
                and p.step % cfg.save_every_steps == 0
                and p.batch_in_epoch < t.steps_per_epoch
                and t.is_main
            ):
                save(t, p)
            if p.step >= end_step:
                stopped = "steps"
                break
            if p.budget is not None and _budget_control(t, p):
                stopped = "time budget"
                break
    finally:
        bar.close()
    return {"losses": losses, "seen": seen, "seconds": time.perf_counter() - tic, "stopped": stopped}


def _out_of_time(t: Trainee, p: Progress) -> bool:
    """Before an epoch of a budgeted run: whether the budget is already spent (rank 0's clock decides)."""
    return bool(dist.broadcast_object(p.budget.should_stop(p.step) if t.is_main else False))


def _elapsed(t: Trainee, p: Progress) -> float | None:
    return round(p.budget.elapsed(), 3) if p.budget is not None else None


def save(t: Trainee, p: Progress) -> None:
    """Write checkpoint_last.pt: ``p.epoch`` epochs complete plus ``p.batch_in_epoch`` batches of the next."""
    tic = time.perf_counter()
    schedule = {"total_steps": p.schedule.total_steps, "warmup_steps": p.schedule.warmup_steps}
    if p.budget is not None:
        schedule.update(p.budget.to_saved())
    save_atomic(
        checkpoint_dict(
            p.cfg,
            t.model,
            epoch=p.epoch,
            step=p.step,
            optimizer=t.optimizer,
            batch_in_epoch=p.batch_in_epoch,
            schedule=schedule,
            rng=rng_state(),
        ),
        t.run_dir / LAST,
    )
    p.last_save = time.perf_counter()
    p.save_seconds = p.last_save - tic
    p.saved_step = p.step


def _save_on_interrupt(t: Trainee, p: Progress) -> None:
    """Ctrl-C, mid-epoch or between epochs: keep the steps done since the last checkpoint (one process only:
    under DDP other ranks may be inside a collective)."""
    if t.is_main and dist.world_size() == 1 and p.step > p.saved_step:
        save(t, p)
        LOG.warning("interrupted: saved %s at %s", t.run_dir / LAST, position_text(p, t.steps_per_epoch))


# -- the run --------------------------------------------------------------------------------------------------------
def _end_step(t: Trainee, p: Progress, stop_at_epoch: int | None) -> tuple[int, str]:
    if p.budget is not None:
        return 2**62, "time budget"
    if stop_at_epoch is not None and stop_at_epoch < p.cfg.epochs:
        return stop_at_epoch * t.steps_per_epoch, "stop-at-epoch"
    return p.cfg.epochs * t.steps_per_epoch, "epochs"


def _whitened_text(score) -> str:
    """`` (whitened 87.37%)`` for a log line, or nothing when the monitor could not fit a whitening."""
    return f" (whitened {100 * score.whitened:.2f}%)" if score.whitened is not None else ""


def run(t: Trainee, p: Progress, stop_at_epoch: int | None = None) -> TrainResult:
    """Train until the schedule, ``stop_at_epoch`` or the time budget ends; evaluate, log and checkpoint."""
    cfg = p.cfg
    end_step, reason = _end_step(t, p, stop_at_epoch)
    loss_value, knn_acc, knn_before, knn_whitened = None, None, None, None
    if t.monitor is not None and p.step == 0 and end_step > 0:
        tic = time.perf_counter()
        score = t.monitor.scores(t.model.backbone, t.device)
        knn_before = knn_acc = score.plain
        knn_whitened = score.whitened
        p.eval_seconds = time.perf_counter() - tic
        LOG.info(
            "k-NN top-1 before training (%s): %.2f%%%s (%d images from %s)",
            f"--init {cfg.init}" if cfg.init else "random init",
            100 * knn_acc,
            _whitened_text(score),
            len(t.monitor),
            t.monitor.folder,
        )
        _append_jsonl(
            t.run_dir / METRICS,
            {
                "kind": "epoch",
                "epoch": 0,
                "step": 0,
                "knn_acc": knn_acc,
                "knn_acc_whitened": knn_whitened,
                "elapsed_s": _elapsed(t, p),
            },
        )
    stopped = None
    start_step = p.saved_step = p.step
    try:
        while p.step < end_step and stopped is None:
            if p.budget is not None and _out_of_time(t, p):
                stopped = "time budget"
                break
            epoch = p.epoch
            t.ddp_model.train()
            if p.batch_in_epoch == 0:  # inside an epoch the RNG states came back from the checkpoint
                seed_everything(_epoch_seed(cfg.seed, epoch, dist.rank()))
            stats = run_epoch(t, p, epoch, end_step)
            stopped = stats["stopped"]
            if stopped is None and p.budget is not None and p.step < end_step and _out_of_time(t, p):
                stopped = "time budget"  # spent at an epoch's end: this epoch's row still gets the final k-NN
            complete = p.batch_in_epoch >= t.steps_per_epoch
            if complete:
                p.epoch, p.batch_in_epoch = epoch + 1, 0
            tic = time.perf_counter()
            losses = stats["losses"] or [float("nan")]
            loss_value = float(dist.all_reduce_mean(torch.tensor(float(np.mean(losses)))).item())
            for part in dist.gather_objects(dict(p.skipped)):
                p.skipped.update(part)
            finished = stopped is not None or p.step >= end_step
            knn_acc = knn_whitened = score = None
            knn_every = p.cfg.knn_every  # None until a budgeted run has planned its length
            if t.monitor is not None and (finished or (complete and knn_every and p.epoch % knn_every == 0)):
                t_eval = time.perf_counter()
                score = t.monitor.scores(t.model.backbone, t.device)
                knn_acc, knn_whitened = score.plain, score.whitened
                p.eval_seconds = time.perf_counter() - t_eval
            if t.is_main:
                row = {
                    "kind": "epoch",
                    "epoch": epoch + 1 if complete else round(epoch + p.batch_in_epoch / t.steps_per_epoch, 3),
                    "step": p.step,
                    "loss": loss_value,
                    "lr": p.schedule.lr(max(0, p.step - 1)),
                    "epoch_time_s": stats["seconds"],
                    "images_per_s": stats["seen"] / max(1e-9, stats["seconds"]),
                    "knn_acc": knn_acc,
                    "knn_acc_whitened": knn_whitened,
                    "elapsed_s": _elapsed(t, p),
                }
                _append_jsonl(t.run_dir / METRICS, row)
                _write_skipped(t.run_dir / SKIPPED, p.skipped)
                knn_text = f", k-NN top-1 {100 * knn_acc:.2f}%{_whitened_text(score)}" if score is not None else ""
                LOG.info(
                    "epoch %s: loss %.4f, %.0f images/s%s", row["epoch"], loss_value, row["images_per_s"], knn_text
                )
                save_every = p.cfg.save_every  # None until a budgeted run has planned its length
                keep = complete and (finished or bool(save_every and p.epoch % save_every == 0))
                if finished or keep or time.perf_counter() - p.last_save >= CHECKPOINT_INTERVAL:
                    save(t, p)
                if keep:
                    link_or_copy_atomic(t.run_dir / LAST, t.run_dir / f"checkpoint_{p.epoch:04d}.pt")
                if finished or time.perf_counter() - p.last_plot >= PLOT_INTERVAL:
                    plot_metrics(t.run_dir / METRICS, t.run_dir / PLOT)
                    p.last_plot = time.perf_counter()
            dist.barrier()
    except KeyboardInterrupt:
        _save_on_interrupt(t, p)
        raise
    if t.is_main and not (t.run_dir / LAST).exists():
        # a budget spent before the first epoch ended (a slow start, a tiny budget): the run still leaves a
        # checkpoint, so `moco export` and a rerun find one (the demo's export failed here under load)
        save(t, p)
    if p.resumed and p.step == start_step:
        LOG.info("%s already trained (%d steps); nothing to do", t.run_dir, p.step)
    if stopped is None:
        stopped = reason
    elif stopped == "steps":
        stopped = reason
    return TrainResult(
        t.run_dir,
        p.epoch,
        p.step,
        loss_value,
        knn_acc,
        len(t.paths),
        len(p.skipped),
        t.model,
        knn_before,
        stopped,
        p.cfg.init,
        knn_whitened,
        t.steps_per_epoch,
    )


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
        with RunDirLock(cfg.out_dir) as lock:
            lock.acquire_if_present()
            return run(*setup(cfg, device, resume, lock), stop_at_epoch)
    finally:
        dist.cleanup()
