"""Shared fixtures: small generated image folders (the embedded default data, at test size), and an image
cache of the test session's own (never the user's ~/.cache)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from moco_retrieval.trainer.demo_data import write_demo_dataset

# every training run of the suite, in this process or a subprocess, caches its decoded images here
os.environ["MOCO_CACHE_DIR"] = tempfile.mkdtemp(prefix="moco-test-cache-")
atexit.register(shutil.rmtree, os.environ["MOCO_CACHE_DIR"], True)


# The most the suite holds on disk at once (its temporary folders and image caches), with margin: 2.8 GB at its
# peak in a full clean-clone run with pyproject's tmp_path_retention_policy = "failed" (12 GB kept without it).
SUITE_DISK_NEED_GB = 3.0


def pytest_sessionstart(session) -> None:
    """Too little free space under the temporary folder ends the session at once with one line, not with
    hundreds of tests erroring at ``tmp_path`` once the disk has filled halfway through."""
    where = tempfile.gettempdir()
    free_gb = shutil.disk_usage(where).free / 1e9
    if free_gb < SUITE_DISK_NEED_GB:
        pytest.exit(
            f"the suite needs about {SUITE_DISK_NEED_GB:.0f} GB free under {where} and {free_gb:.1f} GB are free "
            "there: free some space, or point TMPDIR at a disk with room",
            returncode=1,
        )


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> Path:
    """8 classes x 12 images of 32 px generated shapes (96 images), shared read-only by tests."""
    return write_demo_dataset(tmp_path_factory.mktemp("shapes") / "data", per_class=12, size=32, seed=1)


def tiny_train_config(data_dir: Path, out_dir: Path, **overrides):
    """A ResNet-18 MoCo v2 config small enough for a CPU test: 32 px, batch 16, queue 32, no k-NN monitor."""
    from moco_retrieval.trainer.config import TrainConfig

    values = dict(
        data_dir=str(data_dir),
        out_dir=str(out_dir),
        arch="resnet18",
        stem="imagenet",
        image_size=32,
        epochs=2,
        batch_size=16,
        queue_size=32,
        workers=0,
        device="cpu",
        knn_every=0,
        log_every=1,
    )
    values.update(overrides)
    return TrainConfig(**values)


def resolved_config(cfg, num_images: int = 96):
    """``cfg`` with every option a recipe would fill filled (as the run would, on ``num_images`` images)."""
    from moco_retrieval.trainer.recipes import resolve_for_images

    return resolve_for_images(cfg, num_images)


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` of a child the test will press Ctrl-C in (``SIGINT``): Python turns it into
    KeyboardInterrupt only when the signal is not ignored at start, and a suite launched from a background job
    (``cmd &``, ``nohup``) passes SIGINT on ignored, so the child ran to its end and the test failed."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
