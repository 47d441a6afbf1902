"""The recipe as data: each variant's paper values beside the rules ``--recipe auto`` replaces them with.

A rule is ``(option, when, value, why)``: the first rule of an option whose condition holds fills it when the
user left it unset, and ``why`` (one line, its figures formatted from the constants here) goes to
``config.json``. The measurements behind each value are in ``docs/ARCHITECTURE.md`` ("Measured lessons") and
``bench/results/learning_curves_*``; the figures quoted in a reason are those runs'. :func:`describe` turns the
table into the text ``moco train --help`` prints, so help, config.json and the code cannot disagree.

Torch-free: ``moco train --help`` reads it without loading torch. Applying the rules (and the checks between
them) is :mod:`trainer.recipes`.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Callable

from moco_retrieval.trainer.config import NARROW_RESNETS

# -- the papers' values (Chen et al. 2020 for v2; Chen, Xie and He 2021 for v3) -------------------------------------
# ``warmup`` is a fraction of the run (10 of 100 epochs is 0.1); lr is per 256 images (x batch/256).
PAPER = {
    "v2": dict(
        lr=0.03, weight_decay=1e-4, warmup=0.0, queue_size=65536, momentum=0.999, temperature=0.2, dim=128, mlp_hidden=0
    ),
    "v3_resnet": dict(
        lr=0.6,
        weight_decay=1e-6,
        warmup=10 / 100,
        queue_size=0,
        momentum=0.99,
        temperature=1.0,
        dim=256,
        mlp_hidden=4096,
    ),
    "v3_vit": dict(
        lr=1.5e-4,
        weight_decay=0.1,
        warmup=40 / 300,
        queue_size=0,
        momentum=0.99,
        temperature=0.2,
        dim=256,
        mlp_hidden=4096,
    ),
}
PAPER_BATCH = 256
PAPER_BATCHES = "256-4,096"  # the batches the papers' values were made for (v2: 256; v3: 1,024-4,096)

# -- what auto uses instead ------------------------------------------------------------------------------------------
# MoCo v2 on a CPU, from equal-time runs on three real collections (bench/results/learning_curves_cpu_240s*.json)
AUTO_BATCH_CPU_V2 = 256
AUTO_LR_CPU_V2 = 0.06
# the rest from the generated demo data (not yet checked on real collections)
AUTO_BATCH_CPU = 32  # MoCo v3 on a CPU
AUTO_BATCH_RANGE = (32, 256)
AUTO_IMAGES_PER_BATCH = 32  # GPU: at most n / 32 images per step (50 steps per epoch on the 1,600 demo images)
AUTO_TEMPERATURE = 0.2
# base learning rates (x batch/256) that learned within 1,000-1,500 steps at batch 32-64, and the peak lr cap
AUTO_LR = {"v2": 0.48, "v3_resnet": 4.8, "v3_vit": 3e-3}
AUTO_MAX_EFFECTIVE_LR = {"v2": 0.12, "v3_resnet": 1.2, "v3_vit": 1.5e-3}
AUTO_QUEUE_FRACTION = 5  # v2 on a GPU: about a fifth of the images (the demo's K = 256 of 1,600 learned)
AUTO_WARMUP_EPOCHS_V3 = 1.0  # a 1-epoch warm-up learned; the paper's 10% of a long run did not in 1,500 steps
AUTO_WARMUP_MAX_FRACTION = 0.1
AUTO_TAU_FRACTION = 20  # v2 key momentum: an EMA time constant of 1/20 of the run, within [100, 1000] steps
AUTO_TAU_RANGE = (100, 1000)
# --init (continued pretraining: the weights already see). MoCo v2 on a CPU, measured: the from-scratch lr and
# key momentum, which beat a tenth of the lr with momentum 0.999 in every pair (bench/results/
# init_transfer_variants_cpu.json: 12 minutes of openclipart continued 4 minutes on icons and tuxpaint, 2 seeds).
# Elsewhere (GPU, v3), derived and not measured: a tenth of the from-scratch lr, meant to refine strong source
# weights (ImageNet's) instead of overwriting them, a short v3 warm-up (v2 has none) and a slower key encoder.
INIT_MEASURED_CPU_V2 = (
    "continued from 12 minutes of openclipart pretraining for 4 minutes, it scored 65.7% k-NN on the icons and "
    "54.1% on tuxpaint against 64.5% and 51.9% at a tenth of this lr with key momentum 0.999 "
    "(2 seeds, bench/results/init_transfer_variants_cpu.json)"
)
INIT_LR_FRACTION = 0.1
INIT_WARMUP_EPOCHS = {"v2": 0.0, "v3_resnet": 0.25, "v3_vit": 0.25}
INIT_MOMENTUM = {"v2": 0.999, "v3_resnet": 0.996, "v3_vit": 0.996}
NOT_MEASURED = "not yet measured on real collections"
# The network and its input size (issue 19: the defaults were ResNet-50 at 224 px everywhere, so a 2-core CPU
# upscaled 28-px images 8x and trained a fraction of an epoch in 30 minutes).
PAPER_ARCH, PAPER_IMAGE_SIZE = "resnet50", 224
AUTO_ARCH_CPU = "resnet18"  # see ARCH_SPEED_CPU
AUTO_ARCH_GPU = "resnet50"
ARCH_SPEED_CPU = (  # bench/results/train_throughput_cpu_r{18_32_64,50_224}_fp32.json, one_position_conv_cpu.json
    "ResNet-18 at 32 px trains at 221-449 images/s on 2 cores, ResNet-50 at 224 px at 2.0: an epoch of 60,000 "
    "images takes 2-4.5 minutes against 8 hours"
)
SIDE_STEP = 16  # an auto training size is the images' median shorter side rounded up to a multiple of this
SIDE_RANGE_CPU = (32, 32)  # 64 px lost to 32 px at equal time on real collections: see SIDE_WHY_CPU
NATIVE_FLOOR_CPU_V2 = 28  # MoCo v2 on a CPU trains images under 32 px at their own size, down to this: see _cpu_v2_side
SIDE_RANGE_GPU = (32, PAPER_IMAGE_SIZE)
MONITOR_EVALUATIONS = 10  # default --knn-every: about this many k-NN evaluations per run
SAVE_EVERY_EPOCHS = 10  # default --save-every: a numbered checkpoint every this many epochs, ...
KEPT_CHECKPOINTS = 10  # ... or fewer, so a run keeps about this many (30 minutes on the 1,025 icons: 810 epochs)
SMALL_STEM_COST = "about 9x the compute per image (measured at 32 px: 28 against 266 images/s)"


def pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1.0, x)))))


def auto_batch(num_images: int, images_per_batch: int, high: int, world_size: int) -> int:
    """The largest power of two at most ``num_images / images_per_batch``, within 32-``high``, and at least one
    image per process."""
    return max(AUTO_BATCH_RANGE[0], world_size, min(high, pow2_floor(num_images / images_per_batch)))


def lr_multiple(kind: str) -> float:
    """How many times the paper's base lr the auto base lr is (16x for v2, 8x for v3 ResNet, 20x for v3 ViT)."""
    return AUTO_LR[kind] / PAPER[kind]["lr"]


