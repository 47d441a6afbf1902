"""Recipes: the values of the options a user left unset, and why each was chosen.

``--recipe paper`` takes the MoCo papers' values (:attr:`trainer.variants.Variant.paper`), which assume
batches of 256-4,096 and hundreds of epochs. ``--recipe auto`` (the default) derives them from the three things
that decide what learns in the time a user has: the batch size, the number of images and the length of the
run, using what our learning curves showed (``docs/ARCHITECTURE.md``, "Measured lessons"; the curves are
``bench/results/learning_curves_*``). MoCo v2 on a CPU follows the curves on real image collections (batch
256, lr 0.06, the longest queue the images allow); the other choices came from the generated demo data and
have not been checked on real collections yet.

Resolution happens in two steps: :func:`resolve_before_training` fixes what the model and the loader need
(batch, stem, lr, temperature, queue, heads, weight decay); :func:`resolve_schedule` fixes what depends on the
total number of steps (epochs, warm-up, v2's key momentum), which a ``--time-budget`` run only knows after its
first minute. Every derived value lands in ``TrainConfig.derived`` as ``{"value": ..., "why": ...}``.
"""
from __future__ import annotations

import logging
import math

from moco_retrieval.contracts.errors import ConfigError, DataError
from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.variants import (
    MoCoV2Variant,
    MoCoV3ResNetVariant,
    MoCoV3ViTVariant,
    Variant,
)

LOG = logging.getLogger(__name__)

PAPER_BATCH = 256
AUTO_BATCH_CPU = 32  # MoCo v3 on a CPU (demo data)
# MoCo v2 on a CPU, from equal-time runs on three real collections (bench/results/learning_curves_cpu_240s*.json):
# batch 256 (at most half the images), lr 0.06 x batch/256, the longest queue the images allow
AUTO_BATCH_CPU_V2 = 256
AUTO_LR_CPU_V2 = 0.06
AUTO_BATCH_RANGE = (32, 256)
AUTO_IMAGES_PER_BATCH = 32  # auto batch: at most n / 32 (50 steps per epoch on the 1,600 demo images)
AUTO_TEMPERATURE = 0.2
# auto base learning rates (x batch/256): what learned within 1,000-1,500 steps at batch 32-64 (demo data)
AUTO_LR = {MoCoV2Variant: 0.48, MoCoV3ResNetVariant: 4.8, MoCoV3ViTVariant: 3e-3}
AUTO_MAX_EFFECTIVE_LR = {MoCoV2Variant: 0.12, MoCoV3ResNetVariant: 1.2, MoCoV3ViTVariant: 1.5e-3}
AUTO_QUEUE_FRACTION = 5  # auto v2 queue: about a fifth of the images (the demo's K = 256 of 1,600 learned)
AUTO_WARMUP_EPOCHS_V3 = 1.0  # v3: a 1-epoch warm-up learned; the paper's 10% of a long run did not in 1,500 steps
AUTO_WARMUP_MAX_FRACTION = 0.1
AUTO_TAU_FRACTION = 20  # v2 key momentum: an EMA time constant of 1/20 of the run, within [100, 1000] steps
AUTO_TAU_RANGE = (100, 1000)
MONITOR_EVALUATIONS = 10  # default --knn-every: about this many k-NN evaluations per run


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1.0, x)))))


def _auto_batch(num_images: int, images_per_batch: int, high: int, world_size: int) -> int:
    """The largest power of two at most ``num_images / images_per_batch``, within 32-``high``, and at least one
    image per process."""
    return max(AUTO_BATCH_RANGE[0], world_size, min(high, _pow2_floor(num_images / images_per_batch)))


def _set(cfg: TrainConfig, name: str, value, why: str) -> TrainConfig:
    return cfg.replace(**{name: value}, derived={**cfg.derived, name: {"value": value, "why": why}})


def fit_queue_to_data(queue_size: int, batch_size: int, num_images: int) -> tuple[int, str | None]:
    """The MoCo v2 queue length to use: ``queue_size``, capped at half the images (a multiple of the batch),
    and the reason when it was capped.

    A queue as long as an epoch holds an older key of every image, so each query would meet its own image as
    a negative and training collapses (seen on small folders: loss climbs to log(K+1), k-NN accuracy falls).
    MoCo's ImageNet setting keeps K at 5% of the images; half is the most that still works.

    Raises:
        DataError: fewer than two batches of other images.
    """
    limit = num_images // 2 // batch_size * batch_size
    if queue_size <= limit:
        return queue_size, None
    if limit < batch_size:
        raise DataError(
            f"{num_images} images are too few for MoCo v2 with --batch-size {batch_size}: the queue needs at least "
            f"two batches of other images; add images or lower --batch-size"
        )
    return limit, (f"{queue_size} is more than half of the {num_images} images: capped at {limit} so the queue "
                   "never holds the query's own image")


