"""Image transforms: the MoCo two-crop augmentations and the deterministic evaluation preprocessing.

All built from torchvision transforms v2. Evaluation preprocessing is the same policy the ONNX export
declares (``contracts.encoder_format.RESIZE_POLICY``): resize the shorter side to the model size, center-crop
a square, scale to [0, 1] and normalize with ImageNet mean/std.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2 as T

from contracts.encoder_format import IMAGENET_MEAN, IMAGENET_STD


def blur_kernel_size(image_size: int) -> int:
    """Odd Gaussian-blur kernel about 10% of the image side (23 at 224 px, as in MoCo/SimCLR), at least 3."""
    return max(3, int(0.1 * image_size) // 2 * 2 + 1)


def _to_normalized_tensor() -> list:
    return [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


def moco_v2_view(image_size: int) -> T.Compose:
    """One MoCo v2 view: random resized crop (scale 0.2-1), colour jitter p=0.8, grayscale p=0.2,
    Gaussian blur (sigma 0.1-2) p=0.5, horizontal flip."""
    return T.Compose([
        T.RandomResizedCrop(image_size, scale=(0.2, 1.0), antialias=True),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(blur_kernel_size(image_size), sigma=(0.1, 2.0))], p=0.5),
        T.RandomHorizontalFlip(),
        *_to_normalized_tensor(),
    ])


def moco_v3_views(image_size: int) -> tuple[T.Compose, T.Compose]:
    """The two asymmetric MoCo v3 (BYOL-style) views: blur p=1.0 / 0.1, solarize p=0 / 0.2, crop scale 0.08-1."""

    def view(blur_p: float, solarize_p: float) -> T.Compose:
        return T.Compose([
            T.RandomResizedCrop(image_size, scale=(0.08, 1.0), antialias=True),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            T.RandomGrayscale(p=0.2),
            T.RandomApply([T.GaussianBlur(blur_kernel_size(image_size), sigma=(0.1, 2.0))], p=blur_p),
            T.RandomSolarize(threshold=128, p=solarize_p),
            T.RandomHorizontalFlip(),
            *_to_normalized_tensor(),
        ])

    return view(1.0, 0.0), view(0.1, 0.2)


def eval_transform(image_size: int) -> T.Compose:
    """Deterministic preprocessing for features: shorter side to ``image_size``, center crop, normalize."""
    return T.Compose([
        T.Resize(image_size, antialias=True),
        T.CenterCrop(image_size),
        *_to_normalized_tensor(),
    ])


class TwoViews:
    """Apply two (possibly different) view transforms to one image: returns ``(view1, view2)``."""

    def __init__(self, first, second=None):
        self.first = first
        self.second = second if second is not None else first

    def __call__(self, image):
        return self.first(image), self.second(image)
