"""Datasets and loaders over an image folder: two-view training samples and labeled evaluation samples.

An image that fails to decode at training time (truncated after the scan, deleted, corrupt) never crashes an
epoch: the dataset serves the next readable image in its place and flags the failed index, and the loop
records the file in the run directory's ``skipped_files.txt``.
"""
from __future__ import annotations

import logging

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from contracts.errors import DataError
from contracts.images import decode_image
from trainer.imagefolder import ImageList

LOG = logging.getLogger(__name__)


class FolderDataset(Dataset):
    """Images of an :class:`ImageList` through ``transform``.

    Each item is ``(transformed, label_index, index, ok)``; ``ok`` is False when the image at ``index`` could
    not be decoded and a neighbouring image was served instead (so batch shapes never change).
    """

    def __init__(self, images: ImageList, transform):
        self.images = images
        self.transform = transform
        self.targets = images.label_indices()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        ok = True
        for attempt in range(len(self.images)):
            i = (index + attempt) % len(self.images)
            try:
                image = decode_image(self.images.root / self.images.paths[i])
            except DataError as exc:
                LOG.warning("cannot decode %s: %s", self.images.paths[i], exc)
                ok = False
                continue
            return self.transform(image), self.targets[i], index, ok
        raise RuntimeError("no image in the dataset can be decoded")  # scan guarantees this cannot happen


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch: set ``skip`` to the number of this rank's
    samples already trained on (the order of an epoch depends only on the seed and the epoch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self) -> int:
        return super().__len__() - self.skip


def training_loader(
    dataset: Dataset, batch_size: int, workers: int, rank: int, world_size: int, seed: int, pin_memory: bool
) -> DataLoader:
    """Shuffled loader over this rank's share of ``dataset``; ``batch_size`` is per process; drops the last
    incomplete batch (MoCo's queue needs equal batches). Call ``loader.sampler.set_epoch(e)`` each epoch, and
    set ``loader.sampler.skip`` to resume inside an epoch."""
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin_memory,
        drop_last=True, persistent_workers=False,
    )


def eval_loader(dataset: Dataset, batch_size: int, workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers)
