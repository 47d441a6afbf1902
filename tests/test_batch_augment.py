"""Batched MoCo augmentations (trainer.batch_augment): each operation equals torchvision's per-image one, and the
random draws follow the MoCo v2 / v3 distributions (checked with statistics over thousands of samples)."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from moco_retrieval.contracts.encoder_format import IMAGENET_MEAN, IMAGENET_STD
from moco_retrieval.trainer import batch_augment as B

N_STAT = 4000


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _images(n: int = 6, size: int = 24, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.interpolate(
        torch.rand(n, 3, 6, 6, generator=gen), size=(size, size), mode="bilinear", align_corners=False
    )
    return (0.7 * smooth + 0.3 * torch.rand(n, 3, size, size, generator=gen)).clamp(0, 1)


# -- each operation against torchvision, per image ----------------------------------------------------------------
@pytest.mark.parametrize(
    "name, ours, theirs, values",
    [
        ("brightness", B.adjust_brightness, TF.adjust_brightness, [0.6, 1.0, 1.37]),
        ("contrast", B.adjust_contrast, TF.adjust_contrast, [0.6, 1.0, 1.4]),
        ("saturation", B.adjust_saturation, TF.adjust_saturation, [0.6, 1.2, 1.4]),
        ("hue", B.adjust_hue, TF.adjust_hue, [-0.1, 0.0, 0.07]),
    ],
)
def test_color_ops__equal_torchvision_per_image(name, ours, theirs, values):
    x = _images(3)
    factors = torch.tensor(values)
    got = ours(x, factors)
    want = torch.stack([theirs(x[i], float(values[i])) for i in range(3)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_grayscale_and_solarize__equal_torchvision():
    x = _images(4)
    torch.testing.assert_close(B.grayscale(x), TF.rgb_to_grayscale(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(B.solarize(x), TF.solarize(x, threshold=128 / 255), atol=0, rtol=0)


@pytest.mark.parametrize("kernel_size", [3, 9])  # the shifted-sum path and the grouped-convolution path
def test_gaussian_blur__equals_torchvision_with_a_sigma_per_image(kernel_size):
    x = _images(3, size=32)
    sigmas = torch.tensor([0.1, 0.8, 2.0])
    got = B.gaussian_blur(x, sigmas, kernel_size)
    want = torch.stack(
        [TF.gaussian_blur(x[i], [kernel_size, kernel_size], [float(s), float(s)]) for i, s in enumerate(sigmas)]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_crop_resize__full_box_is_identity_and_an_integer_box_is_the_crop():
    x = _images(2, size=16)
    full = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2)
    torch.testing.assert_close(B.crop_resize(x, full, 16), x, atol=1e-6, rtol=0)
    box = torch.tensor([[4 / 16, 2 / 16, 12 / 16, 10 / 16]] * 2)  # an 8x8 crop resized to 8x8: exactly the pixels
    torch.testing.assert_close(B.crop_resize(x, box, 8), x[:, :, 2:10, 4:12], atol=1e-6, rtol=0)
    resized = TF.resize(x, [8, 8], antialias=False)  # a 2x shrink at pixel centres: torchvision's bilinear
    torch.testing.assert_close(B.crop_resize(x, full, 8), resized, atol=1e-5, rtol=0)


# -- the random draws ------------------------------------------------------------------------------------------------
def _torchvision_crops(width: int, height: int, scale, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    img = torch.zeros(3, height, width)
    areas, aspects = [], []
    for _ in range(n):
        top, left, h, w = T.RandomResizedCrop.get_params(img, list(scale), [3 / 4, 4 / 3])
        areas.append(w * h / (width * height))
        aspects.append(w / h)
    return torch.tensor(areas), torch.tensor(aspects)


@pytest.mark.parametrize("width, height, scale", [(64, 64, (0.2, 1.0)), (120, 40, (0.08, 1.0)), (28, 28, (0.2, 1.0))])
def test_sample_crops__match_torchvisions_random_resized_crop(width, height, scale):
    gen = torch.Generator().manual_seed(0)
    boxes, area, aspect = B.sample_crops(
        torch.full((N_STAT,), float(width)), torch.full((N_STAT,), float(height)), scale, (3 / 4, 4 / 3), gen
    )
    ref_area, ref_aspect = _torchvision_crops(width, height, scale, N_STAT)
    assert ((boxes >= 0) & (boxes <= 1)).all() and (boxes[:, 2] > boxes[:, 0]).all()
    assert area.min() >= scale[0] * 0.9 and area.max() <= 1.0 + 1e-6
    for ours, ref in ((area, ref_area), (aspect, ref_aspect)):
        assert abs(ours.mean() - ref.mean()) < 0.02, (ours.mean(), ref.mean())
        for q in (0.1, 0.5, 0.9):  # the distributions, not only their means
            assert abs(ours.quantile(q) - ref.quantile(q)) < 0.04, q
    # relative boxes describe the same pixels as the sampled crop
    torch.testing.assert_close((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]), area, atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", [B.MOCO_V2_VIEW, *B.MOCO_V3_VIEWS])
def test_sample_view__probabilities_and_ranges_are_the_configured_ones(spec):
    gen = torch.Generator().manual_seed(3)
    p = B.sample_view(spec, torch.full((N_STAT,), 40.0), torch.full((N_STAT,), 40.0), gen)
    tol = 4 * math.sqrt(0.25 / N_STAT)  # four standard errors of a rate
    for drawn, rate in (
        (p.flip, spec.flip_p),
        (p.jitter, spec.jitter_p),
        (p.grayscale, spec.grayscale_p),
        (p.blur, spec.blur_p),
        (p.solarize, spec.solarize_p),
    ):
        assert abs(drawn.float().mean().item() - rate) <= tol, (rate, drawn.float().mean())
    j = p.jitter
    assert p.brightness[j].min() >= 1 - spec.brightness and p.brightness[j].max() <= 1 + spec.brightness
    assert p.saturation[j].min() >= 1 - spec.saturation and p.saturation[j].max() <= 1 + spec.saturation
    assert p.hue[j].abs().max() <= spec.hue and (p.hue[~j] == 0).all() and (p.brightness[~j] == 1).all()
    assert abs(p.hue[j].mean().item()) < 0.01 and p.sigma.min() >= 0.1 and p.sigma.max() <= 2.0
    # every image gets its own uniformly random order of the four jitter operations
    assert (p.order.sort(dim=1).values == torch.arange(4)).all()
    firsts = torch.bincount(p.order[:, 0], minlength=4).float() / N_STAT
    assert (firsts - 0.25).abs().max() < tol


def test_adapted_views__crop_min_scale_and_no_blur_change_every_view_and_are_validated():
    from moco_retrieval.contracts.errors import ConfigError
    from moco_retrieval.trainer.config import TrainConfig

    assert B.adapted_views(B.MOCO_V3_VIEWS, None, None) is B.MOCO_V3_VIEWS  # unset: the paper's views
    assert B.adapted_views(B.MOCO_V3_VIEWS, blur=True) is B.MOCO_V3_VIEWS
    assert [v.blur_p for v in B.adapted_views(B.MOCO_V3_VIEWS, blur=False)] == [0.0, 0.0]
    views = B.adapted_views(B.MOCO_V3_VIEWS, 0.5)
    assert [v.crop_scale for v in views] == [(0.5, 1.0), (0.5, 1.0)]
    assert [v.blur_p for v in views] == [v.blur_p for v in B.MOCO_V3_VIEWS]  # nothing else changes
    p = B.sample_view(views[0], torch.full((N_STAT,), 40.0), torch.full((N_STAT,), 40.0), torch.Generator())
    assert p.crop_area.min() >= 0.5 - 0.03  # rounding to whole pixels of a 40 px image
    assert TrainConfig(data_dir="d", out_dir="o", crop_min_scale=0.5).crop_min_scale == 0.5
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="crop-min-scale"):
            TrainConfig(data_dir="d", out_dir="o", crop_min_scale=bad)


# -- the whole pipeline --------------------------------------------------------------------------------------------
def _cached_batch(n: int, side: int = 40, seed: int = 0) -> torch.Tensor:
    return (_images(n, size=side, seed=seed) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def test_two_views__shapes_dtypes_layout_and_the_views_differ():
    augment = B.TwoViewAugment((B.MOCO_V2_VIEW, B.MOCO_V2_VIEW), 32, torch.channels_last)
    pixels, sizes = _cached_batch(8), torch.tensor([[64, 48]] * 8)
    x1, x2 = augment(pixels, sizes, torch.Generator().manual_seed(0))
    assert x1.shape == x2.shape == (8, 3, 32, 32) and x1.dtype == x2.dtype == torch.float32
    assert x1.is_contiguous(memory_format=torch.channels_last)
    assert not torch.allclose(x1, x2)
    again = augment(pixels, sizes, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], x1) and torch.equal(again[1], x2)  # the generator alone decides


def test_small_crops__shape_areas_and_the_two_views_unchanged():
    """Multi-crop's crops come after the two views from the same generator: the views are those of a run without
    them; each small crop is a 5-40% part of its image at the small size."""
    small = B.small_crops_of(B.MOCO_V2_VIEW, 3, 16)
    assert B.small_crops_of(B.MOCO_V2_VIEW, 0, 16) is None
    assert small.spec.crop_scale == B.SMALL_CROP_SCALE and small.spec.jitter_p == B.MOCO_V2_VIEW.jitter_p
    with_small = B.TwoViewAugment((B.MOCO_V2_VIEW, B.MOCO_V2_VIEW), 32, torch.channels_last, small)
    without = B.TwoViewAugment((B.MOCO_V2_VIEW, B.MOCO_V2_VIEW), 32, torch.channels_last)
    pixels, sizes = _cached_batch(8), torch.tensor([[64, 48]] * 8)
    gen = torch.Generator().manual_seed(0)
    x1, x2 = with_small(pixels, sizes, gen)
    crops = with_small.small_crops(pixels, sizes, gen)
    plain = without(pixels, sizes, torch.Generator().manual_seed(0))
    assert torch.equal(x1, plain[0]) and torch.equal(x2, plain[1])
    assert without.small_crops(pixels, sizes, gen) is None
    assert crops.shape == (24, 3, 16, 16) and crops.is_contiguous(memory_format=torch.channels_last)
    assert not torch.allclose(crops[:8], crops[8:16])  # crop c of image n at row c * N + n: three different draws
    p = B.sample_view(small.spec, torch.full((N_STAT,), 40.0), torch.full((N_STAT,), 40.0), torch.Generator())
    assert p.crop_area.min() >= 0.05 - 0.01 and p.crop_area.max() <= 0.4 + 0.03


def test_two_views__output_statistics_show_the_configured_flip_and_grayscale_rates():
    """Measured on the images themselves: a left-to-right ramp reveals flips, equal channels reveal grayscale."""
    n = 2000
    ramp = torch.linspace(0, 255, 40).round().to(torch.uint8)
    pixels = torch.zeros(n, 40, 40, 3, dtype=torch.uint8)
    pixels[..., 0] = ramp  # red rises left to right
    pixels[..., 1] = 200
    pixels[..., 2] = 30
    no_color = B.ViewSpec(jitter_p=0.0, grayscale_p=0.2, blur_p=0.0, flip_p=0.5)
    augment = B.TwoViewAugment((no_color, no_color), 32)
    x1, _ = augment(pixels, torch.tensor([[40, 40]] * n), torch.Generator().manual_seed(5))
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    rgb = x1 * std + mean
    gray = (rgb.max(1).values - rgb.min(1).values).amax(dim=(1, 2)) < 1e-4
    colour = ~gray
    flipped = rgb[colour, 0, :, 0].mean(1) > rgb[colour, 0, :, -1].mean(1)  # red falls left to right
    tol = 4 * math.sqrt(0.25 / n)
    assert abs(gray.float().mean().item() - 0.2) <= tol
    assert abs(flipped.float().mean().item() - 0.5) <= tol
