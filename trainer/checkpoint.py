"""Checkpoints: atomic writes, and loading with one-line errors for missing, corrupt or foreign files.

A checkpoint is a dict with ``format`` = :data:`CHECKPOINT_FORMAT`, ``format_version``, ``config`` (the
TrainConfig as a dict), ``model`` (the whole MoCo state: both encoders, the queue and its pointer),
``optimizer``, ``epoch`` (epochs completed), ``step`` (optimizer steps taken), ``rng`` states and ``run_id``.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from contracts.atomic import atomic_write
from contracts.errors import ArtifactError

LOG = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "moco-retrieval/checkpoint"
CHECKPOINT_VERSION = 1
LAST = "checkpoint_last.pt"


def save_atomic(obj: dict, path: str | Path) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (:mod:`contracts.atomic`): the old file or the new one."""
    with atomic_write(path, "wb", hint="free some space or choose another --out") as f:
        torch.save(obj, f)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run directory's ``checkpoint_last.pt``."""
    path = Path(path)
    if path.is_dir():
        path = path / LAST
    if not path.is_file():
        raise ArtifactError(f"no checkpoint at {path}")
    return path


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint (or a run directory's last one) on the CPU.

    Raises:
        ArtifactError: missing, unreadable, or not a moco-retrieval checkpoint.
    """
    path = resolve_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises many types for a corrupt or foreign file
        raise ArtifactError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ArtifactError(f"{path} is not a moco-retrieval checkpoint (train one with `moco train`)")
    if ckpt.get("format_version", 0) > CHECKPOINT_VERSION:
        raise ArtifactError(f"{path} was written by a newer moco-retrieval (format {ckpt['format_version']})")
    return ckpt
