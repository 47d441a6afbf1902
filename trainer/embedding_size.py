"""The input size an encoder embeds at, which is not always the size it trained at (issue 20).

A ResNet whose last stage is a 1x1 map at its training size (the ImageNet stem at 32 px and less, what a CPU
run trains by default) embeds at :data:`EMBED_SCALE` times that size: its layer4 then sees a 2x2 map, and the
objects are as large as the random crops showed them in training (FixRes: Touvron et al., 2019). Measured on
the 30-minute default runs (ResNet-18 at 32 px, k-NN top-1 k = 20, PCA-whitened as ``moco export`` whitens,
mean of the seeds' runs; ``bench/results/embedding_size_30m.json``), embedded at 32 / 48 / 64 px:

- Fashion-MNIST (60,000 / 10,000; 2 seeds): 87.3 / 89.7 / 90.3%;
- Oxygen icons (3 seeds): 69.2 / 71.4 / 73.0%; openclipart (3): 60.7 / 63.4 / 63.5%; tuxpaint (3): 56.6 /
  58.1 / 58.6%.

Every other encoder embeds at its training size: where the last map is larger than 1x1, nothing was measured,
and a ViT's position embeddings are made for its own grid. ``moco export --image-size`` (and ``moco eval
--image-size``) overrides the choice; the encoder's metadata keeps the training size (``trained_image_size``).
The costs: the encoder's work per image grows with the square of the size (4x at 64 px instead of 32).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moco_retrieval.trainer.backbones import last_map_side

EMBED_SCALE = 2  # a ResNet with a 1x1 last map embeds at this times its training size


@dataclass(frozen=True)
class EmbeddingSize:
    """``size``: the side an encoder embeds at; ``trained``: the side it trained at; ``why``: one line."""

    size: int
    trained: int
    why: str


def embedding_size(backbone: nn.Module, trained: int, requested: int | None = None) -> EmbeddingSize:
    """The size ``backbone`` (trained at ``trained`` px) embeds at: ``requested`` when given, else
    :data:`EMBED_SCALE` x ``trained`` for a ResNet whose last map is 1x1 at ``trained``, else ``trained``."""
    if requested is not None:
        why = "the training size" if requested == trained else f"--image-size {requested} (trained at {trained} px)"
        return EmbeddingSize(requested, trained, why)
    if last_map_side(backbone, trained) != 1:
        return EmbeddingSize(trained, trained, "the training size")
    size = EMBED_SCALE * trained
    return EmbeddingSize(
        size,
        trained,
        f"{EMBED_SCALE}x the training size {trained} px, where the last stage reads a 1x1 map (2-4 k-NN points "
        "more on four real collections; --image-size chooses another)",
    )
