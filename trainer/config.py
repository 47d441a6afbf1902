"""The typed training configuration: one dataclass, validated on construction, round-tripping to JSON, and the
single statement of every training option: ``moco train``'s flags are generated from the fields and their
``help`` metadata (:mod:`contracts.options`, as every command's are), so an option is declared once.

Fields left at ``None`` are derived when the run starts, from the user's data size, batch size and time budget
by the recipe (``--recipe auto``, :mod:`trainer.recipes`) or taken from the papers (``--recipe paper``); the
resolved values, and why each was chosen, go to ``config.json``. A resumed run rebuilds its model from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from moco_retrieval.contracts import options
from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.contracts.knn import KNN_K, KNN_TEMPERATURE
from moco_retrieval.contracts.options import option

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet18_narrow")
# ResNets narrower than torchvision's: name -> (the torchvision layout they keep, channels of the first stage
# instead of 64; each later stage doubles them). resnet18_narrow is ResNet-18 at a quarter of the widths, for
# small images on CPUs with the small stem.
NARROW_RESNETS = {"resnet18_narrow": ("resnet18", 16)}
VITS = ("vit_tiny", "vit_small", "vit_base")
ARCHS = RESNETS + VITS
# The kernel of each ResNet stem's first convolution: all a weights file can tell of its stem (the max-pool
# holds no weights, so an ImageNet-stem file fits ``nopool`` too).
STEM_KERNEL = {"imagenet": 7, "nopool": 7, "small": 3}
STEMS = ("auto", *STEM_KERNEL)
AUTO_WORD_OPTIONS = ("stem", "arch")  # left unset as the word "auto" (every other option: None)
RECIPES = ("auto", "paper")
# Why a CPU trains in fp32 unless --amp asks for bf16 (the figures: docs/ARCHITECTURE.md, "Measured lessons").
CPU_FP32_WHY = "bf16 autocast measured 0.92-1.49x fp32's speed on CPUs and learned less per step"

# Fields that define the model, the data order or the objective: a resumed run must match them.
RESUME_MUST_MATCH = (
    "moco_version",
    "arch",
    "stem",
    "patch_size",
    "image_size",
    "batch_size",
    "dim",
    "mlp_hidden",
    "queue_size",
    "temperature",
    "seed",
    "bn_splits",
    "recipe",
    "time_budget",
    "init",
    "small_crops",
    "small_crop_size",
    "symmetric",
)
GROUPS = ("model", "recipe and schedule", "running", "k-NN monitor")


def left_to_recipe(name: str, value) -> bool:
    """True when ``value`` of option ``name`` means "the recipe chooses": ``None``, or ``auto`` for
    :data:`AUTO_WORD_OPTIONS`. The recipe fills such options; a resumed run takes them from its checkpoint."""
    return value is None or (name in AUTO_WORD_OPTIONS and value == "auto")


def _default_workers() -> int:
    return min(4, os.cpu_count() or 1)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|d)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``"30m"`` -> 1800.0 seconds (units s, m, h, d; a bare number is minutes). Raises ConfigError."""
    match = _DURATION.match(str(text))
    if not match:
        raise ConfigError(f"--time-budget {text!r} is not a duration; use e.g. 90s, 30m, 2h or 1.5h")
    value, unit = float(match.group(1)), (match.group(2) or "m").lower()
    seconds = value * _UNIT_SECONDS[unit]
    if seconds <= 0:
        raise ConfigError(f"--time-budget must be positive, got {text!r}")
    return seconds


def _positive(name: str, value: float) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")