@dataclass(frozen=True)
class Situation:
    """What a rule may look at: the config so far, the variant (``v2``, ``v3_resnet``, ``v3_vit``), the data and
    the device."""

    cfg: object  # TrainConfig
    kind: str
    num_images: int
    world_size: int
    on_gpu: bool
    survey: object = None  # trainer.image_survey.ImageSurvey of the training images, when they were surveyed

    @property
    def paper(self) -> bool:
        return self.cfg.recipe == "paper"

    @property
    def init(self) -> bool:  # continued pretraining from --init weights
        return not self.paper and bool(getattr(self.cfg, "init", None))

    @property
    def init_cpu_v2(self) -> bool:  # --init, MoCo v2 on a CPU: the from-scratch values measured better
        return self.init and self.cpu_v2

    @property
    def init_elsewhere(self) -> bool:  # --init on a GPU or with v3: the derived gentler values
        return self.init and not self.cpu_v2

    @property
    def cpu_v2(self) -> bool:  # the recipe checked on real collections
        return not self.paper and not self.on_gpu and self.kind == "v2"

    @property
    def cpu(self) -> bool:
        return not self.paper and not self.on_gpu

    @property
    def gpu(self) -> bool:
        return not self.paper and self.on_gpu

    @property
    def auto(self) -> bool:
        return not self.paper

    @property
    def always(self) -> bool:
        return True


@dataclass(frozen=True)
class Rule:
    """``option`` takes ``value(situation)`` for ``why`` when ``when`` (a :class:`Situation` property) holds."""

    option: str
    when: str
    value: Callable[[Situation], object]
    why: Callable[[Situation], str]
    summary: str  # for --help: the value in words


