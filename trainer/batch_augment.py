"""MoCo's two-view augmentations as batched tensor operations on the training device.

The distribution is the one of torchvision's per-image transforms that MoCo v2 and v3 use (see
:class:`ViewSpec` and :data:`MOCO_V2_VIEW`, :data:`MOCO_V3_VIEWS`), sampled independently for every image of
the batch: a random resized crop, colour jitter applied with probability ``jitter_p`` (brightness, contrast,
saturation and hue in a random order per image), grayscale, Gaussian blur, solarization and a horizontal flip.
Multi-crop (:class:`SmallCrops`) adds smaller crops of the same batch at a lower resolution. What changes is
the cost: instead of decoding and transforming each image in a loader worker, a whole batch of cached uint8
pixels (:mod:`trainer.image_cache`) is transformed with a few dozen tensor operations, on the GPU when training
runs there.

Two details make the batched version equal to the per-image one:

- The cache stores every image squashed to a square, with its original size. A crop is sampled in the
  original's pixel grid (torchvision's ``RandomResizedCrop.get_params``, vectorized), and the same box, in
  relative coordinates, is cut from the squashed image: squashing is a linear map, so the crop shows the same
  part of the picture with the same aspect ratio once resized to the output size.
- Crop and resize are one bilinear ``grid_sample`` with a box per image (see :func:`crop_resize`).

Differences from torchvision that remain, deliberately: pixels stay float in [0, 1] between the operations
(torchvision and PIL round to uint8 after each), and the crop is resampled bilinearly from the cache, not
with PIL's antialiasing filter from the original.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moco_retrieval.contracts.encoder_format import IMAGENET_MEAN, IMAGENET_STD

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
SOLARIZE_THRESHOLD = 128 / 255  # RandomSolarize(threshold=128) on uint8 pixels


@dataclass(frozen=True)
class ViewSpec:
    """The augmentation distribution of one view (torchvision semantics, probabilities per image)."""

    crop_scale: tuple[float, float] = (0.2, 1.0)  # RandomResizedCrop area fraction
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # RandomResizedCrop aspect ratio range
    jitter_p: float = 0.8  # RandomApply(ColorJitter)
    brightness: float = 0.4  # ColorJitter factors: brightness/contrast/saturation in [1 - x, 1 + x], hue in [-x, x]
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    grayscale_p: float = 0.2  # RandomGrayscale
    blur_p: float = 0.5  # RandomApply(GaussianBlur)
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    solarize_p: float = 0.0  # RandomSolarize(threshold=128)
    flip_p: float = 0.5  # RandomHorizontalFlip


# MoCo v2 (Chen et al. 2020): the same distribution for both views.
MOCO_V2_VIEW = ViewSpec()
# MoCo v3 (Chen, Xie, He 2021), BYOL's asymmetric pair: blur always / rarely, solarize never / sometimes.
MOCO_V3_VIEWS = (
    ViewSpec(crop_scale=(0.08, 1.0), saturation=0.2, blur_p=1.0, solarize_p=0.0),
    ViewSpec(crop_scale=(0.08, 1.0), saturation=0.2, blur_p=0.1, solarize_p=0.2),
)


def adapted_views(
    views: tuple[ViewSpec, ...], crop_min_scale: float | None = None, blur: bool | None = None
) -> tuple[ViewSpec, ...]:
    """``views`` with their crops' smallest area fraction set to ``crop_min_scale`` and their blur left out when
    ``blur`` is False (each unchanged when None: the paper's views)."""
    if crop_min_scale is not None:
        views = tuple(dataclasses.replace(v, crop_scale=(crop_min_scale, v.crop_scale[1])) for v in views)
    if blur is False:
        views = tuple(dataclasses.replace(v, blur_p=0.0) for v in views)
    return views


# The areas of multi-crop's small crops (Caron et al. 2020, SwAV; this range is DINO's): a twentieth to two fifths
# of the image, so each shows a part of the object that its query must match to the other view's key.
SMALL_CROP_SCALE = (0.05, 0.4)


@dataclass(frozen=True)
class SmallCrops:
    """Multi-crop's extra views: ``count`` crops of ``size`` pixels per image, drawn from ``spec``."""

    count: int
    size: int
    spec: ViewSpec


def small_crops_of(view: ViewSpec, count: int, size: int) -> SmallCrops | None:
    """``count`` small crops of ``size`` px with ``view``'s colour, blur and flip and :data:`SMALL_CROP_SCALE`'s
    areas (None when ``count`` is 0: two views only)."""
    if not count:
        return None
    return SmallCrops(count, size, dataclasses.replace(view, crop_scale=SMALL_CROP_SCALE))


def blur_kernel_size(image_size: int) -> int:
    """Odd Gaussian-blur kernel about 10% of the image side (23 at 224 px, as in MoCo/SimCLR), at least 3."""
    return max(3, int(0.1 * image_size) // 2 * 2 + 1)


@dataclass
class ViewParams:
    """The random draws of one view for a batch of N images (all tensors on the batch's device).

    ``boxes`` are ``[N, 4]`` crops ``(x0, y0, x1, y1)`` relative to the image (0-1); ``crop_area`` and
    ``crop_aspect`` ``[N]`` describe them in the original's pixels; ``order`` is ``[N, 4]``, a permutation of
    the jitter operations (0 brightness, 1 contrast, 2 saturation, 3 hue) per image; the factors are the
    identity where ``jitter`` is False.
    """

    boxes: torch.Tensor
    crop_area: torch.Tensor
    crop_aspect: torch.Tensor
    flip: torch.Tensor
    jitter: torch.Tensor
    order: torch.Tensor
    brightness: torch.Tensor
    contrast: torch.Tensor
    saturation: torch.Tensor
    hue: torch.Tensor
    grayscale: torch.Tensor
    blur: torch.Tensor
    sigma: torch.Tensor
    solarize: torch.Tensor


def _uniform(n: int, low: float, high: float, gen: torch.Generator, device) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=gen, device=device)


def sample_crops(
    widths: torch.Tensor,
    heights: torch.Tensor,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    gen: torch.Generator,
    attempts: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchvision's ``RandomResizedCrop.get_params`` for N images at once.

    Args:
        widths, heights: ``[N]`` original sizes in pixels (float).

    Returns:
        ``(boxes [N, 4] relative (x0, y0, x1, y1), area [N] as a fraction of the image, aspect [N] w/h)``.
    """
    n, device = widths.shape[0], widths.device
    area = widths * heights
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    target = area[:, None] * _uniform(n * attempts, *scale, gen, device).view(n, attempts)
    aspect = torch.exp(_uniform(n * attempts, *log_r, gen, device).view(n, attempts))
    w = torch.sqrt(target * aspect).round()
    h = torch.sqrt(target / aspect).round()
    ok = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1, device=device))
    found = first >= 0
    pick = first.clamp_min(0)[:, None]
    w_pick, h_pick = w.gather(1, pick)[:, 0], h.gather(1, pick)[:, 0]
    # fallback (no attempt fitted): a centre crop with the aspect ratio clamped into range
    in_ratio = widths / heights
    w_fb = torch.where(
        in_ratio < ratio[0], widths, torch.where(in_ratio > ratio[1], (heights * ratio[1]).round(), widths)
    )
    h_fb = torch.where(in_ratio < ratio[0], (widths / ratio[0]).round(), heights)
    w_c, h_c = torch.where(found, w_pick, w_fb), torch.where(found, h_pick, h_fb)
    # offsets: uniform integers in [0, W - w] (torch.randint's range), centred for the fallback
    u_y, u_x = torch.rand(n, generator=gen, device=device), torch.rand(n, generator=gen, device=device)
    top = torch.where(found, torch.floor(u_y * (heights - h_c + 1)), torch.floor((heights - h_c) / 2))
    left = torch.where(found, torch.floor(u_x * (widths - w_c + 1)), torch.floor((widths - w_c) / 2))
    boxes = torch.stack([left / widths, top / heights, (left + w_c) / widths, (top + h_c) / heights], dim=1)
    return boxes, w_c * h_c / area, w_c / h_c


def sample_view(spec: ViewSpec, widths: torch.Tensor, heights: torch.Tensor, gen: torch.Generator) -> ViewParams:
    """Draw one view's parameters for N images of the given original sizes."""
    n, device = widths.shape[0], widths.device
    boxes, area, aspect = sample_crops(widths.float(), heights.float(), spec.crop_scale, spec.crop_ratio, gen)

    def coin(p: float) -> torch.Tensor:
        return torch.rand(n, generator=gen, device=device) < p

    jitter = coin(spec.jitter_p)
    one = torch.ones(n, device=device)
    factors = [
        torch.where(jitter, _uniform(n, max(0.0, 1 - x), 1 + x, gen, device), one)
        for x in (spec.brightness, spec.contrast, spec.saturation)
    ]
    hue = torch.where(jitter, _uniform(n, -spec.hue, spec.hue, gen, device), torch.zeros(n, device=device))
    order = torch.rand(n, 4, generator=gen, device=device).argsort(dim=1)  # a uniform permutation per image
    return ViewParams(
        boxes=boxes,
        crop_area=area,
        crop_aspect=aspect,
        flip=coin(spec.flip_p),
        jitter=jitter,
        order=order,
        brightness=factors[0],
        contrast=factors[1],
        saturation=factors[2],
        hue=hue,
        grayscale=coin(spec.grayscale_p),
        blur=coin(spec.blur_p),
        sigma=_uniform(n, *spec.blur_sigma, gen, device),
        solarize=coin(spec.solarize_p),
    )


# -- per-image operations on float [n, 3, H, W] batches in [0, 1] -------------------------------------------------
def grayscale(x: torch.Tensor) -> torch.Tensor:
    """Luma ``[n, 1, H, W]`` with torchvision's weights."""
    r, g, b = x.unbind(1)
    return (GRAY_WEIGHTS[0] * r + GRAY_WEIGHTS[1] * g + GRAY_WEIGHTS[2] * b).unsqueeze(1)


def _per_image(f: torch.Tensor) -> torch.Tensor:
    return f.view(-1, 1, 1, 1)


def adjust_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (x * _per_image(factor)).clamp_(0, 1)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    f = _per_image(factor)
    return (f * x + (1 - f) * other).clamp_(0, 1)


def adjust_contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(x, grayscale(x).mean(dim=(1, 2, 3), keepdim=True), factor)


def adjust_saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(x, grayscale(x), factor)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate the hue of each image by ``shift`` ``[n]`` (fractions of a turn) in HSV, as torchvision does.

    Value (max) and value x saturation (max - min) are unchanged by a hue rotation, so only the hue is computed
    (in sixths of a turn) and each channel is rebuilt as ``max - (max - min) * ramp(k + 6h)`` (the closed form
    of HSV -> RGB with k = 5, 3, 1 for R, G, B).
    """
    r, g, b = x.unbind(1)
    maxc = torch.maximum(torch.maximum(r, g), b)
    delta = maxc - torch.minimum(torch.minimum(r, g), b)
    inv = torch.where(delta > 0, delta, 1.0).reciprocal_()
    h6 = torch.where(maxc == r, (g - b) * inv, torch.where(maxc == g, (b - r) * inv + 2, (r - g) * inv + 4))
    h6 = h6.add_(6 * shift.view(-1, 1, 1)).remainder_(6.0).unsqueeze(1)  # [n, 1, H, W] in [0, 6)
    k = torch.tensor([5.0, 3.0, 1.0], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    t = (k + h6).remainder_(6.0)
    ramp = torch.minimum(t, 4 - t).clamp_(0, 1)
    return maxc.unsqueeze(1) - delta.unsqueeze(1) * ramp


SHIFTED_BLUR_MAX_KERNEL = 7  # up to this size a sum of shifted copies beats a grouped convolution on a CPU


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """A separable Gaussian blur with a sigma per image (torchvision's kernel, reflect padding).

    Small kernels are a weighted sum of shifted copies (2 ms -> 1 ms for 128 images of 32 px on 2 CPU cores);
    large ones a grouped convolution with one kernel per image and channel (3x faster than shifts at 23 taps).
    """
    n, c, h, w = x.shape
    half = (kernel_size - 1) / 2
    taps = torch.linspace(-half, half, kernel_size, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (taps[None, :] / sigma[:, None].to(x.dtype)) ** 2)
    kernel = kernel / kernel.sum(1, keepdim=True)  # [n, k]
    pad = kernel_size // 2
    if kernel_size <= SHIFTED_BLUR_MAX_KERNEL:
        xp = F.pad(x, (pad, pad, 0, 0), mode="reflect")
        y = sum(kernel[:, i].view(n, 1, 1, 1) * xp[..., i : i + w] for i in range(kernel_size))
        yp = F.pad(y, (0, 0, pad, pad), mode="reflect")
        return sum(kernel[:, i].view(n, 1, 1, 1) * yp[..., i : i + h, :] for i in range(kernel_size))
    weight = kernel.repeat_interleave(c, dim=0)  # [n*c, k]
    y = F.pad(x.reshape(1, n * c, h, w), (pad, pad, pad, pad), mode="reflect")
    y = F.conv2d(y, weight.view(n * c, 1, 1, kernel_size), groups=n * c)
    y = F.conv2d(y, weight.view(n * c, 1, kernel_size, 1), groups=n * c)
    return y.view(n, c, h, w)


def solarize(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= SOLARIZE_THRESHOLD, 1 - x, x)


_JITTER_OPS = (
    lambda x, p, i: adjust_brightness(x, p.brightness[i]),
    lambda x, p, i: adjust_contrast(x, p.contrast[i]),
    lambda x, p, i: adjust_saturation(x, p.saturation[i]),
    lambda x, p, i: adjust_hue(x, p.hue[i]),
)


def _apply_to(x: torch.Tensor, mask: torch.Tensor, fn) -> torch.Tensor:
    """``x`` with ``fn(x[idx], idx)`` written back, in place, where ``mask`` is True (nothing computed for the
    others). ``x`` must be a tensor the caller owns (``apply_view`` works on its own crop)."""
    idx = mask.nonzero().squeeze(1)
    if idx.numel() == 0:
        return x
    if idx.numel() == x.shape[0]:
        return fn(x, idx)
    return x.index_copy_(0, idx, fn(x.index_select(0, idx), idx))


def crop_resize(pixels: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Cut ``boxes`` (relative ``[N, 4]``) out of float ``[N, 3, S, S]`` images, each resized to ``size`` squared.

    Bilinear sampling at the output pixel centres (``grid_sample``; 1 ms for 128 crops of 32 px on 2 CPU cores,
    against 3 ms for ``roi_align``). It does not antialias, which is why the cache side is only 1.25x the
    training size: a crop is never shrunk by more than that, and aliasing at that factor is negligible.
    """
    n = pixels.shape[0]
    x0, y0, x1, y1 = boxes.to(pixels.dtype).unbind(1)
    theta = torch.zeros(n, 2, 3, device=pixels.device, dtype=pixels.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = x1 - x0, x0 + x1 - 1  # output [-1, 1] -> the box, in grid_sample's coordinates
    theta[:, 1, 1], theta[:, 1, 2] = y1 - y0, y0 + y1 - 1
    grid = F.affine_grid(theta, [n, pixels.shape[1], size, size], align_corners=False)
    return F.grid_sample(pixels, grid, mode="bilinear", padding_mode="border", align_corners=False)


def apply_view(pixels: torch.Tensor, p: ViewParams, size: int) -> torch.Tensor:
    """One augmented view in [0, 1]: float ``[N, 3, S, S]`` -> ``[N, 3, size, size]``, in torchvision's order
    (crop, jitter, grayscale, blur, solarize, flip)."""
    x = crop_resize(pixels, p.boxes, size)
    for position in range(4):  # the jitter operations in each image's own random order
        for op, fn in enumerate(_JITTER_OPS):
            x = _apply_to(x, p.jitter & (p.order[:, position] == op), lambda y, i, fn=fn: fn(y, p, i))
    x = _apply_to(x, p.grayscale, lambda y, i: grayscale(y).repeat(1, 3, 1, 1))
    x = _apply_to(x, p.blur, lambda y, i: gaussian_blur(y, p.sigma[i], blur_kernel_size(size)))
    x = _apply_to(x, p.solarize, lambda y, i: solarize(y))
    return _apply_to(x, p.flip, lambda y, i: y.flip(-1))


class TwoViewAugment:
    """Two augmented, normalized views of a batch of cached images, on the batch's device.

    Args:
        views: the two :class:`ViewSpec` (the same one twice for MoCo v2).
        image_size: output side in pixels.
        memory_format: layout of the outputs (channels-last for ResNets).
        small: multi-crop's small crops (:meth:`small_crops`), or None.
    """

    def __init__(
        self,
        views: tuple[ViewSpec, ViewSpec],
        image_size: int,
        memory_format: torch.memory_format = torch.contiguous_format,
        small: SmallCrops | None = None,
    ):
        self.views = views
        self.image_size = image_size
        self.memory_format = memory_format
        self.small = small

    def __call__(
        self, pixels: torch.Tensor, sizes: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Args:
            pixels: uint8 ``[N, S, S, 3]`` (cached, squashed images).
            sizes: ``[N, 2]`` original (width, height) in pixels.
            gen: the generator of every random draw (on the pixels' device).

        Returns:
            ``(x1, x2)``: float32 ``[N, 3, image_size, image_size]`` each, normalized with the ImageNet mean/std.
        """
        x1, x2 = self._views(pixels, sizes, gen, self.views, self.image_size)
        return x1, x2

    def small_crops(self, pixels: torch.Tensor, sizes: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
        """The small crops of the same batch (draw them after the two views, so that those stay as they were):
        float32 ``[count * N, 3, size, size]``, crop ``c`` of image ``n`` at row ``c * N + n``; None without."""
        if self.small is None:
            return None
        return torch.cat(self._views(pixels, sizes, gen, (self.small.spec,) * self.small.count, self.small.size))

    def _views(self, pixels, sizes, gen, specs, size) -> list[torch.Tensor]:
        x = pixels.permute(0, 3, 1, 2).float().div_(255)
        widths, heights = sizes[:, 0].float(), sizes[:, 1].float()
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        out = []
        for spec in specs:
            view = apply_view(x, sample_view(spec, widths, heights, gen), size)
            out.append(((view - mean) / std).contiguous(memory_format=self.memory_format))
        return out
