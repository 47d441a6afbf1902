"""The deterministic evaluation preprocessing of one image, as torchvision transforms v2: the policy the ONNX
export declares (``contracts.encoder_format.RESIZE_POLICY``): resize the shorter side to the model size,
center-crop a square, scale to [0, 1] and normalize with the ImageNet mean/std.

Used where images are decoded one by one (``moco eval`` on a checkpoint, the export's parity check). Training
and its k-NN monitor work on cached batches instead (:mod:`trainer.batch_augment`, :mod:`trainer.monitor`).
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2 as T

from moco_retrieval.contracts.encoder_format import IMAGENET_MEAN, IMAGENET_STD


def eval_transform(image_size: int) -> T.Compose:
    """Deterministic preprocessing for features: shorter side to ``image_size``, center crop, normalize."""
    return T.Compose(
        [
            T.Resize(image_size, antialias=True),
            T.CenterCrop(image_size),
            T.ToImage(),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
