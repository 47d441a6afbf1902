"""Shared fixtures: small generated image folders (the embedded default data, at test size)."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainer.demo_data import write_demo_dataset


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> Path:
    """8 classes x 12 images of 32 px generated shapes (96 images), shared read-only by tests."""
    return write_demo_dataset(tmp_path_factory.mktemp("shapes") / "data", per_class=12, size=32, seed=1)


def tiny_train_config(data_dir: Path, out_dir: Path, **overrides):
    """A ResNet-18 MoCo v2 config small enough for a CPU test: 32 px, batch 16, queue 32, no k-NN monitor."""
    from trainer.config import TrainConfig

    values = dict(
        data_dir=str(data_dir), out_dir=str(out_dir), arch="resnet18", stem="imagenet", image_size=32, epochs=2,
        batch_size=16, queue_size=32, workers=0, device="cpu", knn_every=0, log_every=1,
    )
    values.update(overrides)
    return TrainConfig(**values)
