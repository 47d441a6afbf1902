"""Factories that turn a :class:`TrainConfig` into the model, its transforms, optimizer and schedules.

The training loop only calls these, so a new method or backbone is added here, not in the loop.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainer.augment import TwoViews, moco_v2_view
from trainer.backbones import build_resnet
from trainer.config import RESNETS, TrainConfig
from trainer.errors import ConfigError
from trainer.moco import MoCo, MoCoV2


def build_backbone(cfg: TrainConfig, bn_splits: int = 1) -> tuple[nn.Module, int]:
    """The backbone named by ``cfg.arch``: ``(module mapping [N,3,H,W] -> [N,D], D)``."""
    if cfg.arch in RESNETS:
        return build_resnet(cfg.arch, cfg.resolved_stem, bn_splits)
    raise ConfigError(f"--arch {cfg.arch} needs --moco-version 3")


def build_model(cfg: TrainConfig, bn_splits: int = 1) -> MoCo:
    """The MoCo model of ``cfg`` (randomly initialised, on the CPU)."""
    backbone, feature_dim = build_backbone(cfg, bn_splits)
    if cfg.moco_version == 2:
        return MoCoV2(backbone, feature_dim, cfg.dim, cfg.mlp_hidden, cfg.temperature, cfg.queue_size)
    raise ConfigError(f"--moco-version {cfg.moco_version} is not supported")


def build_transform(cfg: TrainConfig) -> TwoViews:
    """The two-view augmentation of ``cfg``'s MoCo version at ``cfg.image_size``."""
    return TwoViews(moco_v2_view(cfg.image_size))


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (momentum, weight decay) over the trainable parameters; the lr is set every step by the schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=cfg.effective_lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay)


def lr_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Learning rate at optimizer step ``step``: linear warm-up, then half-cosine decay to 0 at the end."""
    total = cfg.epochs * steps_per_epoch
    warmup = int(cfg.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return cfg.effective_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.effective_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def key_momentum_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Momentum of the key encoder's EMA at ``step`` (constant in MoCo v2)."""
    return cfg.momentum
