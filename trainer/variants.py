"""The three MoCo variants as objects: MoCo v2 (ResNet), MoCo v3 with a ResNet, MoCo v3 with a ViT.

Each holds everything that differs between them: the papers' hyper-parameters, the model and its heads, the
optimizer, the two augmentation views, the key-encoder momentum schedule and the batch-norm policy. The loop
asks :func:`variant_for` once and never branches on the version or the backbone again.

References: Chen et al. 2020, "Improved Baselines with Momentum Contrastive Learning" (v2); Chen, Xie and He
2021, "An Empirical Study of Training Self-Supervised Vision Transformers" (v3, the reference code's ResNet-50
100-epoch and ViT recipes).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.trainer.backbones import build_resnet, build_vit
from moco_retrieval.trainer.batch_augment import MOCO_V2_VIEW, MOCO_V3_VIEWS, ViewSpec
from moco_retrieval.trainer.config import VITS, TrainConfig
from moco_retrieval.trainer.lars import LARS
from moco_retrieval.trainer.moco import MoCo, MoCoV2, MoCoV3
from moco_retrieval.trainer.recipe_table import PAPER

MIN_BN_GROUP = 16  # split-BN groups of fewer images give statistics too noisy to learn from (4 per group stalls)


def _fused(model: nn.Module) -> bool:
    # fused kernels (one pass over all parameters): measured on 2 CPU cores, an AdamW step of ViT-Tiny v3 takes
    # 15 ms instead of 137 ms and an SGD step of ResNet-18 v2 5 ms instead of 13 ms
    return all(p.device.type in ("cpu", "cuda") for p in model.parameters())


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters split into ``(decayed, exempt)``: weight matrices and conv kernels are decayed;
    biases and normalisation weights (every parameter with fewer than 2 dimensions) are exempt."""
    decayed, exempt = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decayed if p.ndim > 1 else exempt).append(p)
    return decayed, exempt


