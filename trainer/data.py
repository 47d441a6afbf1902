"""Batches of cached images (:mod:`trainer.image_cache`): the loader only gathers rows of uint8 pixels.

A training batch is ``(pixels uint8 [B, S, S, 3], sizes int64 [B, 2], labels int64 [B], indices int64 [B])``;
the augmentations then run on the whole batch on the training device (:mod:`trainer.batch_augment`). The order
of an epoch depends only on the seed and the epoch (``DistributedSampler``), so a run resumed part-way into an
epoch skips exactly the batches it had done.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from moco_retrieval.trainer.image_cache import CachedImages


class CachedBatchDataset(Dataset):
    """Batches of a :class:`CachedImages` view: ``dataset[[i, j, ...]]`` gathers those images' rows.

    The rows file is memory-mapped on first use in each process (loader workers included), so the page cache
    is shared and nothing large is pickled. The view's claim on the file (:class:`CachedImages`) lives as long
    as the dataset, so no other run's update deletes it before the first batch or during the run.
    """

    def __init__(self, cached: CachedImages, labels: list[int]):
        self.cached = cached
        self.labels = torch.as_tensor(labels, dtype=torch.int64)
        self.rows = torch.from_numpy(cached.rows)
        self.sizes = torch.from_numpy(cached.sizes)
        self._pixels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.cached)

    def __getitem__(self, indices):
        if self._pixels is None:
            self._pixels = self.cached.open()
        idx = torch.as_tensor(indices, dtype=torch.int64)
        rows = self.rows[idx].numpy()
        order = np.argsort(rows, kind="stable")  # read the file forwards; put the batch back in sampler order
        gathered = np.empty((len(rows), *self._pixels.shape[1:]), dtype=np.uint8)
        gathered[order] = self._pixels[rows[order]]
        return torch.from_numpy(gathered), self.sizes[idx], self.labels[idx], idx

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pixels"] = None  # each worker maps the file itself
        return state


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch: set ``skip`` to the number of this rank's
    samples already trained on (the order of an epoch depends only on the seed and the epoch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip :])

    def __len__(self) -> int:
        return super().__len__() - self.skip


def training_loader(
    dataset: CachedBatchDataset, batch_size: int, workers: int, rank: int, world_size: int, seed: int, pin_memory: bool
) -> DataLoader:
    """Shuffled batches of this rank's share of ``dataset``; ``batch_size`` is per process; the last incomplete
    batch is dropped (MoCo's queue needs equal batches). Call ``epoch_sampler(loader).set_epoch(e)`` each
    epoch, and set its ``skip`` to resume inside an epoch."""
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    batches = BatchSampler(sampler, batch_size, drop_last=True)
    return DataLoader(
        dataset,
        sampler=batches,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


def epoch_sampler(loader: DataLoader) -> ResumableSampler:
    """The per-sample sampler of a :func:`training_loader` (under its BatchSampler)."""
    return loader.sampler.sampler


def eval_batches(dataset: CachedBatchDataset, batch_size: int):
    """The images of ``dataset`` in order, ``batch_size`` at a time (in this process)."""
    for start in range(0, len(dataset), batch_size):
        yield dataset[list(range(start, min(len(dataset), start + batch_size)))]
