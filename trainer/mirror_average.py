"""The mirror-averaged readout: an image's embedding is the mean of its features and its left-right mirror's
(issue 20).

MoCo trains with random horizontal flips, so an image and its mirror should embed alike, but a short CPU run
leaves them apart. Averaging the two (test-time augmentation by flipping) makes the readout exactly
mirror-invariant: a mirrored copy of a photo finds the original at distance zero, and the k-NN classifier sees
a less noisy view. Measured with ``bench/embedding_size.py --mirror`` on the 30-minute default runs (whitened
as ``moco export`` whitens, k-NN top-1 k = 20; ``bench/results/mirror_average_*.json``), plain ->
mirror-averaged at 64 px (the default size, :mod:`trainer.embedding_size`):

- Fashion-MNIST 60,000 / 10,000, seeds 0 / 1: 90.20 -> 90.77%, 89.93 -> 90.49%;
- seed 0: tuxpaint 52.75 -> 62.64%, openclipart 64.95 -> 66.50%, Oxygen icons 72.62 -> 72.22%.

4-minute default runs, seed 0: icons 71.0 -> 73.0%, openclipart 59.6 -> 63.4%, tuxpaint 51.7 -> 51.1%. Random
weights with fitted BN gain too (64 px, means of 3 seeds: openclipart 53.2 -> 58.2%, tuxpaint 43.6 -> 47.4%,
icons 70.6 -> 70.4%; Fashion-MNIST seed 0 83.94 -> 86.04%): averaging removes noise that a random network's
features carry. The cost is the encoder's work per image, twice.

``moco export`` bakes it into the ONNX graph by default (metadata ``mirror_average``; ``--mirror-average off``
for the backbone's features alone), before the whitening and the final normalisation, so indexing and serving
get it with no change to the encoder format; ``moco eval`` of a checkpoint reads out the same way.

    images [N, 3, H, W] --cat with flip(images)--> backbone --normalize--> [2, N, D] --sum--> [N, D]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIRROR_AVERAGE = True  # the default readout of `moco export` and `moco eval` of a checkpoint


def parse_mirror_average(value: str | None) -> bool | None:
    """``--mirror-average``'s value: ``on`` -> True, ``off`` -> False, not given (None) -> None (the default)."""
    return None if value is None else value == "on"


def mirror(images: torch.Tensor) -> torch.Tensor:
    """The left-right mirror of ``[N, C, H, W]`` images."""
    return images.flip(3)


class MirrorAveraged(nn.Module):
    """``normalize(backbone(x)) + normalize(backbone(mirror(x)))``: ``[N, 3, H, W]`` -> ``[N, D]`` float32.

    One backbone call on the ``2N`` images (the mirrors after the originals), so a traced graph keeps its batch
    dimension dynamic. The sum is not normalised: every reader normalises (or whitens, then normalises) next.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = F.normalize(self.backbone(torch.cat([images, mirror(images)])).float(), dim=1)  # 2N x D
        return features.reshape(2, -1, features.shape[1]).sum(0)


def readout(backbone: nn.Module, mirror_average: bool | None = None) -> tuple[nn.Module, bool]:
    """``(backbone read out as asked, whether it is mirror-averaged)``: wrapped in :class:`MirrorAveraged` when
    ``mirror_average`` is true, or None and :data:`MIRROR_AVERAGE` is; else ``backbone`` as it is."""
    mirror = MIRROR_AVERAGE if mirror_average is None else bool(mirror_average)
    return (MirrorAveraged(backbone) if mirror else backbone), mirror