class Variant:
    """What one MoCo variant is made of. ``paper`` holds the published values of the options a recipe fills
    (:data:`trainer.recipe_table.PAPER`, beside the auto rules); ``warmup`` there is a fraction of the run."""

    name = ""
    paper: dict = {}

    def build_model(self, cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
        """The randomly initialised MoCo model of ``cfg``, on the CPU."""
        raise NotImplementedError

    def build_optimizer(self, cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over the trainable parameters (the lr is set every step by the schedule)."""
        raise NotImplementedError

    def views(self) -> tuple[ViewSpec, ViewSpec]:
        """The augmentation distributions of the two views."""
        raise NotImplementedError

    def key_momentum(self, m0: float, progress: float) -> float:
        """The key encoder's EMA coefficient at ``progress`` (0 at the start, 1 at the end of the run)."""
        raise NotImplementedError

    def bn_splits(self, requested: int, per_process_batch: int, world_size: int) -> int:
        """Split-BN groups of the backbone (1: plain BN)."""
        return 1

    def sync_bn(self, world_size: int, device: torch.device) -> bool:
        """Whether batch norm is synchronised over all processes."""
        return False

    @property
    def memory_format(self) -> torch.memory_format:
        """Channels-last for ResNets on every device (on 2 CPU cores a ResNet-18 step at 32 px is 19% faster;
        on GPUs it is what tensor-core convolutions want); ViTs keep the default layout."""
        return torch.channels_last


class MoCoV2Variant(Variant):
    """MoCo v2: ResNet, MLP projector, a queue of negatives with shuffle-BN, SGD, constant key momentum."""

    name = "MoCo v2"
    paper = PAPER["v2"]

    def build_model(self, cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
        backbone, feature_dim = build_resnet(cfg.arch, cfg.resolved_stem, bn_splits)
        return MoCoV2(backbone, feature_dim, cfg.dim, cfg.mlp_hidden, cfg.temperature, cfg.queue_size, cfg.symmetric)

    def build_optimizer(self, cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.SGD(
            params, lr=cfg.effective_lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay, fused=_fused(model)
        )

    def views(self) -> tuple[ViewSpec, ViewSpec]:
        return MOCO_V2_VIEW, MOCO_V2_VIEW

    def key_momentum(self, m0: float, progress: float) -> float:
        return m0

    def bn_splits(self, requested: int, per_process_batch: int, world_size: int) -> int:
        """As requested, or in one process up to 8 groups of at least ``MIN_BN_GROUP`` images (1 under DDP, where
        shuffle-BN across processes does the job)."""
        if requested:
            if per_process_batch % requested:
                raise ConfigError(f"--bn-splits {requested} must divide the per-process batch {per_process_batch}")
            return requested
        if world_size > 1:
            return 1
        return max(
            g for g in range(1, 9) if g == 1 or per_process_batch % g == 0 and per_process_batch // g >= MIN_BN_GROUP
        )


class MoCoV3Variant(Variant):
    """MoCo v3: projector and predictor with BN, a symmetric in-batch loss, no queue, key momentum rising
    from m0 to 1 on a half cosine, asymmetric views; SyncBN over the global batch on GPUs."""

    def views(self) -> tuple[ViewSpec, ViewSpec]:
        return MOCO_V3_VIEWS

    def key_momentum(self, m0: float, progress: float) -> float:
        return 1.0 - 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (1.0 - m0)

    def sync_bn(self, world_size: int, device: torch.device) -> bool:
        # torch's SyncBatchNorm has no CPU kernel: gloo/CPU runs keep per-process BN
        return world_size > 1 and device.type == "cuda"


class MoCoV3ResNetVariant(MoCoV3Variant):
    """MoCo v3 with a ResNet: 2-layer projector, LARS without decay or trust ratio on biases and norms."""

    name = "MoCo v3 (ResNet)"
    paper = PAPER["v3_resnet"]

    def build_model(self, cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
        backbone, feature_dim = build_resnet(cfg.arch, cfg.resolved_stem, 1)
        return MoCoV3(
            backbone, feature_dim, cfg.dim, cfg.mlp_hidden, cfg.temperature, projector_layers=2, predictor_last_bn=False
        )

    def build_optimizer(self, cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
        decayed, exempt = decay_groups(model)
        return LARS(
            [{"params": decayed}, {"params": exempt, "lars_exclude": True}],
            lr=cfg.effective_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.sgd_momentum,
        )


class MoCoV3ViTVariant(MoCoV3Variant):
    """MoCo v3 with a ViT: 3-layer projector, a predictor ending in an affine-free BN, AdamW without decay on
    biases and norms, a frozen random patch projection."""

    name = "MoCo v3 (ViT)"
    paper = PAPER["v3_vit"]

    def build_model(self, cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
        backbone, feature_dim = build_vit(cfg.arch, cfg.image_size, cfg.resolved_patch_size)
        return MoCoV3(
            backbone, feature_dim, cfg.dim, cfg.mlp_hidden, cfg.temperature, projector_layers=3, predictor_last_bn=True
        )

    def build_optimizer(self, cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
        decayed, exempt = decay_groups(model)
        return torch.optim.AdamW(
            [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": exempt, "weight_decay": 0.0}],
            lr=cfg.effective_lr,
            fused=_fused(model),
        )

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.contiguous_format


def variant_for(cfg: TrainConfig) -> Variant:
    """The variant of ``cfg.moco_version`` and ``cfg.arch`` (a pair ``TrainConfig`` has already validated)."""
    if cfg.moco_version == 2:
        return MoCoV2Variant()
    return MoCoV3ViTVariant() if cfg.arch in VITS else MoCoV3ResNetVariant()


def build_model(cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
    """The MoCo model of ``cfg`` (randomly initialised, on the CPU); shape options left unset (a config no
    recipe has resolved, as in tests and benchmarks) take the paper's values."""
    variant = variant_for(cfg)
    shape = {
        name: variant.paper[name]
        for name in ("dim", "mlp_hidden", "temperature", "queue_size")
        if getattr(cfg, name) is None
    }
    return variant.build_model(cfg.replace(**shape) if shape else cfg, bn_splits)
