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
from moco_retrieval.trainer.config import NARROW_RESNETS, VITS, TrainConfig, left_to_recipe
from moco_retrieval.trainer.image_survey import ImageSurvey
from moco_retrieval.trainer.recipe_table import (
    AUTO_TAU_FRACTION,
    AUTO_TAU_RANGE,
    AUTO_WARMUP_EPOCHS_V3,
    AUTO_WARMUP_MAX_FRACTION,
    KEPT_CHECKPOINTS,
    MONITOR_EVALUATIONS,
    SAVE_EVERY_EPOCHS,
    SMALL_STEM_COST,
    Situation,
    first_rule,
)
from moco_retrieval.trainer.variants import (
    MoCoV2Variant,
    MoCoV3ResNetVariant,
    MoCoV3ViTVariant,
    Variant,
)

LOG = logging.getLogger(__name__)

KINDS = {MoCoV2Variant: "v2", MoCoV3ResNetVariant: "v3_resnet", MoCoV3ViTVariant: "v3_vit"}


def set_derived(cfg: TrainConfig, name: str, value, why: str) -> TrainConfig:
    """``cfg`` with ``name`` set to ``value`` for ``why``; where the user had set the option (a --queue-size the
    recipe caps, --stem auto), their value is kept as ``requested``: a resume compares the rerun's options with
    what the user asked for, not with what the recipe made of it (trainer.train._merge_saved)."""
    item = {"value": value, "why": why}
    earlier = cfg.derived.get(name)
    requested = earlier.get("requested") if earlier is not None else getattr(cfg, name)
    if requested is not None:
        item["requested"] = requested
    return cfg.replace(**{name: value}, derived={**cfg.derived, name: item})


_set = set_derived


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
    return limit, (
        f"{queue_size} is more than half of the {num_images} images: capped at {limit} so the queue "
        "never holds the query's own image"
    )


def check_batch_divides(batch_size: int, world_size: int) -> None:
    """Raises ConfigError unless the global batch splits evenly over the processes."""
    if batch_size % world_size:
        raise ConfigError(f"--batch-size {batch_size} (global) must be divisible by the {world_size} processes")


def _unset(cfg: TrainConfig, option: str) -> bool:
    return left_to_recipe(option, getattr(cfg, option))


def _fill(
    cfg: TrainConfig,
    options: tuple[str, ...],
    kind: str,
    num_images: int,
    world_size: int,
    on_gpu: bool,
    survey: ImageSurvey | None = None,
) -> TrainConfig:
    """Fill each unset option of ``options`` from the first rule of the table whose condition holds."""
    for option in options:
        if not _unset(cfg, option):
            continue
        situation = Situation(cfg, kind, num_images, world_size, on_gpu, survey)
        rule = first_rule(option, situation)
        if rule is not None:
            cfg = _set(cfg, option, rule.value(situation), rule.why(situation))
    return cfg


def resolve_model_and_size(
    cfg: TrainConfig, survey: ImageSurvey | None, num_images: int, world_size: int, on_gpu: bool
) -> TrainConfig:
    """Fill ``--arch`` and ``--image-size`` when left at auto, by the rules of
    :data:`trainer.recipe_table.MODEL_AND_SIZE`: the network from the device, the size from the images' own
    sizes (``survey``; ``None`` takes the device's largest auto size) and the device. Runs before the images
    are cached, since the cache stores them at a size made for the training size."""
    kind = "v2" if cfg.moco_version == 2 else "v3_vit" if cfg.arch in VITS else "v3_resnet"
    return _fill(cfg, ("arch", "image_size"), kind, num_images, world_size, on_gpu, survey)


def resolve_before_training(
    cfg: TrainConfig, variant: Variant, num_images: int, world_size: int, on_gpu: bool
) -> TrainConfig:
    """Fill every option the model, optimizer and loader need that the user left unset, by the rules of
    :data:`trainer.recipe_table.BEFORE_TRAINING`, with the checks that fall between them.

    Raises:
        ConfigError: a batch that does not divide over the processes. DataError: too few images.
    """
    kind = KINDS[type(variant)]
    context = (kind, num_images, world_size, on_gpu)
    cfg = _fill(cfg, ("batch_size",), *context)
    check_batch_divides(cfg.batch_size, world_size)
    if num_images < cfg.batch_size:
        raise DataError(
            f"{cfg.data_dir} has {num_images} readable images, fewer than one batch ({cfg.batch_size}); "
            "add images or lower --batch-size"
        )
    if cfg.arch.startswith("resnet"):
        cfg = _fill(cfg, ("stem",), *context)
        if cfg.resolved_stem == "small" and not on_gpu and cfg.arch not in NARROW_RESNETS:  # (narrow: made for it)
            LOG.warning(
                "the small ResNet stem costs %s on 2 CPU cores; pass --stem imagenet for a run 9x faster",
                SMALL_STEM_COST,
            )
    cfg = _fill(cfg, ("dim", "mlp_hidden", "weight_decay", "temperature", "lr"), *context)
    cfg = _fill(cfg, ("momentum",), *context)  # only --init has a rule before training
    if kind == "v2":
        cfg = _fill(cfg, ("queue_size",), *context)
        queue, why = fit_queue_to_data(cfg.queue_size, cfg.batch_size, num_images)
        if why:
            cfg = _set(cfg, "queue_size", queue, why)
        if cfg.momentum is None and cfg.recipe == "paper":
            cfg = _set(cfg, "momentum", variant.paper["momentum"], "MoCo v2 paper value")
    else:
        if cfg.queue_size is None:
            cfg = cfg.replace(queue_size=0)
        if cfg.momentum is None:
            cfg = _set(cfg, "momentum", variant.paper["momentum"], f"{variant.name}: 0.99 rising to 1 on a cosine")
    return cfg