def _auto_lr(s: Situation) -> float:
    scale = s.cfg.batch_size / 256 if s.cfg.lr_scale else 1.0
    return min(AUTO_LR[s.kind], AUTO_MAX_EFFECTIVE_LR[s.kind] / scale)


def _auto_lr_why(s: Situation) -> str:
    base, cap = AUTO_LR[s.kind], AUTO_MAX_EFFECTIVE_LR[s.kind]
    why = (
        f"{base:g} x batch/256 learned at batch 32-64 on the demo data ({lr_multiple(s.kind):g}x the paper's base "
        "lr: the linear scaling rule assumes batches of thousands)"
    )
    if _auto_lr(s) < base:
        why += f"; at batch {s.cfg.batch_size} capped so the peak lr stays at {cap:g}"
    return why


def _scratch_lr(s: Situation) -> float:
    """The base lr auto uses from scratch in ``s`` (the rules below the ``init`` one)."""
    return AUTO_LR_CPU_V2 if s.cpu_v2 else _auto_lr(s)


def _init_lr(s: Situation) -> float:
    return float(f"{INIT_LR_FRACTION * _scratch_lr(s):.4g}")


def native_side(median_side: int, side_range: tuple[int, int], step: int = SIDE_STEP) -> int:
    """The training size for images whose median shorter side is ``median_side``: rounded up to a multiple of
    ``step``, within ``side_range``."""
    low, high = side_range
    return max(low, min(high, -(-median_side // step) * step))


def _auto_side(s: Situation) -> int:
    side_range = SIDE_RANGE_GPU if s.on_gpu else SIDE_RANGE_CPU
    return native_side(s.survey.median_side, side_range) if s.survey is not None else side_range[1]


def _auto_side_why(s: Situation) -> str:
    if not s.on_gpu:
        return f"on a CPU, {SIDE_RANGE_CPU[0]} px: {SIDE_WHY_CPU}" + (
            f" ({s.survey.describe()})" if s.survey is not None else ""
        )
    low, high = SIDE_RANGE_GPU
    seen = s.survey.describe() if s.survey is not None else "the images were not surveyed"
    return f"{seen}: rounded up to a multiple of {SIDE_STEP}, within {low}-{high} px on a GPU"


def _cpu_v2_side(s: Situation) -> int:
    """MoCo v2 on a CPU: images whose median shorter side is under 32 px train at that side (never below
    :data:`NATIVE_FLOOR_CPU_V2`), not upscaled to 32; larger ones as :func:`_auto_side`."""
    if s.survey is None:
        return _auto_side(s)
    return native_side(s.survey.median_side, (NATIVE_FLOOR_CPU_V2, SIDE_RANGE_CPU[1]), step=1)


def _cpu_v2_side_why(s: Situation) -> str:
    side = _cpu_v2_side(s)
    if side == SIDE_RANGE_CPU[1]:
        return _auto_side_why(s)
    return (
        f"on a CPU, MoCo v2 trains images under {SIDE_RANGE_CPU[1]} px at their own size (at least "
        f"{NATIVE_FLOOR_CPU_V2} px): {NATIVE_WHY_CPU_V2} ({s.survey.describe()})"
    )


NATIVE_WHY_CPU_V2 = (  # bench/results/native_size_fmnist60k_30m.json
    "the 60,000 28-px Fashion-MNIST photos ran 3,104-3,305 steps in 30 minutes at 28 px against 2,786-2,850 "
    "upscaled to 32, and scored 90.61 +- 0.36% k-NN top-1 at the export's readout against 90.21 +- 0.75% "
    "(seeds 0-2: 91.01 / 90.52 / 90.31% against 90.77 / 90.49 / 89.36%)"
)


SIDE_WHY_CPU = (  # bench/results/learning_curves_sizes_cpu_240s.json
    "64 px runs at a third of the images/s of 32 px (73 against 221 on 2 cores) and lost to it in 4-minute "
    "runs on three real collections (k-NN top-1 at 32 / 64 px: tuxpaint 51.1 / 40.7%, icons 61.9 / 61.1%, "
    "openclipart 54.3 / 51.8%); larger images are shrunk, none upscaled past it"
)


def _gpu_queue(s: Situation) -> int:
    k = min(PAPER["v2"]["queue_size"], pow2_floor(s.num_images / AUTO_QUEUE_FRACTION))
    return max(2 * s.cfg.batch_size, k // s.cfg.batch_size * s.cfg.batch_size)


# Filled before the images are cached: the network and the size it trains at.
MODEL_AND_SIZE: tuple[Rule, ...] = (
    Rule("arch", "paper", lambda s: PAPER_ARCH, lambda s: "the papers' backbone", PAPER_ARCH),
    Rule(
        "arch",
        "cpu",
        lambda s: AUTO_ARCH_CPU,
        lambda s: f"on a CPU: {ARCH_SPEED_CPU}",
        f"on a CPU: {AUTO_ARCH_CPU}",
    ),
    Rule(
        "arch", "gpu", lambda s: AUTO_ARCH_GPU, lambda s: "on a GPU: the papers' backbone", f"on a GPU: {AUTO_ARCH_GPU}"
    ),
    Rule(
        "image_size",
        "paper",
        lambda s: PAPER_IMAGE_SIZE,
        lambda s: "the papers' training size",
        f"{PAPER_IMAGE_SIZE}",
    ),
    Rule(
        "image_size",
        "cpu_v2",
        _cpu_v2_side,
        _cpu_v2_side_why,
        f"MoCo v2 on a CPU: {SIDE_RANGE_CPU[0]} px, or the images' median shorter side when it is smaller (at "
        f"least {NATIVE_FLOOR_CPU_V2})",
    ),
    Rule(
        "image_size",
        "auto",
        _auto_side,
        _auto_side_why,
        f"on a CPU: {SIDE_RANGE_CPU[0]} px; on a GPU: the images' median shorter side rounded up to a "
        f"multiple of {SIDE_STEP}, within {SIDE_RANGE_GPU[0]}-{SIDE_RANGE_GPU[1]} px",
    ),
)

# Filled before the model is built, in this order (a later rule may read what an earlier one set).
BEFORE_TRAINING: tuple[Rule, ...] = (
    Rule("batch_size", "paper", lambda s: PAPER_BATCH, lambda s: "the papers' batch", f"{PAPER_BATCH}"),
    Rule(
        "batch_size",
        "cpu_v2",
        lambda s: auto_batch(s.num_images, 2, AUTO_BATCH_CPU_V2, s.world_size),
        lambda s: (
            f"on a CPU, batch {AUTO_BATCH_CPU_V2} (at most half the images) learned most per minute on real "
            "image collections (4-minute runs on 2 cores at peak lr 0.06, k-NN top-1 at batch 256 / 128 / 32: "
            "tuxpaint 48.9 / 48.4 / 47.3%, openclipart 53.0 / 51.7 / 47.0%); it also runs about 2x the "
            "images/s of batch 32"
        ),
        f"MoCo v2 on a CPU: {AUTO_BATCH_CPU_V2} (at most half the images)",
    ),
    Rule(
        "batch_size",
        "cpu",
        lambda s: max(AUTO_BATCH_CPU, s.world_size),
        lambda s: (
            f"on a CPU, batch {AUTO_BATCH_CPU} learned most per minute on the demo data (equal-time runs on "
            "2 cores: 75.6% k-NN at batch 32, 70.6% at 64, no gain at 128)"
        ),
        f"MoCo v3 on a CPU: {AUTO_BATCH_CPU}",
    ),
    Rule(
        "batch_size",
        "gpu",
        lambda s: auto_batch(s.num_images, AUTO_IMAGES_PER_BATCH, AUTO_BATCH_RANGE[1], s.world_size),
        lambda s: (
            f"{s.num_images} images: at most 1/{AUTO_IMAGES_PER_BATCH} of them per step, within "
            f"{AUTO_BATCH_RANGE[0]}-{AUTO_BATCH_RANGE[1]}"
        ),
        f"on a GPU: 1/{AUTO_IMAGES_PER_BATCH} of the images ({AUTO_BATCH_RANGE[0]}-{AUTO_BATCH_RANGE[1]})",
    ),
    Rule(
        "stem",
        "gpu",
        lambda s: "imagenet" if s.cfg.image_size > 96 else "small",
        lambda s: (
            f"{s.cfg.image_size} px images: the ImageNet stem"
            if s.cfg.image_size > 96
            else f"{s.cfg.image_size} px images keep their resolution (the CIFAR versions of MoCo/SimCLR)"
        ),
        "on a GPU: small (3x3, no max-pool) at 96 px and below, else ImageNet",
    ),
    Rule(
        "stem",
        "paper",
        lambda s: "imagenet" if s.cfg.image_size > 96 else "small",
        lambda s: (
            f"{s.cfg.image_size} px images: the ImageNet stem"
            if s.cfg.image_size > 96
            else f"{s.cfg.image_size} px images keep their resolution (the CIFAR versions of MoCo/SimCLR)"
        ),
        "small at 96 px and below, else ImageNet",
    ),
    Rule(
        "stem",
        "cpu",
        lambda s: "small" if s.cfg.arch in NARROW_RESNETS and s.cfg.image_size <= 96 else "imagenet",
        lambda s: (
            f"{s.cfg.image_size} px images: the ImageNet stem"
            if s.cfg.image_size > 96
            else f"{s.cfg.arch} keeps the resolution at about ResNet-18's cost with the ImageNet stem"
            if s.cfg.arch in NARROW_RESNETS
            else f"on a CPU the small stem costs {SMALL_STEM_COST}; pass --stem small to keep the resolution"
        ),
        "on a CPU: ImageNet (the small stem costs about 9x); small for resnet18_narrow at 96 px and below",
    ),
    Rule("dim", "always", lambda s: PAPER[s.kind]["dim"], lambda s: f"{_name(s.kind)} paper value", "paper value"),
    Rule(
        "mlp_hidden",
        "always",
        lambda s: PAPER[s.kind]["mlp_hidden"],
        lambda s: f"{_name(s.kind)} paper value",
        "paper value",
    ),
    Rule(
        "weight_decay",
        "always",
        lambda s: PAPER[s.kind]["weight_decay"],
        lambda s: f"{_name(s.kind)} paper value",
        "paper value",
    ),
    Rule(
        "temperature",
        "paper",
        lambda s: PAPER[s.kind]["temperature"],
        lambda s: f"{_name(s.kind)} paper value",
        "paper value",
    ),
    Rule(
        "temperature",
        "auto",
        lambda s: AUTO_TEMPERATURE,
        lambda s: (
            f"T = {AUTO_TEMPERATURE:g} learned in every small-batch recipe; the v3 ResNet paper value 1.0 "
            "learned slowest"
        ),
        f"{AUTO_TEMPERATURE:g}",
    ),
    Rule(
        "lr",
        "paper",
        lambda s: PAPER[s.kind]["lr"],
        lambda s: f"{_name(s.kind)} paper value (x batch/256)",
        "paper value",
    ),
    Rule(
        "lr",
        "init_cpu_v2",
        lambda s: AUTO_LR_CPU_V2,
        lambda s: f"--init, MoCo v2 on a CPU: the from-scratch {AUTO_LR_CPU_V2:g} x batch/256; {INIT_MEASURED_CPU_V2}",
        "the from-scratch value for MoCo v2 on a CPU (measured)",
    ),
    Rule(
        "lr",
        "init_elsewhere",
        _init_lr,
        lambda s: (
            f"--init: {INIT_LR_FRACTION:g}x the from-scratch auto lr ({_scratch_lr(s):g} x batch/256), so "
            f"training refines the weights instead of overwriting them ({NOT_MEASURED})"
        ),
        f"{INIT_LR_FRACTION:g}x the from-scratch value elsewhere ({NOT_MEASURED})",
    ),
    Rule(
        "momentum",
        "init_elsewhere",
        lambda s: INIT_MOMENTUM[s.kind],
        lambda s: (
            f"--init: key momentum {INIT_MOMENTUM[s.kind]:g}"
            + (" rising to 1" if s.kind != "v2" else "")
            + f", higher than from scratch, so the key encoder keeps the source's features while the "
            f"queries adapt ({NOT_MEASURED})"
        ),
        f"{INIT_MOMENTUM['v2']:g} (v2 on a GPU), {INIT_MOMENTUM['v3_resnet']:g} rising to 1 (v3) ({NOT_MEASURED}); "
        "MoCo v2 on a CPU: the from-scratch value (measured)",
    ),
    Rule(
        "warmup_epochs",
        "init",
        lambda s: INIT_WARMUP_EPOCHS[s.kind],
        lambda s: (
            f"--init: {INIT_WARMUP_EPOCHS[s.kind]:g} epochs of warm-up (at most "
            f"{100 * AUTO_WARMUP_MAX_FRACTION:g}% of the run): the weights need no long start, only the "
            f"fresh heads ({NOT_MEASURED})"
        ),
        f"{INIT_WARMUP_EPOCHS['v3_resnet']:g} epoch for v3 ({NOT_MEASURED}), none for v2",
    ),
    Rule(
        "lr",
        "cpu_v2",
        lambda s: AUTO_LR_CPU_V2,
        lambda s: (
            f"{AUTO_LR_CPU_V2:g} x batch/256, {AUTO_LR_CPU_V2 / PAPER['v2']['lr']:g}x the paper's: in 4 minutes "
            "it added 17.9 k-NN points on the demo data where the paper's values added 7.5, and 1-3 points "
            f"fewer than those on real collections; the small-batch recipe ({AUTO_LR['v2']:g} x batch/256 at "
            "batch 32) fell below random weights on two of three real collections"
        ),
        f"MoCo v2 on a CPU: {AUTO_LR_CPU_V2:g} x batch/256 ({AUTO_LR_CPU_V2 / PAPER['v2']['lr']:g}x the paper's)",
    ),
    Rule(
        "lr",
        "auto",
        _auto_lr,
        _auto_lr_why,
        "elsewhere: "
        + ", ".join(
            f"{lr_multiple(k):g}x the paper's for {_k}"
            for k, _k in (("v2", "v2"), ("v3_resnet", "v3 ResNets"), ("v3_vit", "v3 ViTs"))
        )
        + ", capped at larger batches",
    ),
    Rule(
        "queue_size",
        "paper",
        lambda s: PAPER["v2"]["queue_size"],
        lambda s: "MoCo v2 paper value",
        f"{PAPER['v2']['queue_size']}",
    ),
    Rule(
        "queue_size",
        "cpu_v2",
        lambda s: PAPER["v2"]["queue_size"],
        lambda s: (
            "the paper's K, or as long as the images allow (a longer queue learned more on real collections "
            "at batch 128-256)"
        ),
        f"MoCo v2 on a CPU: the paper's {PAPER['v2']['queue_size']}",
    ),
    Rule(
        "queue_size",
        "auto",
        _gpu_queue,
        lambda s: (
            f"about 1/{AUTO_QUEUE_FRACTION} of the {s.num_images} images, a multiple of the batch (K = 256 of "
            "1,600 learned; the paper's K is 5% of ImageNet)"
        ),
        f"on a GPU: about 1/{AUTO_QUEUE_FRACTION} of the images",
    ),
)


def _name(kind: str) -> str:
    return {"v2": "MoCo v2", "v3_resnet": "MoCo v3 (ResNet)", "v3_vit": "MoCo v3 (ViT)"}[kind]


def rules_for(option: str) -> list[Rule]:
    return [rule for rule in MODEL_AND_SIZE + BEFORE_TRAINING if rule.option == option]


def first_rule(option: str, situation: Situation) -> Rule | None:
    """The rule that fills ``option`` in ``situation``, or ``None``."""
    return next((r for r in rules_for(option) if getattr(situation, r.when)), None)


def describe() -> str:
    """The auto recipe in a few lines for ``moco train --help``, from the table."""
    lines = []
    for option in ("arch", "image_size", "batch_size", "lr", "queue_size", "stem", "temperature"):
        summaries = [r.summary for r in rules_for(option) if r.when != "paper" and not r.when.startswith("init")]
        lines.append(f"  --{option.replace('_', '-')}: " + "; ".join(summaries))
    tau = f"1/{AUTO_TAU_FRACTION} of the run ({AUTO_TAU_RANGE[0]}-{AUTO_TAU_RANGE[1]} steps)"
    lines.append(
        f"  --momentum (v2): an EMA time constant of {tau}; --warmup-epochs: none for v2, "
        f"{AUTO_WARMUP_EPOCHS_V3:g} epoch for v3 (at most {100 * AUTO_WARMUP_MAX_FRACTION:g}% of the run)"
    )
    init = [f"--{r.option.replace('_', '-')} {r.summary}" for r in BEFORE_TRAINING if r.when.startswith("init")]
    lines.append("  with --init: " + "; ".join(init))
    lines.append(
        f"  the queue is always capped at half the images; the papers' values are for batches of "
        f"{PAPER_BATCHES} and hundreds of epochs"
    )
    return "\n".join(textwrap.fill(line, 110, subsequent_indent="      ") for line in lines)
