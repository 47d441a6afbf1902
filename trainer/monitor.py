"""The k-NN monitor: weighted k-NN top-1 accuracy of the backbone on a labeled folder, during training.

With a folder holding ``train/`` and ``val/`` (or ``test/``) subfolders, the first is the memory bank and the
second is classified; otherwise the folder is evaluated leave-one-out (each image classified by all others).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from contracts.errors import DataError
from contracts.knn import KNN_K, KNN_TEMPERATURE
from trainer.augment import eval_transform
from trainer.data import FolderDataset, eval_loader
from trainer.imagefolder import ImageList, scan_image_folder
from trainer.knn import extract_features, knn_accuracy

LOG = logging.getLogger(__name__)


def _capped(images: ImageList, max_images: int) -> ImageList:
    if len(images) <= max_images:
        return images
    keep = torch.linspace(0, len(images) - 1, max_images).round().long().unique().tolist()  # a fixed spread
    return images.subset(keep)


def _labeled(folder: Path) -> ImageList:
    images = scan_image_folder(folder)
    if len(images.classes) < 2 or any(label is None for label in images.labels):
        raise DataError(f"k-NN folder {folder} needs images in at least two labeled subfolders (<folder>/<label>/...)")
    return images


class KnnMonitor:
    """Evaluates a backbone's weighted k-NN accuracy on a fixed labeled set.

    Args:
        folder: labeled image folder (see module docstring).
        image_size: eval preprocessing size (the training crop size).
        k, temperature: k-NN vote parameters.
        max_images: cap on images per split (a fixed, evenly spread subset).
        batch_size, workers: feature-extraction loader settings.
    """

    def __init__(self, folder: str | Path, image_size: int, k: int = KNN_K, temperature: float = KNN_TEMPERATURE,
                 max_images: int = 5000, batch_size: int = 256, workers: int = 0):
        folder = Path(folder)
        split = next((folder / name for name in ("val", "test") if (folder / name).is_dir()), None)
        transform = eval_transform(image_size)
        if (folder / "train").is_dir() and split is not None:
            train, test = _labeled(folder / "train"), _labeled(split)
            classes = sorted(set(train.classes) | set(test.classes))
            self.train_set = FolderDataset(_capped(train, max_images), transform)
            self.test_set = FolderDataset(_capped(test, max_images), transform)
            for dataset in (self.train_set, self.test_set):  # one label space across both splits
                dataset.targets = [classes.index(label) for label in dataset.images.labels]
        else:
            self.train_set = FolderDataset(_capped(_labeled(folder), max_images), transform)
            self.test_set = None
        self.folder, self.k, self.temperature = folder, k, temperature
        self.batch_size, self.workers = batch_size, workers

    def __len__(self) -> int:
        return len(self.train_set) + (len(self.test_set) if self.test_set is not None else 0)

    def evaluate(self, backbone: nn.Module, device: torch.device) -> float:
        """Top-1 accuracy in [0, 1] of weighted k-NN on the backbone's features."""
        train_x, train_y = extract_features(backbone, eval_loader(self.train_set, self.batch_size, self.workers), device)
        if self.test_set is None:
            return knn_accuracy(train_x, train_y, k=self.k, temperature=self.temperature)
        test_x, test_y = extract_features(backbone, eval_loader(self.test_set, self.batch_size, self.workers), device)
        return knn_accuracy(train_x, train_y, test_x, test_y, k=self.k, temperature=self.temperature)
