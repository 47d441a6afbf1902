"""The k-NN monitor: weighted k-NN top-1 accuracy of the backbone on a labeled folder, during training.

With a folder holding ``train/`` and ``val/`` (or ``test/``) subfolders, the first is the memory bank and the
second is classified; otherwise the folder is evaluated leave-one-out (each image classified by all others).

Images come from the image cache (:mod:`trainer.image_cache`), so an evaluation decodes nothing: each image's
evaluation crop (the export's resize policy: shorter side to the model size, centre square) is cut from its
cached copy and resized bilinearly, in batches. ``moco eval`` and serving decode the files themselves; the
two agree up to resampling.

Each evaluation reports two figures from one pass over the images: the backbone's features as they are, and the
same features PCA-whitened (:mod:`trainer.whitening`), fitted without labels on the memory bank's features of
that evaluation, as ``moco export`` does by default on the run's images. The second is what an exported encoder
scores; on Fashion-MNIST it is 4 points above the first (``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moco_retrieval.contracts.encoder_format import IMAGENET_MEAN, IMAGENET_STD, resized_size
from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.images import walk_image_files
from moco_retrieval.contracts.knn import KNN_K, KNN_TEMPERATURE
from moco_retrieval.trainer.batch_augment import crop_resize
from moco_retrieval.trainer.data import CachedBatchDataset, eval_batches
from moco_retrieval.trainer.image_cache import ImageCache, cache_side
from moco_retrieval.trainer.image_survey import evenly_spread
from moco_retrieval.trainer.knn import knn_accuracy, pixel_knn_accuracy
from moco_retrieval.trainer.whitening import WHITEN_MIN_IMAGES, fit_pca_whitening, whitening_dim

LOG = logging.getLogger(__name__)


def eval_crop_boxes(sizes: torch.Tensor, image_size: int) -> torch.Tensor:
    """The evaluation crop of images of original ``sizes`` ``[N, 2]`` (width, height) as relative boxes
    ``[N, 4]``: what ``Resize(image_size)`` + ``CenterCrop(image_size)`` keep of each image."""
    boxes = []
    for width, height in sizes.tolist():
        new_w, new_h = resized_size(width, height, image_size)
        left, top = int(round((new_w - image_size) / 2.0)), int(round((new_h - image_size) / 2.0))
        boxes.append([left / new_w, top / new_h, (left + image_size) / new_w, (top + image_size) / new_h])
    return torch.tensor(boxes, dtype=torch.float32).view(-1, 4)


@dataclass(frozen=True)
class KnnScore:
    """One evaluation's k-NN top-1 accuracies in [0, 1]."""

    plain: float  # the backbone's L2-normalised features
    whitened: float | None  # PCA-whitened as `moco export` does; None when the bank is too small to fit it


@dataclass
class _Split:
    dataset: CachedBatchDataset
    labels: torch.Tensor  # [N] int64 into the monitor's class list


def _labeled_split(folder: Path, image_size: int, max_images: int, cache_root, workers: int):
    """``(cached images, their labels)`` of one labeled folder (unreadable files left out)."""
    files = [f for f in walk_image_files(folder) if f.skip_reason is None]
    if len({f.label for f in files}) < 2 or any(f.label is None for f in files):
        raise DataError(f"k-NN folder {folder} needs images in at least two labeled subfolders (<folder>/<label>/...)")
    whole_folder = len(files) <= max_images
    if not whole_folder:  # a fixed, even spread; the cache keeps the other images (training reads them)
        files = evenly_spread(files, max_images)
    cached, failed = ImageCache(folder, cache_side(image_size), cache_root).update(
        files, workers, progress=False, whole_folder=whole_folder
    )
    readable = [f for f in files if f.path not in failed]
    return cached, [f.label for f in readable]


