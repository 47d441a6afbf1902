"""The typed training configuration: one dataclass, validated on construction, round-tripping to JSON.

The CLI builds a :class:`TrainConfig` and nothing more; ``__post_init__`` checks every value so a bad option
fails before anything is written. ``config.json`` in a run directory is ``TrainConfig.to_json()``; a resumed
run rebuilds its model from it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from contracts.errors import ConfigError
from contracts.knn import KNN_K, KNN_TEMPERATURE

RESNETS = ("resnet18", "resnet34", "resnet50")
VITS = ("vit_tiny", "vit_small", "vit_base")
ARCHS = RESNETS + VITS
STEMS = ("auto", "imagenet", "small")

# Paper defaults the user did not override (a field left at None): MoCo v2 (Chen et al. 2020) for every arch;
# MoCo v3 (Chen, Xie, He 2021, the reference code's ResNet-50 100-epoch and ViT recipes) per backbone family.
# warmup_epochs is the fraction of --epochs the paper warms up for (10 of 100 epochs, 40 of 300).
V2_DEFAULTS = dict(lr=0.03, weight_decay=1e-4, warmup_epochs=0.0, queue_size=65536, momentum=0.999, temperature=0.2,
                   dim=128, mlp_hidden=0)
V3_RESNET_DEFAULTS = dict(lr=0.6, weight_decay=1e-6, warmup_epochs=10 / 100, queue_size=0, momentum=0.99,
                          temperature=1.0, dim=256, mlp_hidden=4096)
V3_VIT_DEFAULTS = dict(lr=1.5e-4, weight_decay=0.1, warmup_epochs=40 / 300, queue_size=0, momentum=0.99,
                       temperature=0.2, dim=256, mlp_hidden=4096)

# Fields that define the model, the data order or the objective: a resumed run must match them.
RESUME_MUST_MATCH = (
    "moco_version", "arch", "stem", "patch_size", "image_size", "batch_size", "dim", "mlp_hidden", "queue_size",
    "temperature", "seed", "bn_splits",
)


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")


@dataclass
class TrainConfig:
    """Everything needed to (re)build and train a MoCo model.

    Fields marked "paper default" may be left at ``None``: construction fills them with the published values
    for the chosen ``moco_version`` and ``arch`` (:data:`V2_DEFAULTS`, :data:`V3_RESNET_DEFAULTS`,
    :data:`V3_VIT_DEFAULTS`), so ``config.json`` always holds concrete numbers.
    """

    data_dir: str  # folder of training images (recursive; labels from first-level subfolders are optional)
    out_dir: str  # run directory: config.json, checkpoints, metrics.jsonl, metrics.png
    moco_version: int = 2  # 2: queue of negatives (MoCo v2); 3: symmetric in-batch loss + predictor (MoCo v3)
    arch: str = "resnet50"  # backbone: resnet18/34/50 (torchvision) or vit_tiny/small/base (timm)
    stem: str = "auto"  # ResNet stem: imagenet (7x7 stride 2 + max-pool), small (3x3 stride 1), auto: small <= 96 px
    patch_size: int = 0  # ViT patch size; 0 = auto: 16, 8 for images of 96 px and below, 4 for 32 px and below
    image_size: int = 224  # training crop size in pixels (square)
    epochs: int = 200  # passes over the data
    batch_size: int = 256  # global batch: summed over all processes
    # base learning rate, x batch_size/256 when lr_scale is on (paper default: 0.03 v2; v3: 0.6 ResNet, 1.5e-4 ViT)
    lr: float | None = None
    lr_scale: bool = True  # linear scaling rule: effective lr = lr * batch_size / 256
    # linear warm-up before the cosine decay, fractions allowed (paper default: 0 v2; v3: 10% / 13.3% of --epochs
    # for ResNet / ViT, i.e. 10 of 100 and 40 of 300)
    warmup_epochs: float | None = None
    # weight decay (paper default: 1e-4 v2 SGD; v3: 1e-6 LARS, 0.1 AdamW, never on biases and norm weights)
    weight_decay: float | None = None
    sgd_momentum: float = 0.9  # SGD / LARS momentum
    # v2 negatives kept in the queue, a multiple of batch_size (paper default 65536; v3 has no queue and ignores it: 0)
    queue_size: int | None = None
    # key encoder EMA coefficient (paper default 0.999 v2; v3: 0.99 at the start, rising to 1 on a cosine)
    momentum: float | None = None
    temperature: float | None = None  # contrastive softmax temperature (paper default 0.2 v2; v3: 1.0 ResNet, 0.2 ViT)
    dim: int | None = None  # projection output dimension (paper default 128 v2, 256 v3)
    # projector (and v3 predictor) hidden width; 0 = the backbone's width (paper default 0 v2, 4096 v3)
    mlp_hidden: int | None = None
    bn_splits: int = 0  # split-BN groups in one process (shuffle-BN stand-in); 0 = auto (<= 8 groups of >= 16, 1 under DDP)
    workers: int = 4  # data-loading processes per training process (0 = load in the main process)
    device: str = "auto"  # auto (GPU if usable), cpu, cuda or cuda:N
    amp: bool | None = None  # bfloat16 autocast; None = on for CUDA, off for CPU
    compile: bool = False  # torch.compile the encoders (slower start, faster steps on GPU)
    seed: int = 0  # seeds data order, augmentations and initialisation
    knn_dir: str | None = None  # labeled folder for the k-NN monitor; None = the training folder if labeled
    knn_every: int = 1  # run the k-NN monitor every N epochs (0 = never)
    knn_k: int = KNN_K  # neighbours voting in the k-NN monitor
    knn_temperature: float = KNN_TEMPERATURE  # vote weight exp(similarity / T)
    knn_max_images: int = 5000  # cap on images used by the monitor (a fixed subset)
    save_every: int = 10  # also keep checkpoint_XXXX.pt every N epochs (checkpoint_last.pt every epoch)
    save_every_steps: int = 0  # also write checkpoint_last.pt every N steps inside an epoch (0 = only at epoch ends)
    log_every: int = 10  # write a metrics.jsonl line every N steps
    run_id: str = ""  # set when the run starts; kept across resumes
    extra: dict = field(default_factory=dict)  # free-form notes carried into config.json

    def __post_init__(self) -> None:
        if self.moco_version not in (2, 3):
            raise ConfigError(f"--moco-version must be 2 or 3, got {self.moco_version}")
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown --arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.arch in VITS and self.moco_version != 3:
            raise ConfigError(f"--arch {self.arch} needs --moco-version 3 (MoCo v2 trains ResNets only)")
        for name, value in self.paper_defaults().items():
            if getattr(self, name) is None:
                setattr(self, name, value * self.epochs if name == "warmup_epochs" and value else value)
        if self.stem not in STEMS:
            raise ConfigError(f"unknown --stem {self.stem!r}; choose one of {', '.join(STEMS)}")
        for name in ("image_size", "epochs", "batch_size", "lr", "temperature", "dim", "knn_k"):
            _positive(name, getattr(self, name))
        if self.moco_version == 2:
            _positive("queue_size", self.queue_size)
        for name in ("warmup_epochs", "weight_decay", "workers", "mlp_hidden", "bn_splits", "knn_every", "queue_size",
                     "patch_size", "save_every_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.image_size < 16:
            raise ConfigError(f"--image-size must be at least 16 pixels, got {self.image_size}")
        if self.arch in VITS and self.resolved_patch_size > self.image_size // 2:
            raise ConfigError(f"--patch-size {self.resolved_patch_size} leaves fewer than 4 patches in a "
                              f"{self.image_size} px image; use --patch-size {max(1, self.image_size // 8)} "
                              f"or larger images")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.warmup_epochs >= self.epochs:
            raise ConfigError(f"--warmup-epochs ({self.warmup_epochs}) must be less than --epochs ({self.epochs})")
        if self.moco_version == 2 and self.queue_size % self.batch_size:
            raise ConfigError(
                f"--queue-size {self.queue_size} is not a multiple of the global --batch-size {self.batch_size}; "
                f"try --queue-size {max(1, round(self.queue_size / self.batch_size)) * self.batch_size}"
            )
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"unknown --device {self.device!r}; use auto, cpu, cuda or cuda:N")
        if self.save_every < 1 or self.log_every < 1:
            raise ConfigError("--save-every and --log-every must be at least 1")

    # -- derived values -------------------------------------------------------------------------------
    def paper_defaults(self) -> dict:
        """The published hyper-parameters for this MoCo version and backbone (``warmup_epochs`` as a fraction)."""
        if self.moco_version == 2:
            return dict(V2_DEFAULTS)
        return dict(V3_VIT_DEFAULTS if self.arch in VITS else V3_RESNET_DEFAULTS)

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
    def resolved_stem(self) -> str:
        if self.stem != "auto":
            return self.stem
        return "small" if self.image_size <= 96 else "imagenet"

    # -- JSON ----------------------------------------------------------------------------------------
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