@dataclass
class TrainConfig:
    """Everything needed to (re)build and train a MoCo model. See ``moco train --help`` for each option."""

    data_dir: str = option("", "folder of training images", "running", cli=False)
    out_dir: str = option("", "run directory", "running", cli=False)
    # -- model --------------------------------------------------------------------------------------------------
    moco_version: int = option(
        2,
        "2: MoCo v2 (a queue of negatives, SGD); 3: MoCo v3 (symmetric in-batch loss, "
        "a predictor, no queue; LARS for ResNets, AdamW for ViTs)",
        "model",
        choices=(2, 3),
    )
    arch: str = option(
        "auto",
        "backbone network; resnet18 trains fastest; resnet18_narrow is ResNet-18 at a quarter of its "
        "channels (a 128-d feature) that keeps small images' resolution (--stem small) at about resnet18's "
        "cost; vit_* need --moco-version 3; auto: "
        "the --init file's, else chosen for the device (see the recipe below)",
        "model",
        choices=("auto",) + ARCHS,
    )
    init: str | None = option(
        None,
        "start from these weights instead of random ones: a local torchvision or timm "
        "state dict (.pth/.pt/.bin/.safetensors), a facebookresearch/moco or moco-v3 "
        "checkpoint, or a moco-retrieval run; the architecture is read from the file",
        "model",
        metavar="SOURCE",
    )
    stem: str = option(
        "auto",
        "ResNet first layers: 'imagenet' downsamples 4x (7x7 stride-2 conv and a max-pool); 'nopool' leaves "
        "out the max-pool (2x the resolution, about 3x the compute); 'small' keeps the resolution of 32-96 px "
        "images (3x3 stride-1 conv, about 9x the compute); auto: see --recipe",
        "model",
        choices=STEMS,
    )
    patch_size: int = option(
        0, "ViT patch size in pixels (0 = auto: 16, 8 at 96 px and below, 4 at 32 px and below)", "model"
    )
    image_size: int | None = option(
        None,
        "training crop size in pixels (square); auto: from the device and the images' own sizes "
        "(see the recipe below; the papers' 224 with --recipe paper)",
        "model",
    )
    dim: int | None = option(None, "projection output dimension used by the loss (v2 128, v3 256)", "model")
    mlp_hidden: int | None = option(
        None,
        "hidden width of the projection (and v3 prediction) head; 0 = the backbone's width (v2 0, v3 4096)",
        "model",
    )
    queue_size: int | None = option(
        None,
        "v2: negative keys remembered from past batches, a multiple of the "
        "batch (paper 65536, auto: see the recipe below; always at most half the images)",
        "model",
    )
    momentum: float | None = option(
        None,
        "how slowly the key encoder follows the query encoder, 0-1 (paper v2 "
        "0.999, v3 0.99 rising to 1; auto: 1 - 1/tau with tau 5%% of the run)",
        "model",
    )
    temperature: float | None = option(
        None, "softmax temperature of the contrastive loss (paper v2 0.2, v3 1.0 ResNet / 0.2 ViT; auto 0.2)", "model"
    )
    symmetric: bool = option(
        False,
        "v2: each view is also a query against the other's key, the loss the mean of both (as in MoCo "
        "v3 and the MoCo CIFAR demo); twice the encoder work per step",
        "model",
    )
    bn_splits: int = option(
        0,
        "v2: batch-norm groups in one process so BN cannot reveal the positive pair (0 = "
        "auto: up to 8 groups of at least 16 images; 1 under torchrun)",
        "model",
    )
    # -- recipe and schedule ------------------------------------------------------------------------------------
    recipe: str = option(
        "auto",
        "how options left unset are chosen: 'auto' derives them from your batch size, "
        "data size and time budget with what learned in short runs (config.json says "
        "why); 'paper' uses the MoCo papers' values, made for batches of 256-4096 and "
        "hundreds of epochs",
        "recipe and schedule",
        choices=RECIPES,
    )
    time_budget: str | None = option(
        None,
        "train for this long (90s, 30m, 2h) instead of --epochs: the first "
        "minute's throughput sets the number of steps (set again at half and at "
        "four fifths of the budget from the speed since), the schedules span the "
        "budget, and the "
        "run stops on time with a checkpoint",
        "recipe and schedule",
        metavar="DURATION",
    )
    epochs: int | None = option(None, "passes over the data (default 200 without --time-budget)", "recipe and schedule")
    batch_size: int | None = option(
        None,
        "images per step, summed over all processes/GPUs (paper 256; auto: by data size, 32-256)",
        "recipe and schedule",
    )
    lr: float | None = option(
        None,
        "base learning rate, x batch/256 unless --no-lr-scale (paper 0.03 v2, 0.6 v3 ResNet, 1.5e-4 ViT)",
        "recipe and schedule",
    )
    lr_scale: bool = option(
        True, "scale --lr by batch/256 (linear scaling rule); --no-lr-scale uses it as given", "recipe and schedule"
    )
    warmup_epochs: float | None = option(
        None,
        "epochs of linear learning-rate warm-up before the cosine decay "
        "(paper: 0 v2, 10%% of the run v3; auto: 1 epoch for v3, at most "
        "10%% of the run)",
        "recipe and schedule",
    )
    weight_decay: float | None = option(
        None, "weight decay (1e-4 v2, 1e-6 LARS, 0.1 AdamW; v3 exempts biases and norms)", "recipe and schedule"
    )
    sgd_momentum: float = option(0.9, "SGD / LARS momentum", "recipe and schedule")
    crop_min_scale: float | None = option(
        None,
        "smallest random crop of a view, as a fraction of the image's area, 0-1 (paper: 0.2 v2, 0.08 v3; "
        "default: the paper's); raise it when small objects do not survive the paper's crops",
        "recipe and schedule",
    )
    blur: bool | None = option(
        None,
        "Gaussian blur in the views (default: the paper's, blur on; --no-blur leaves it out, as SimCLR did "
        "for 32-px CIFAR images, where a sigma of up to 2 px erases the detail)",
        "recipe and schedule",
        action=argparse.BooleanOptionalAction,
    )
    small_crops: int = option(
        0,
        "multi-crop: this many extra crops per image of 5-40%% of its area, at --small-crop-size, each a query "
        "against the key of the second view (MoCo v2 only; 0: the paper's two views)",
        "recipe and schedule",
    )
    small_crop_size: int = option(
        0,
        "side of the small crops in pixels, 8 to --image-size (0: half of --image-size)",
        "recipe and schedule",
    )
    # -- running ------------------------------------------------------------------------------------------------
    workers: int = option(
        _default_workers,
        "processes that decode images into the cache and gather batches (default: min(4, CPU cores))",
        "running",
    )
    device: str = option("auto", "auto (GPU when usable), cpu, cuda or cuda:N", "running")
    amp: bool | None = option(
        None,
        f"bfloat16 mixed precision (default: on for GPUs, off on CPUs: {CPU_FP32_WHY}; --no-amp refuses it; "
        "refused on a CPU at sizes where a ResNet's strided convolution reads a 1x1 map, 16 px and less with "
        "the ImageNet stem: its bf16 gradients there are garbage)",
        "running",
        action=argparse.BooleanOptionalAction,
    )
    compile: bool = option(False, "torch.compile the encoders (slow start, faster GPU steps)", "running")
    seed: int = option(0, "seed of initialisation, data order and augmentation", "running")
    cache_dir: str | None = option(
        None,
        "where decoded images are cached (default: $MOCO_CACHE_DIR, else "
        "~/.cache/moco-retrieval); shared by later runs on the same folder",
        "running",
        metavar="DIR",
    )
    save_every: int | None = option(
        None,
        "keep a numbered checkpoint every N epochs (default: every 10, or fewer so that a run keeps about "
        "10: each is a full checkpoint, 138 MB for ResNet-18)",
        "running",
    )
    save_every_steps: int = option(
        0,
        "also save checkpoint_last.pt every N steps inside an epoch, so a killed run "
        "loses at most N steps (0: at epoch ends; Ctrl-C always saves)",
        "running",
    )
    log_every: int = option(10, "write a metrics.jsonl line every N steps", "running")
    # -- k-NN monitor -------------------------------------------------------------------------------------------
    knn_dir: str | None = option(
        None,
        "labeled folder (one subfolder per class, or train/ and val/) to report "
        "k-NN accuracy on; default: DATA_DIR itself when it has class subfolders",
        "k-NN monitor",
        metavar="DIR",
    )
    knn_every: int | None = option(
        None,
        "evaluate k-NN every N epochs (0 = never; default: about 10 times per "
        "run, and always at the start and the end)",
        "k-NN monitor",
    )
    knn_k: int = option(KNN_K, "neighbours that vote", "k-NN monitor")
    knn_temperature: float = option(KNN_TEMPERATURE, "vote weight exp(similarity / T)", "k-NN monitor")
    knn_max_images: int = option(
        5000, "cap on images the monitor uses per split (a fixed, even spread)", "k-NN monitor"
    )
    # -- set by the run -----------------------------------------------------------------------------------------
    run_id: str = option("", "set when the run starts; kept across resumes", "running", cli=False)
    derived: dict = option(dict, "value and reason of every option the recipe chose", "running", cli=False)
    init_report: dict = option(
        dict, "what --init loaded, left fresh and ignored (trainer.pretrained)", "running", cli=False
    )
    extra: dict = option(dict, "free-form notes carried into config.json", "running", cli=False)

    def __post_init__(self) -> None:
        if self.moco_version not in (2, 3):
            raise ConfigError(f"--moco-version must be 2 or 3, got {self.moco_version}")
        if self.arch not in ARCHS and self.arch != "auto":
            raise ConfigError(f"unknown --arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.arch in VITS and self.moco_version != 3:
            raise ConfigError(f"--arch {self.arch} needs --moco-version 3 (MoCo v2 trains ResNets only)")
        if self.stem not in STEMS:
            raise ConfigError(f"unknown --stem {self.stem!r}; choose one of {', '.join(STEMS)}")
        if self.recipe not in RECIPES:
            raise ConfigError(f"unknown --recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if self.time_budget is not None:
            parse_duration(self.time_budget)
            if self.epochs is not None and not self.derived.get("epochs"):
                raise ConfigError("give either --epochs or --time-budget, not both")
        for name in (
            "image_size",
            "epochs",
            "batch_size",
            "lr",
            "temperature",
            "dim",
            "knn_k",
            "knn_temperature",
            "knn_max_images",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "warmup_epochs",
            "weight_decay",
            "workers",
            "mlp_hidden",
            "bn_splits",
            "knn_every",
            "queue_size",
            "patch_size",
            "save_every_steps",
            "small_crops",
            "small_crop_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.image_size is not None and self.image_size < 16:
            raise ConfigError(f"--image-size must be at least 16 pixels, got {self.image_size}")
        if self.arch in VITS and self.image_size is not None and self.resolved_patch_size > self.image_size // 2:
            raise ConfigError(
                f"--patch-size {self.resolved_patch_size} leaves fewer than 4 patches in a "
                f"{self.image_size} px image; use --patch-size {max(1, self.image_size // 8)} "
                f"or larger images"
            )
        if self.small_crops and (self.moco_version != 2 or self.arch in VITS):
            raise ConfigError("--small-crops needs MoCo v2 with a ResNet (--moco-version 2)")
        if self.symmetric and (self.moco_version != 2 or self.small_crops):
            raise ConfigError("--symmetric is for MoCo v2 without --small-crops (MoCo v3's loss is symmetric already)")
        if self.small_crop_size and not 8 <= self.small_crop_size <= (self.image_size or self.small_crop_size):
            raise ConfigError(
                f"--small-crop-size must be at least 8 and at most --image-size, got {self.small_crop_size}"
            )
        if self.crop_min_scale is not None and not 0.0 < self.crop_min_scale <= 1.0:
            raise ConfigError(f"--crop-min-scale must be in (0, 1], got {self.crop_min_scale}")
        if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.epochs is not None and self.warmup_epochs is not None and self.warmup_epochs >= self.epochs:
            raise ConfigError(f"--warmup-epochs ({self.warmup_epochs}) must be less than --epochs ({self.epochs})")
        if (
            self.moco_version == 2
            and self.queue_size is not None
            and self.batch_size is not None
            and self.queue_size % self.batch_size
        ):
            raise ConfigError(
                f"--queue-size {self.queue_size} is not a multiple of the global --batch-size {self.batch_size}; "
                f"try --queue-size {max(1, round(self.queue_size / self.batch_size)) * self.batch_size}"
            )
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"unknown --device {self.device!r}; use auto, cpu, cuda or cuda:N")
        if (self.save_every is not None and self.save_every < 1) or self.log_every < 1:
            raise ConfigError("--save-every and --log-every must be at least 1")

    # -- derived values -------------------------------------------------------------------------------------------
    @property
    def budget_seconds(self) -> float | None:
        """The time budget in seconds, or None when the run is planned in epochs."""
        return parse_duration(self.time_budget) if self.time_budget is not None else None

    @property
    def effective_lr(self) -> float:
        """The peak learning rate after the linear scaling rule."""
        return self.lr * self.batch_size / 256 if self.lr_scale else self.lr

    @property
    def resolved_patch_size(self) -> int:
        """The ViT patch size: as configured, or 16, 8 (<= 96 px) or 4 (<= 32 px) when ``patch_size`` is 0."""
        if self.patch_size:
            return self.patch_size
        return 4 if self.image_size <= 32 else 8 if self.image_size <= 96 else 16

    @property
    def resolved_small_crop_size(self) -> int:
        """The side of multi-crop's small crops: as configured, or half of ``image_size``."""
        return self.small_crop_size or self.image_size // 2

    @property
    def resolved_stem(self) -> str:
        """The ResNet stem; ``auto`` left unresolved by a recipe means small at 96 px and below."""
        if self.stem != "auto":
            return self.stem
        return "small" if self.image_size <= 96 else "imagenet"

    # -- JSON -----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        return cls.from_json(Path(path).read_text())

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


# -- the command line -----------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per command-line field of :class:`TrainConfig`, grouped, with the field's help and default."""
    options.add_arguments(parser, TrainConfig, GROUPS)


def from_arguments(args: argparse.Namespace, **fixed) -> TrainConfig:
    """The :class:`TrainConfig` of parsed arguments (``fixed`` sets the non-flag fields: data_dir, out_dir)."""
    return options.from_arguments(TrainConfig, args, **fixed)