class KnnMonitor:
    """Evaluates a backbone's weighted k-NN accuracy on a fixed labeled set.

    Args:
        folder: labeled image folder (see module docstring).
        image_size: evaluation size (the training crop size).
        k, temperature: k-NN vote parameters.
        max_images: cap on images per split (a fixed, evenly spread subset).
        batch_size: images per forward pass.
        cache_root: where the image cache lives (None: the default).
        workers: processes decoding images into the cache the first time.
        whiten_min_images: fewest memory-bank images to fit the whitening on (below it, no whitened score).
    """

    def __init__(
        self,
        folder: str | Path,
        image_size: int,
        k: int = KNN_K,
        temperature: float = KNN_TEMPERATURE,
        max_images: int = 5000,
        batch_size: int = 256,
        cache_root=None,
        workers: int = 0,
        whiten_min_images: int = WHITEN_MIN_IMAGES,
    ):
        folder = Path(folder)
        split = next((folder / name for name in ("val", "test") if (folder / name).is_dir()), None)
        roots = [folder / "train", split] if (folder / "train").is_dir() and split is not None else [folder]
        parts = [_labeled_split(root, image_size, max_images, cache_root, workers) for root in roots]
        classes = sorted({label for _, labels in parts for label in labels})
        index = {name: i for i, name in enumerate(classes)}
        self.splits = [
            _Split(
                CachedBatchDataset(cached, [index[x] for x in labels]),
                torch.tensor([index[x] for x in labels], dtype=torch.int64),
            )
            for cached, labels in parts
        ]
        self.folder, self.image_size, self.k, self.temperature = folder, image_size, k, temperature
        self.batch_size, self.whiten_min_images = batch_size, whiten_min_images

    def __len__(self) -> int:
        return sum(len(s.labels) for s in self.splits)

    def inputs(self, split: _Split, device: torch.device):
        """The network inputs of a split in order: normalised float32 batches ``[B, 3, S, S]`` of each image's
        evaluation crop (S: the model size)."""
        mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
        for pixels, sizes, _, _ in eval_batches(split.dataset, self.batch_size):
            x = pixels.to(device).permute(0, 3, 1, 2).float().div_(255)
            yield (crop_resize(x, eval_crop_boxes(sizes, self.image_size).to(device), self.image_size) - mean) / std

    @torch.no_grad()
    def features(self, backbone: nn.Module, split: _Split, device: torch.device) -> torch.Tensor:
        """L2-normalised float32 features ``[N, D]`` (on the CPU) of a split, in eval mode."""
        return torch.cat([F.normalize(backbone(x).float(), dim=1).cpu() for x in self.inputs(split, device)])

    def pixel_accuracy(self) -> dict[int, float]:
        """``{k: top-1}`` of L2 k-NN on the evaluation crops' raw pixels (k of :data:`trainer.knn.PIXEL_KS`): what
        a backbone's features must beat to be worth anything."""
        cpu = torch.device("cpu")
        xs = [torch.cat(list(self.inputs(split, cpu))) for split in self.splits]
        if len(xs) == 1:
            return pixel_knn_accuracy(xs[0], self.splits[0].labels)
        return pixel_knn_accuracy(xs[0], self.splits[0].labels, xs[1], self.splits[1].labels)

    def evaluate(self, backbone: nn.Module, device: torch.device) -> float:
        """Top-1 accuracy in [0, 1] of weighted k-NN on the backbone's features as they are."""
        return self.scores(backbone, device).plain

    def scores(self, backbone: nn.Module, device: torch.device) -> KnnScore:
        """Weighted k-NN top-1 of the backbone's features, plain and PCA-whitened (one embedding pass).

        The whitening is fitted on the memory bank's features (the ``train/`` split, or the whole folder when
        evaluating leave-one-out), keeping :func:`trainer.whitening.whitening_dim` directions, labels unused.
        """
        was_training = backbone.training
        backbone.eval()
        try:
            xs = [self.features(backbone, split, device) for split in self.splits]
        finally:
            backbone.train(was_training)
        plain = self._accuracy(xs)
        bank = xs[0]
        if len(bank) < max(2, self.whiten_min_images):
            return KnnScore(plain, None)
        whitening = fit_pca_whitening(bank, whitening_dim(len(bank), bank.shape[1]))
        with torch.no_grad():
            whitened = [F.normalize(whitening(x), dim=1) for x in xs]
        return KnnScore(plain, self._accuracy(whitened))

    def _accuracy(self, xs: list[torch.Tensor]) -> float:
        """Top-1 of weighted k-NN on per-split features ``[N_i, D]`` (L2-normalised)."""
        if len(xs) == 1:
            return knn_accuracy(xs[0], self.splits[0].labels, k=self.k, temperature=self.temperature)
        return knn_accuracy(
            xs[0], self.splits[0].labels, xs[1], self.splits[1].labels, k=self.k, temperature=self.temperature
        )
