"""Factories that turn a :class:`TrainConfig` into the model, its transforms, optimizer and schedules.

The training loop only calls these, so a new method or backbone is added here, not in the loop.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from contracts.errors import ConfigError
from trainer.augment import TwoViews, moco_v2_view, moco_v3_views
from trainer.backbones import build_resnet, build_vit
from trainer.config import RESNETS, VITS, TrainConfig
from trainer.lars import LARS
from trainer.moco import MoCo, MoCoV2, MoCoV3


def build_backbone(cfg: TrainConfig, bn_splits: int = 1) -> tuple[nn.Module, int]:
    """The backbone named by ``cfg.arch``: ``(module mapping [N,3,H,W] -> [N,D], D)``."""
    if cfg.arch in RESNETS:
        return build_resnet(cfg.arch, cfg.resolved_stem, bn_splits)
    if cfg.arch in VITS:
        return build_vit(cfg.arch, cfg.image_size, cfg.resolved_patch_size)
    raise ConfigError(f"unknown --arch {cfg.arch}")


def build_model(cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
    """The MoCo model of ``cfg`` (randomly initialised, on the CPU).

    ``bn_splits`` is v2's single-process stand-in for shuffle-BN; v3 has no shuffle-BN and ignores it.
    """
    if cfg.moco_version == 2:
        backbone, feature_dim = build_backbone(cfg, bn_splits)
        return MoCoV2(backbone, feature_dim, cfg.dim, cfg.mlp_hidden, cfg.temperature, cfg.queue_size)
    if cfg.moco_version == 3:
        backbone, feature_dim = build_backbone(cfg, 1)
        vit = cfg.arch in VITS
        return MoCoV3(backbone, feature_dim, cfg.dim, cfg.mlp_hidden, cfg.temperature,
                      projector_layers=3 if vit else 2, predictor_last_bn=vit)
    raise ConfigError(f"--moco-version {cfg.moco_version} is not supported")


def memory_format(cfg: TrainConfig) -> torch.memory_format:
    """Channels-last for ResNets on every device (on 2 CPU cores a ResNet-18 step at 32 px is 19% faster; on
    GPUs it is what tensor-core convolutions want); ViTs keep the default layout."""
    return torch.channels_last if cfg.arch in RESNETS else torch.contiguous_format


def build_transform(cfg: TrainConfig) -> TwoViews:
    """The two-view augmentation of ``cfg``'s MoCo version at ``cfg.image_size`` (asymmetric views in v3)."""
    if cfg.moco_version == 3:
        return TwoViews(*moco_v3_views(cfg.image_size))
    return TwoViews(moco_v2_view(cfg.image_size))


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters split into ``(decayed, exempt)``: weight matrices and conv kernels are decayed;
    biases and normalisation weights (every parameter with fewer than 2 dimensions) are exempt."""
    decayed, exempt = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decayed if p.ndim > 1 else exempt).append(p)
    return decayed, exempt


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The paper's optimizer over the trainable parameters; the lr is set every step by the schedule.

    v2: SGD with momentum and weight decay on everything. v3: LARS for ResNets, AdamW for ViTs, both with
    biases and norm weights exempt from weight decay (and, for LARS, from the trust ratio). Frozen
    parameters (the ViT patch projection and position table, the key encoder) are never handed over.
    """
    # fused kernels (one pass over all parameters): measured on 2 CPU cores, an AdamW step of ViT-Tiny v3 takes
    # 15 ms instead of 137 ms and an SGD step of ResNet-18 v2 5 ms instead of 13 ms
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    if cfg.moco_version == 2:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=cfg.effective_lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay,
                               fused=fused)
    decayed, exempt = decay_groups(model)
    if cfg.arch in VITS:
        return torch.optim.AdamW([{"params": decayed, "weight_decay": cfg.weight_decay},
                                  {"params": exempt, "weight_decay": 0.0}], lr=cfg.effective_lr, fused=fused)
    return LARS([{"params": decayed}, {"params": exempt, "lars_exclude": True}], lr=cfg.effective_lr,
                weight_decay=cfg.weight_decay, momentum=cfg.sgd_momentum)


def lr_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Learning rate at optimizer step ``step``: linear warm-up, then half-cosine decay to 0 at the end."""
    total = cfg.epochs * steps_per_epoch
    warmup = int(cfg.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return cfg.effective_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.effective_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def key_momentum_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Momentum of the key encoder's EMA at ``step``: constant in MoCo v2; in MoCo v3 it rises from
    ``cfg.momentum`` to 1 on a half cosine over the whole run, ``1 - (1 - m0) * (1 + cos(pi * t)) / 2``."""
    if cfg.moco_version == 2:
        return cfg.momentum
    progress = step / max(1, cfg.epochs * steps_per_epoch)
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - cfg.momentum)
