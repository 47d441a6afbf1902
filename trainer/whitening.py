"""PCA whitening of an encoder's embeddings, fitted without labels on the collection it will index.

Cosine k-NN on a self-supervised encoder's features is dominated by a few high-variance directions that the
training objective does not need to keep apart. Centring the L2-normalised features, rotating them onto their
principal axes and scaling each axis to unit variance (Jégou & Chum, ECCV 2012; the "learned whitening" of
Radenović et al.'s retrieval pipeline) gives every direction the same say. On Fashion-MNIST it adds 4 points of
k-NN top-1 to a 30-minute encoder and 5 to random weights (``docs/ARCHITECTURE.md``, issue 20).

``moco export`` fits it on images of the run's own data folder and bakes it into the ONNX graph between the
backbone and the final L2 normalisation, so indexing, serving and ``moco eval`` see whitened embeddings with no
change to the encoder format: still float32 ``[N, D']``, L2-normalised, with ``D' <= D``.

    features [N, D] --normalize--> x --(x - mean) @ projection--> [N, D'] --normalize--> embedding
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moco_retrieval.contracts.errors import ConfigError, DataError

LOG = logging.getLogger(__name__)

WHITEN_MAX_IMAGES = 10_000  # images embedded to fit it (about 20 per dimension of a 512-d feature)
WHITEN_MIN_IMAGES = 200  # fewer: no whitening (a covariance of a few hundred rows is mostly noise)
SAMPLES_PER_DIM = 4  # keep at most n / 4 directions (n / 10 and n / 2 measured worse on small collections)


class PcaWhitening(nn.Module):
    """``(normalize(x) - mean) @ projection``: ``[N, D]`` features to ``[N, D']`` whitened ones (not normalised).

    Args:
        mean: ``[D]`` mean of the fitting set's L2-normalised features.
        projection: ``[D, D']`` principal axes, each divided by the square root of its variance.
        images: how many images it was fitted on (for the encoder's metadata).
    """

    def __init__(self, mean: torch.Tensor, projection: torch.Tensor, images: int):
        super().__init__()
        self.register_buffer("mean", mean.detach().float().clone())
        self.register_buffer("projection", projection.detach().float().clone())
        self.images = images

    @property
    def in_dim(self) -> int:
        return int(self.projection.shape[0])

    @property
    def out_dim(self) -> int:
        return int(self.projection.shape[1])

    def describe(self) -> str:
        """One line for the encoder's metadata and the CLI, e.g. ``pca 128 of 128 dims, 10000 images``."""
        return f"pca {self.out_dim} of {self.in_dim} dims, {self.images} images"

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return (F.normalize(features.float(), dim=1) - self.mean) @ self.projection


def whitening_dim(images: int, feature_dim: int, requested: int | None = None) -> int:
    """How many principal directions to keep: ``requested`` (checked), or ``min(D, images // SAMPLES_PER_DIM)``.

    Raises:
        ConfigError: ``requested`` is not in ``1..D`` or exceeds what ``images`` can estimate (``images - 1``).
    """
    if requested is None:
        return max(1, min(feature_dim, images // SAMPLES_PER_DIM))
    _check_within_features(requested, feature_dim)
    if requested >= images:
        raise ConfigError(f"--whiten {requested}: {images} images estimate at most {images - 1} directions")
    return requested


def _check_within_features(requested: int, feature_dim: int) -> None:
    if not 1 <= requested <= feature_dim:
        raise ConfigError(f"--whiten {requested}: the encoder's features are {feature_dim}-d; give 1-{feature_dim}")


def fit_pca_whitening(features: torch.Tensor, dim: int) -> PcaWhitening:
    """PCA whitening of ``features`` keeping the ``dim`` directions of largest variance.

    Args:
        features: ``[N, D]`` backbone features (normalised here), N > dim.
        dim: directions kept, ``1 <= dim <= D``.

    Returns:
        the fitted :class:`PcaWhitening`. Directions with no variance in the data (rank below ``dim``) are
        scaled by the smallest positive variance kept, never divided by zero.
    """
    x = F.normalize(features.double(), dim=1)
    mean = x.mean(0)
    centred = x - mean
    covariance = centred.T @ centred / len(x)
    variances, axes = torch.linalg.eigh(covariance)  # ascending
    variances, axes = variances.flip(0)[:dim], axes.flip(1)[:, :dim]
    floor = variances[0] * 1e-6  # a direction with (numerically) no variance is kept, not blown up
    projection = axes / variances.clamp(min=floor).sqrt()
    return PcaWhitening(mean.float(), projection.float(), images=len(x))


@dataclass
class WhiteningSample:
    """Image files spread evenly over a folder, for fitting the whitening."""

    paths: list[Path]
    found: int  # readable-looking images in the folder


def sample_images(root: str | Path, max_images: int = WHITEN_MAX_IMAGES) -> WhiteningSample:
    """Up to ``max_images`` image files of ``root``, evenly spread over its sorted listing (every class of a
    class-per-folder collection is represented).

    Raises:
        DataError: ``root`` is not a folder.
    """
    from moco_retrieval.contracts.images import iter_image_files

    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root} is not a folder of images")
    files = sorted(root / e.path for e in iter_image_files(root) if e.skip_reason is None)
    step = max(1, len(files) / max_images) if files else 1
    picked = [files[int(i * step)] for i in range(min(len(files), max_images))]
    return WhiteningSample(picked, len(files))


WHITEN_CHOICES = "auto, off, or a number of dimensions"


def parse_whiten(value: str | int) -> str | int:
    """``--whiten``'s value: ``"auto"``, ``"off"`` or a positive number of dimensions.

    Raises:
        ConfigError: anything else.
    """
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(f"--whiten must be {WHITEN_CHOICES}, got {value!r}")


def fit_for_export(
    backbone: nn.Module,
    image_size: int,
    data_dir: str | Path | None,
    setting: str | int = "auto",
    workers: int = 0,
    min_images: int | None = None,
    listing: Callable[[], WhiteningSample] | None = None,
) -> tuple[PcaWhitening | None, str]:
    """The whitening ``moco export`` bakes into an encoder, fitted on a sample of ``data_dir``'s images.

    Args:
        backbone: float32 backbone in eval mode, ``[N, 3, H, W] -> [N, D]``.
        setting: ``auto`` (fit when the folder has at least :data:`WHITEN_MIN_IMAGES` readable images, keeping
            ``min(D, n // 4)`` directions; otherwise none), ``off``, or the number of directions to keep.
        min_images: fewest readable images to fit on (default :data:`WHITEN_MIN_IMAGES`).
        listing: ``data_dir``'s sample when the caller lists the folder once for several uses (``moco export``:
            the BatchNorm refit and the whitening) or a smaller one (tests); default ``sample_images(data_dir)``
            (at most :data:`WHITEN_MAX_IMAGES` images, evenly spread).

    Returns:
        ``(whitening or None, what was done in one line)``; the line goes into the encoder's metadata, so it
        names no path (the log does).

    Raises:
        ConfigError: a bad ``setting``, or more directions than the data can estimate.
        DataError: a number was asked for and ``data_dir`` is missing or has too few readable images.
    """
    from moco_retrieval.trainer.evaluate import embed_files
    from moco_retrieval.trainer.export import embedding_dim

    setting = parse_whiten(setting)
    min_images = WHITEN_MIN_IMAGES if min_images is None else min_images
    if setting == "off":
        return None, "none (--whiten off)"
    explicit = setting != "auto"
    if explicit:  # a D the features cannot hold fails before any image is read, not after embedding thousands
        _check_within_features(setting, embedding_dim(backbone, image_size))
    if not data_dir or not Path(data_dir).is_dir():
        if explicit:
            raise DataError(f"--whiten {setting} needs the images to fit it on, and {data_dir} is not a folder")
        LOG.warning("not whitening: the data folder %s is not available (give --data DIR)", data_dir)
        return None, "none (the data folder is not available)"
    sample = listing() if listing else sample_images(data_dir)
    LOG.info("fitting PCA whitening on %d of %d images of %s", len(sample.paths), sample.found, data_dir)
    features = embed_files(backbone, sample.paths, image_size, workers=workers, skip_unreadable=True)
    n = len(features)
    if n < min_images or (explicit and setting >= n):
        if explicit:
            raise DataError(
                f"--whiten {setting}: only {n} readable images in {data_dir}; it needs more than {setting} "
                f"(and at least {min_images})"
            )
        LOG.warning("not whitening: only %d readable images in %s, fewer than %d", n, data_dir, min_images)
        return None, f"none (only {n} readable images, fewer than {min_images})"
    dim = whitening_dim(n, features.shape[1], None if setting == "auto" else setting)
    whitening = fit_pca_whitening(features, dim)
    return whitening, whitening.describe()
