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

from trainer.errors import ConfigError

RESNETS = ("resnet18", "resnet34", "resnet50")
VITS = ("vit_tiny", "vit_small", "vit_base")
ARCHS = RESNETS + VITS
STEMS = ("auto", "imagenet", "small")

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
    """Everything needed to (re)build and train a MoCo model. Defaults are MoCo v2's (He et al. / Chen et al.)."""

    data_dir: str  # folder of training images (recursive; labels from first-level subfolders are optional)
    out_dir: str  # run directory: config.json, checkpoints, metrics.jsonl, metrics.png
    moco_version: int = 2  # 2: queue of negatives (MoCo v2); 3: symmetric in-batch loss + predictor (MoCo v3)
    arch: str = "resnet50"  # backbone: resnet18/34/50 (torchvision) or vit_tiny/small/base (timm)
    stem: str = "auto"  # ResNet stem: imagenet (7x7 stride 2 + max-pool), small (3x3 stride 1), auto: small <= 96 px
    patch_size: int = 0  # ViT patch size; 0 = 16, or 4/8 for images of 96 px and below
    image_size: int = 224  # training crop size in pixels (square)
    epochs: int = 200  # passes over the data
    batch_size: int = 256  # global batch: summed over all processes
    lr: float = 0.03  # base learning rate; multiplied by batch_size/256 when lr_scale is on
    lr_scale: bool = True  # linear scaling rule: effective lr = lr * batch_size / 256
    warmup_epochs: float = 0.0  # linear warm-up before the cosine decay (fractions allowed)
    weight_decay: float = 1e-4  # SGD weight decay
    sgd_momentum: float = 0.9  # SGD momentum
    queue_size: int = 65536  # MoCo v2 negatives kept in the queue; must be a multiple of batch_size
    momentum: float = 0.999  # key (momentum) encoder EMA coefficient
    temperature: float = 0.2  # InfoNCE softmax temperature
    dim: int = 128  # projection output dimension
    mlp_hidden: int = 0  # projection hidden width; 0 = the backbone's feature width (2048 for ResNet-50)
    bn_splits: int = 0  # split-BN groups in one process (shuffle-BN stand-in); 0 = auto (8 alone, 1 under DDP)
    workers: int = 4  # data-loading processes per training process (0 = load in the main process)
    device: str = "auto"  # auto (GPU if usable), cpu, cuda or cuda:N
    amp: bool | None = None  # bfloat16 autocast; None = on for CUDA, off for CPU
    compile: bool = False  # torch.compile the encoders (slower start, faster steps on GPU)
    seed: int = 0  # seeds data order, augmentations and initialisation
    knn_dir: str | None = None  # labeled folder for the k-NN monitor; None = the training folder if labeled
    knn_every: int = 1  # run the k-NN monitor every N epochs (0 = never)
    knn_k: int = 20  # neighbours voting in the k-NN monitor
    knn_temperature: float = 0.07  # vote weight exp(similarity / T)
    knn_max_images: int = 5000  # cap on images used by the monitor (a fixed subset)
    save_every: int = 10  # also keep checkpoint_XXXX.pt every N epochs (checkpoint_last.pt every epoch)
    log_every: int = 10  # write a metrics.jsonl line every N steps
    run_id: str = ""  # set when the run starts; kept across resumes
    extra: dict = field(default_factory=dict)  # free-form notes carried into config.json

    def __post_init__(self) -> None:
        if self.moco_version not in (2, 3):
            raise ConfigError(f"--moco-version must be 2 or 3, got {self.moco_version}")
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown --arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.stem not in STEMS:
            raise ConfigError(f"unknown --stem {self.stem!r}; choose one of {', '.join(STEMS)}")
        for name in ("image_size", "epochs", "batch_size", "lr", "queue_size", "temperature", "dim", "knn_k"):
            _positive(name, getattr(self, name))
        for name in ("warmup_epochs", "weight_decay", "workers", "mlp_hidden", "bn_splits", "knn_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.image_size < 16:
            raise ConfigError(f"--image-size must be at least 16 pixels, got {self.image_size}")
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
    @property
    def effective_lr(self) -> float:
        """The peak learning rate after the linear scaling rule."""
        return self.lr * self.batch_size / 256 if self.lr_scale else self.lr

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
