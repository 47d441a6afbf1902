"""An encoder's BatchNorm statistics re-estimated on the collection it will embed, at the size it embeds at.

Training leaves each BatchNorm layer with running statistics of augmented crops at the training size, averaged
over split-BN groups of a few dozen images (or one GPU's batch): not the whole, unaugmented images at the
export's size that the encoder will embed. Re-estimating them there (FixRes, Touvron et al., NeurIPS 2019;
AdaBN, Li et al., 2016) changes no weight, only those statistics. ``moco export`` does it on the whitening's
sample of the data folder, before fitting the whitening; the random-weights baseline of issue 20 (random BN)
has its statistics fitted the same way, so both are read out alike.

    backbone [N, 3, H, W] -> [N, D] in eval mode; refit_bn_statistics(backbone, H, paths) keeps every weight
    and sets each BatchNorm's running_mean / running_var to the mean of its batch statistics over ``paths`` at H px
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader

from moco_retrieval.contracts.errors import ConfigError

if TYPE_CHECKING:
    from moco_retrieval.trainer.whitening import WhiteningSample

LOG = logging.getLogger(__name__)

REFIT_BN_MIN_IMAGES = 200  # fewer readable images: the training's statistics stay
REFIT_BN_BATCH = 256  # images per batch whose statistics are averaged
REFIT_BN_CHOICES = ("auto", "off")


def has_batch_norm(backbone: nn.Module) -> bool:
    """Whether ``backbone`` has BatchNorm layers (a ViT has LayerNorm only: nothing to re-estimate)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in backbone.modules())


def _statistics(backbone: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.clone()
        for k, v in backbone.state_dict().items()
        if k.rsplit(".", 1)[-1].startswith(("running_", "num_batches"))
    }


@torch.no_grad()
def refit_bn_statistics(
    backbone: nn.Module,
    image_size: int,
    paths: list[Path],
    min_images: int = 2,
    batch_size: int = REFIT_BN_BATCH,
    workers: int = 0,
) -> int:
    """Replace ``backbone``'s BatchNorm running statistics, in place, by those of ``paths`` at ``image_size``.

    Args:
        backbone: ``[N, 3, H, W] -> [N, D]``; left in eval mode.
        image_size: the side the images are embedded at (through ``trainer.eval_transform``).
        paths: image files; unreadable ones are left out.
        min_images: fewer readable images than this leave the statistics as they were.

    Returns:
        how many images the statistics came from (below ``min_images``: none, they are unchanged).
    """
    from moco_retrieval.trainer.eval_transform import eval_transform
    from moco_retrieval.trainer.evaluate import _Images, _stack_readable

    loader = DataLoader(
        _Images(paths, eval_transform(image_size), skip_unreadable=True),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_stack_readable,
    )
    seen = 0

    def batches():  # streamed: 10,000 images at 224 px would be 6 GB held at once
        nonlocal seen
        for x in loader:
            if x is not None and len(x) > 1:  # a batch of one has no batch statistics
                seen += len(x)
                yield x

    before = _statistics(backbone)
    update_bn(batches(), backbone)
    if seen < min_images:
        backbone.load_state_dict(before, strict=False)
    backbone.eval()
    return seen


def refit_for_export(
    backbone: nn.Module,
    image_size: int,
    data_dir: str | Path | None,
    setting: str = "auto",
    workers: int = 0,
    min_images: int | None = None,
    listing: Callable[[], WhiteningSample] | None = None,
) -> str:
    """What ``moco export`` does to ``backbone``'s BatchNorm statistics before fitting the whitening, in one line
    for the encoder's metadata (no path in it: the log names the folder).

    Args:
        setting: ``auto`` (re-estimate them on the whitening's sample of ``data_dir``, at ``image_size``, when at
            least ``min_images`` of them are readable) or ``off``.
        min_images: default :data:`REFIT_BN_MIN_IMAGES`.
        listing: ``data_dir``'s sample when the caller lists the folder once for the refit and the whitening;
            default ``sample_images(data_dir)`` (at most :data:`trainer.whitening.WHITEN_MAX_IMAGES` images).

    Raises:
        ConfigError: ``setting`` is neither.
    """
    from moco_retrieval.trainer.whitening import sample_images

    min_images = REFIT_BN_MIN_IMAGES if min_images is None else min_images
    if setting not in REFIT_BN_CHOICES:
        raise ConfigError(f"--refit-bn must be auto or off, got {setting!r}")
    if setting == "off":
        return "training's (--refit-bn off)"
    if not has_batch_norm(backbone):
        return "none (no BatchNorm layers)"
    if not data_dir or not Path(data_dir).is_dir():
        LOG.warning("BatchNorm statistics stay the training's: the data folder %s is not available", data_dir)
        return "training's (the data folder is not available)"
    sample = listing() if listing else sample_images(data_dir)
    if len(sample.paths) < min_images:
        return f"training's (only {len(sample.paths)} images, fewer than {min_images})"
    LOG.info("re-estimating BatchNorm statistics on %d images of %s at %d px", len(sample.paths), data_dir, image_size)
    seen = refit_bn_statistics(backbone, image_size, sample.paths, min_images, workers=workers)
    if seen < min_images:
        return f"training's (only {seen} readable images, fewer than {min_images})"
    return f"refit on {seen} images at {image_size} px"
