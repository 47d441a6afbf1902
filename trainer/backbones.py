"""Backbones: torchvision ResNets (with an optional small-image stem), timm ViTs (MoCo v3), the split-BN layer.

A backbone maps images ``[N, 3, H, W]`` to features ``[N, D]`` (the classifier removed). These features are
the representation that is exported, indexed and served.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
import torchvision
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.trainer.config import NARROW_RESNETS, RESNETS, STEM_KERNEL, VITS
from moco_retrieval.trainer.small_map_conv import use_small_map_convs


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training statistics are computed over ``num_splits`` groups of the batch.

    This is the single-process stand-in for MoCo's shuffle-BN: with the key batch shuffled before the key
    encoder, a query and its positive key are normalised with statistics of different sub-batches, so BN
    cannot leak which key is the positive. In eval mode (and with one split) it is a plain BatchNorm2d, and
    its state dict is BatchNorm2d's, so exported and evaluated models see ordinary BN.

    The groups are consecutive blocks of the batch (sample ``n`` falls in group ``n // (N / num_splits)``), so
    each is a contiguous slice in any memory layout and goes through the same fused batch-norm kernel as plain
    BN. (Grouping by ``n % num_splits`` as one ``[N/g, g*C, H, W]`` batch is a free view only of an NCHW tensor:
    of a channels-last one it copied each activation out of and back into channels-last at every BN layer.)
    """

    def __init__(self, num_features: int, num_splits: int = 1, **kwargs):
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.num_splits == 1:
            return super().forward(x)
        n, g = x.shape[0], self.num_splits
        if n % g:
            raise ValueError(f"batch of {n} is not divisible into {g} BN splits")
        means = self.running_mean.repeat(g, 1)  # [g, C]: each group updates its own copy of the running statistics
        variances = self.running_var.repeat(g, 1)
        out = torch.cat(
            [
                F.batch_norm(part, means[i], variances[i], self.weight, self.bias, True, self.momentum, self.eps)
                for i, part in enumerate(x.split(n // g))
            ]
        )
        with torch.no_grad():  # keep one set of running statistics: the mean over the groups
            self.running_mean.copy_(means.mean(0))
            self.running_var.copy_(variances.mean(0))
            self.num_batches_tracked.add_(1)
        return out


def build_resnet(arch: str, stem: str = "imagenet", bn_splits: int = 1) -> tuple[nn.Module, int]:
    """A torchvision ResNet without its classifier, randomly initialised.

    Args:
        arch: resnet18, resnet34, resnet50, or resnet18_narrow (ResNet-18 with a quarter of the channels:
            16/32/64/128, a 128-d feature).
        stem: ``imagenet`` (7x7 stride-2 conv + max-pool), ``nopool`` (the same conv, no max-pool: twice the
            resolution through the trunk) or ``small`` (3x3 stride-1 conv, no max-pool) for 32-96 px inputs, as
            in the CIFAR versions of MoCo/SimCLR.
        bn_splits: groups for :class:`SplitBatchNorm2d` (1 = plain BN).

    Returns:
        ``(backbone, feature_dim)``; ``backbone(x)`` maps ``[N, 3, H, W]`` to ``[N, feature_dim]``.
    """
    if arch not in RESNETS:
        raise ConfigError(f"unknown ResNet {arch!r}; choose one of {', '.join(RESNETS)}")
    norm_layer = partial(SplitBatchNorm2d, num_splits=bn_splits) if bn_splits > 1 else nn.BatchNorm2d
    layout, width = NARROW_RESNETS.get(arch, (arch, 64))
    model = getattr(torchvision.models, layout)(weights=None, norm_layer=norm_layer)
    if width != 64:
        _set_widths(model, width)
    if stem == "small":
        model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif stem == "nopool":
        model.maxpool = nn.Identity()
    elif stem not in STEM_KERNEL:
        raise ConfigError(f"unknown stem {stem!r}; use {', '.join(STEM_KERNEL)}")
    feature_dim = model.fc.in_features
    model.fc = nn.Identity()
    return use_small_map_convs(model), feature_dim


def _set_widths(model: torchvision.models.ResNet, width: int) -> None:
    """Rebuild a torchvision ResNet's stem and four stages with ``width`` channels in the first stage (doubling
    at each later one), through torchvision's own ``_make_layer``, initialised as torchvision initialises."""
    block = type(model.layer1[0])
    model.inplanes = width
    model.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = model._norm_layer(width)
    for stage in range(4):
        blocks = len(getattr(model, f"layer{stage + 1}"))
        setattr(
            model, f"layer{stage + 1}", model._make_layer(block, width << stage, blocks, stride=1 if stage == 0 else 2)
        )
    model.fc = nn.Linear(model.inplanes, model.fc.out_features)
    for m in model.modules():  # torchvision ResNet's initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


def set_bn_splits(module: nn.Module, num_splits: int) -> None:
    """Change the split count of every :class:`SplitBatchNorm2d` inside ``module``."""
    for layer in module.modules():
        if isinstance(layer, SplitBatchNorm2d):
            layer.num_splits = num_splits


# (embed_dim, depth, num_heads): DeiT-Tiny, and MoCo v3's ViT-Small (12 heads, not DeiT's 6) and ViT-Base.
VIT_SHAPES = {"vit_tiny": (192, 12, 3), "vit_small": (384, 12, 12), "vit_base": (768, 12, 12)}


def build_vit(arch: str, image_size: int, patch_size: int = 16) -> tuple[nn.Module, int]:
    """A timm VisionTransformer without its classifier, randomly initialised with MoCo v3's stability recipe.

    The patch projection is randomly initialised (Xavier-uniform) and frozen, and the position embedding is
    a fixed 2-D sin-cos table (both ``requires_grad=False``): Chen, Xie and He (2021) found that a frozen
    random patch projection removes the training instability of self-supervised ViTs. Linear layers use
    timm's ``moco`` initialisation (Xavier-uniform, with Q, K and V treated as separate matrices).

    Args:
        arch: vit_tiny, vit_small or vit_base.
        image_size: input side in pixels; the model accepts exactly ``[N, 3, image_size, image_size]``.
        patch_size: patch side in pixels (16 in the paper; 4 or 8 for small images).

    Returns:
        ``(backbone, embed_dim)``; ``backbone(x)`` maps ``[N, 3, H, W]`` to the final-norm class token ``[N, D]``.
    """
    if arch not in VITS:
        raise ConfigError(f"unknown ViT {arch!r}; choose one of {', '.join(VITS)}")
    embed_dim, depth, num_heads = VIT_SHAPES[arch]
    model = VisionTransformer(
        img_size=image_size,
        patch_size=patch_size,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        num_classes=0,
        global_pool="token",
        weight_init="moco",
    )
    with torch.no_grad():
        grid = model.patch_embed.grid_size  # (rows, cols) of patches
        table = build_sincos2d_pos_embed(list(grid), dim=embed_dim)  # [rows*cols, D]
        prefix = torch.zeros(model.num_prefix_tokens, embed_dim)  # the class token gets no position
        model.pos_embed.copy_(torch.cat([prefix, table]).unsqueeze(0))
        proj = model.patch_embed.proj
        bound = math.sqrt(6.0 / float(3 * patch_size * patch_size + embed_dim))  # Xavier-uniform of the flat conv
        nn.init.uniform_(proj.weight, -bound, bound)
        nn.init.zeros_(proj.bias)
    for p in (model.pos_embed, proj.weight, proj.bias):
        p.requires_grad = False
    return model, embed_dim


@torch.no_grad()
def _input_sides(backbone: nn.Module, image_size: int, modules: list[nn.Module]) -> list[int]:
    """The smaller side of the map each of ``modules`` reads, in call order, for a square ``image_size`` px
    input: one forward of a blank image in eval mode (running statistics untouched), on the backbone's
    device; the backbone's mode is restored."""
    sides: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: sides.append(min(args[0].shape[-2:]))) for m in modules]
    was_training = backbone.training
    param = next(backbone.parameters())
    try:
        backbone.eval()
        backbone(torch.zeros(1, 3, image_size, image_size, device=param.device, dtype=param.dtype))
    finally:
        backbone.train(was_training)
        for h in hooks:
            h.remove()
    return sides


def smallest_strided_map(backbone: nn.Module, image_size: int) -> int:
    """The smallest side of a map that a padded, strided convolution of ``backbone`` reads, for a square
    ``image_size`` px input. ResNet-18 with the ImageNet stem reads a 1x1 map at up to 16 px (layer4's first
    convolution), 2x2 from 17 px; ``image_size`` itself when no such convolution exists (a ViT's patches)."""
    convs = [m for m in backbone.modules() if isinstance(m, nn.Conv2d) and max(m.stride) > 1 and max(m.padding) > 0]
    return min([image_size, *_input_sides(backbone, image_size, convs)])


def last_map_side(backbone: nn.Module, image_size: int) -> int | None:
    """The smaller side of the map ``backbone``'s last global average pool reads for a square ``image_size``
    input; ``None`` without such a pool (a ViT). ResNet-18 with the ImageNet stem: 1 at up to 32 px, 2 from
    33 px."""
    pools = [m for m in backbone.modules() if isinstance(m, nn.AdaptiveAvgPool2d)]
    sides = _input_sides(backbone, image_size, pools[-1:]) if pools else []
    return sides[0] if sides else None