def resolve_schedule(cfg: TrainConfig, variant: Variant, total_steps: int, steps_per_epoch: int) -> TrainConfig:
    """Fill what depends on the run's length: epochs (of a budgeted run), the monitor's and the numbered
    checkpoints' intervals, warm-up and v2's key momentum."""
    if cfg.epochs is None or "epochs" in cfg.derived:
        epochs = max(1, math.ceil(total_steps / steps_per_epoch))
        why = (
            f"{total_steps} steps fit in --time-budget {cfg.time_budget} at the measured speed"
            if cfg.time_budget
            else "default length without --time-budget"
        )
        cfg = _set(cfg, "epochs", epochs, why)
    if cfg.knn_every is None:
        every = max(1, math.ceil(cfg.epochs / MONITOR_EVALUATIONS))
        cfg = _set(
            cfg,
            "knn_every",
            every,
            f"about {MONITOR_EVALUATIONS} evaluations over {cfg.epochs} epochs (plus the first and the last)",
        )
    if cfg.save_every is None:
        every = max(SAVE_EVERY_EPOCHS, math.ceil(cfg.epochs / KEPT_CHECKPOINTS))
        cfg = _set(
            cfg,
            "save_every",
            every,
            f"every {SAVE_EVERY_EPOCHS} epochs, at most about {KEPT_CHECKPOINTS} numbered checkpoints over "
            f"{cfg.epochs} epochs (plus the last)",
        )
    init_rule = first_rule("warmup_epochs", Situation(cfg, KINDS[type(variant)], 0, 1, False))
    if cfg.warmup_epochs is None and init_rule is not None:  # --init; the rule's value is in epochs, capped here
        cap = AUTO_WARMUP_MAX_FRACTION * total_steps / steps_per_epoch
        situation = Situation(cfg, KINDS[type(variant)], 0, 1, False)
        cfg = _set(cfg, "warmup_epochs", round(min(init_rule.value(situation), cap), 3), init_rule.why(situation))
    if cfg.warmup_epochs is None:
        if cfg.recipe == "paper":
            cfg = _set(
                cfg,
                "warmup_epochs",
                round(variant.paper["warmup"] * total_steps / steps_per_epoch, 3),
                f"{variant.name} paper value: {100 * variant.paper['warmup']:g}% of the run",
            )
        elif isinstance(variant, MoCoV2Variant):
            cfg = _set(cfg, "warmup_epochs", 0.0, "MoCo v2 learned without warm-up")
        else:
            cap = AUTO_WARMUP_MAX_FRACTION * total_steps / steps_per_epoch
            warmup = round(min(AUTO_WARMUP_EPOCHS_V3, cap), 3)
            cfg = _set(
                cfg,
                "warmup_epochs",
                warmup,
                f"1 epoch (at most {100 * AUTO_WARMUP_MAX_FRACTION:g}% of the "
                "run) learned; the paper's 10% of a long run did not within 1,500 steps",
            )
    if cfg.momentum is None:  # v2, auto
        low, high = AUTO_TAU_RANGE
        tau = min(high, max(low, total_steps / AUTO_TAU_FRACTION))
        cfg = _set(
            cfg,
            "momentum",
            round(1 - 1 / tau, 6),
            f"an EMA time constant of {tau:g} steps (1/"
            f"{AUTO_TAU_FRACTION} of the {total_steps}-step run, within {low}-{high}): 0.99 learned in "
            "1,400 steps where the paper's 0.999 barely moves the key encoder",
        )
    return cfg


def resolve_for_images(cfg: TrainConfig, num_images: int, world_size: int = 1, on_gpu: bool = False) -> TrainConfig:
    """``cfg`` with every option the recipe fills filled, as a run over ``num_images`` images would fill them
    (without a folder or a time budget: for configs built outside a run, e.g. a random-init checkpoint)."""
    from moco_retrieval.trainer.variants import variant_for

    cfg = resolve_model_and_size(cfg, None, num_images, world_size, on_gpu)
    variant = variant_for(cfg)
    cfg = resolve_before_training(cfg, variant, num_images, world_size, on_gpu)
    steps = max(1, num_images // cfg.batch_size)
    return resolve_schedule(cfg, variant, (cfg.epochs or 1) * steps, steps)