def resolve_before_training(cfg: TrainConfig, variant: Variant, num_images: int, world_size: int,
                            on_gpu: bool) -> TrainConfig:
    """Fill every option the model, optimizer and loader need that the user left unset (see module docstring).

    Raises:
        ConfigError: a batch that does not divide over the processes. DataError: too few images.
    """
    paper = cfg.recipe == "paper"
    kind = type(variant)
    cpu_v2 = not paper and not on_gpu and kind is MoCoV2Variant  # the recipe checked on real collections
    if cfg.batch_size is None:
        if paper:
            cfg = _set(cfg, "batch_size", PAPER_BATCH, "the papers' batch")
        elif cpu_v2:
            cfg = _set(cfg, "batch_size", _auto_batch(num_images, 2, AUTO_BATCH_CPU_V2, world_size),
                       "on a CPU, batch 256 (at most half the images) learned most per minute on real image "
                       "collections (4-minute runs on 2 cores at peak lr 0.06, k-NN top-1 at batch 256 / 128 / 32: "
                       "tuxpaint 48.9 / 48.4 / 47.3%, openclipart 53.0 / 51.7 / 47.0%); it also runs about 2x the "
                       "images/s of batch 32")
        elif not on_gpu:
            batch = max(AUTO_BATCH_CPU, world_size)
            cfg = _set(cfg, "batch_size", batch, "on a CPU, batch 32 learned most per minute on the demo data "
                       "(equal-time runs on 2 cores: 75.6% k-NN at batch 32, 70.6% at 64, no gain at 128)")
        else:
            low, high = AUTO_BATCH_RANGE
            cfg = _set(cfg, "batch_size", _auto_batch(num_images, AUTO_IMAGES_PER_BATCH, high, world_size),
                       f"{num_images} images: at most 1/{AUTO_IMAGES_PER_BATCH} of them per step, within {low}-{high}")
    if cfg.batch_size % world_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {world_size} processes")
    if num_images < cfg.batch_size:
        raise DataError(f"{cfg.data_dir} has {num_images} readable images, fewer than one batch ({cfg.batch_size}); "
                        "add images or lower --batch-size")
    if cfg.stem == "auto" and cfg.arch.startswith("resnet"):
        if cfg.image_size > 96:
            cfg = _set(cfg, "stem", "imagenet", f"{cfg.image_size} px images: the ImageNet stem")
        elif paper or on_gpu:
            cfg = _set(cfg, "stem", "small", f"{cfg.image_size} px images keep their resolution (the CIFAR "
                       "versions of MoCo/SimCLR)")
        else:
            cfg = _set(cfg, "stem", "imagenet", "on a CPU the small stem costs about 9x the compute per image "
                       "(measured at 32 px: 28 against 266 images/s); pass --stem small to keep the resolution")
    if cfg.arch.startswith("resnet") and cfg.resolved_stem == "small" and not on_gpu:
        LOG.warning("the small ResNet stem costs about 9x the compute per image of the ImageNet stem (measured at "
                    "32 px on 2 CPU cores: 28 against 266 images/s); pass --stem imagenet for a run 9x faster")
    for name in ("dim", "mlp_hidden", "weight_decay"):
        if getattr(cfg, name) is None:
            cfg = _set(cfg, name, variant.paper[name], f"{variant.name} paper value")
    if cfg.temperature is None:
        if paper:
            cfg = _set(cfg, "temperature", variant.paper["temperature"], f"{variant.name} paper value")
        else:
            cfg = _set(cfg, "temperature", AUTO_TEMPERATURE, "T = 0.2 learned in every small-batch recipe; "
                       "the v3 ResNet paper value 1.0 learned slowest")
    if cfg.lr is None:
        if paper:
            cfg = _set(cfg, "lr", variant.paper["lr"], f"{variant.name} paper value (x batch/256)")
        elif cpu_v2:
            cfg = _set(cfg, "lr", AUTO_LR_CPU_V2, f"{AUTO_LR_CPU_V2:g} x batch/256, 2x the paper's: in 4 minutes "
                       "it added 17.9 k-NN points on the demo data where the paper's values added 7.5, and 1-3 points "
                       "fewer than those on real collections; the small-batch recipe (0.48 x batch/256 at batch 32) "
                       "fell below random weights on two of three real collections")
        else:
            base = AUTO_LR[kind]
            cap = AUTO_MAX_EFFECTIVE_LR[kind]
            scale = cfg.batch_size / 256 if cfg.lr_scale else 1.0
            lr = min(base, cap / scale)
            why = (f"{base:g} x batch/256 learned at batch 32-64 on the demo data "
                   f"({16 if kind is MoCoV2Variant else 8}x the paper's base lr: the linear scaling rule assumes "
                   "batches of thousands)")
            if lr < base:
                why += f"; at batch {cfg.batch_size} capped so the peak lr stays at {cap:g}"
            cfg = _set(cfg, "lr", lr, why)
    if isinstance(variant, MoCoV2Variant):
        if cfg.queue_size is None:
            if paper:
                cfg = _set(cfg, "queue_size", variant.paper["queue_size"], "MoCo v2 paper value")
            elif cpu_v2:
                cfg = _set(cfg, "queue_size", variant.paper["queue_size"], "the paper's K, or as long as the images "
                           "allow (a longer queue learned more on real collections at batch 128-256)")
            else:
                k = min(65536, _pow2_floor(num_images / AUTO_QUEUE_FRACTION))
                k = max(2 * cfg.batch_size, k // cfg.batch_size * cfg.batch_size)
                cfg = _set(cfg, "queue_size", k, f"about 1/{AUTO_QUEUE_FRACTION} of the {num_images} images, a "
                           "multiple of the batch (K = 256 of 1,600 learned; the paper's K is 5% of ImageNet)")
        queue, why = fit_queue_to_data(cfg.queue_size, cfg.batch_size, num_images)
        if why:
            cfg = _set(cfg, "queue_size", queue, why)
        if cfg.momentum is None and paper:
            cfg = _set(cfg, "momentum", variant.paper["momentum"], "MoCo v2 paper value")
    else:
        if cfg.queue_size is None:
            cfg = cfg.replace(queue_size=0)
        if cfg.momentum is None:
            cfg = _set(cfg, "momentum", variant.paper["momentum"], f"{variant.name}: 0.99 rising to 1 on a cosine")
    return cfg


def resolve_schedule(cfg: TrainConfig, variant: Variant, total_steps: int, steps_per_epoch: int) -> TrainConfig:
    """Fill what depends on the run's length: epochs (of a budgeted run), the monitor's interval, warm-up and
    v2's key momentum."""
    if cfg.epochs is None or "epochs" in cfg.derived:
        epochs = max(1, math.ceil(total_steps / steps_per_epoch))
        why = (f"{total_steps} steps fit in --time-budget {cfg.time_budget} at the measured speed"
               if cfg.time_budget else "default length without --time-budget")
        cfg = _set(cfg, "epochs", epochs, why)
    if cfg.knn_every is None:
        every = max(1, math.ceil(cfg.epochs / MONITOR_EVALUATIONS))
        cfg = _set(cfg, "knn_every", every, f"about {MONITOR_EVALUATIONS} evaluations over {cfg.epochs} epochs "
                   "(plus the first and the last)")
    if cfg.warmup_epochs is None:
        if cfg.recipe == "paper":
            cfg = _set(cfg, "warmup_epochs", round(variant.paper["warmup"] * total_steps / steps_per_epoch, 3),
                       f"{variant.name} paper value: {100 * variant.paper['warmup']:g}% of the run")
        elif isinstance(variant, MoCoV2Variant):
            cfg = _set(cfg, "warmup_epochs", 0.0, "MoCo v2 learned without warm-up")
        else:
            cap = AUTO_WARMUP_MAX_FRACTION * total_steps / steps_per_epoch
            warmup = round(min(AUTO_WARMUP_EPOCHS_V3, cap), 3)
            cfg = _set(cfg, "warmup_epochs", warmup, f"1 epoch (at most {100 * AUTO_WARMUP_MAX_FRACTION:g}% of the "
                       "run) learned; the paper's 10% of a long run did not within 1,500 steps")
    if cfg.momentum is None:  # v2, auto
        low, high = AUTO_TAU_RANGE
        tau = min(high, max(low, total_steps / AUTO_TAU_FRACTION))
        cfg = _set(cfg, "momentum", round(1 - 1 / tau, 6), f"an EMA time constant of {tau:g} steps (1/"
                   f"{AUTO_TAU_FRACTION} of the {total_steps}-step run, within {low}-{high}): 0.99 learned in "
                   "1,400 steps where the paper's 0.999 barely moves the key encoder")
    return cfg
