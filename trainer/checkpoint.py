"""Checkpoints: atomic writes, and safe loading with one-line errors for missing, corrupt, foreign or unsafe files.

A checkpoint is a dict with ``format`` = :data:`CHECKPOINT_FORMAT`, ``format_version``, ``config`` (the
TrainConfig as a dict), ``model`` (the whole MoCo state: both encoders, the queue and its pointer),
``optimizer``, ``epoch`` (epochs completed), ``batch_in_epoch``, ``step`` (optimizer steps taken), ``rng``
states, ``schedule`` (total and warm-up steps, time spent) and ``run_id``.

Everything in it is a tensor or a plain Python value (dict, list, tuple, str, int, float, bool, None), so it is
loaded with ``torch.load(weights_only=True)``: a crafted ``.pt`` cannot run code. Checkpoints of version 1
stored numpy's RNG state as an array and torch's version as its own string class; they still load, with
exactly those classes allowed. Anything else is refused with a one-line error.
"""

from __future__ import annotations

import logging
import pickle
import random
from pathlib import Path

import numpy as np
import torch

from moco_retrieval.contracts.atomic import WriteErrors, atomic_write
from moco_retrieval.contracts.errors import ArtifactError

LOG = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "moco-retrieval/checkpoint"
CHECKPOINT_VERSION = 2  # 2: only tensors and plain values (weights_only); numpy RNG state as a tensor
LAST = "checkpoint_last.pt"


def save_atomic(obj: dict, path: str | Path) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (:mod:`contracts.atomic`): the old file or the new one."""
    with atomic_write(path, "wb", hint="free some space or choose another --out") as f:
        with WriteErrors(f) as writer:  # a full disk: one line naming the file, not torch's "enforce fail"
            torch.save(obj, writer)


def checkpoint_dict(
    cfg,
    model: torch.nn.Module,
    *,
    epoch: int,
    step: int,
    optimizer=None,
    batch_in_epoch: int = 0,
    schedule: dict | None = None,
    rng: dict | None = None,
) -> dict:
    """The checkpoint of ``model`` (a whole MoCo model) trained as ``cfg`` (a resolved ``TrainConfig``), in the
    format of the module docstring: what ``moco train`` writes and ``moco export`` reads."""
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "run_id": cfg.run_id,
        "config": cfg.to_dict(),
        "model": model.state_dict(),
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "step": step,
        "torch_version": str(torch.__version__),
    }
    if optimizer is not None:
        ckpt["optimizer"] = optimizer.state_dict()
    if schedule is not None:
        ckpt["schedule"] = schedule
    if rng is not None:
        ckpt["rng"] = rng
    return ckpt


def write_random_init_checkpoint(
    cfg, run_dir: str | Path, seed: int = 0, num_images: int = 96, change=None, epoch: int = 0, step: int = 0
) -> Path:
    """``run_dir/checkpoint_last.pt`` of an untrained model of ``cfg`` (options left unset resolved by its
    recipe as for ``num_images`` images), for exports and benchmarks that need a real encoder but no training
    (the random-weights baseline). ``change(model)``, when given, edits the model before it is saved; ``epoch``
    and ``step`` are what the file claims (tests of the metadata an export copies). Returns ``run_dir``."""
    from moco_retrieval.trainer.recipes import resolve_for_images
    from moco_retrieval.trainer.variants import build_model

    cfg = resolve_for_images(cfg, num_images)
    torch.manual_seed(seed)
    model = build_model(cfg, bn_splits=1)
    if change is not None:
        change(model)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_atomic(checkpoint_dict(cfg, model, epoch=epoch, step=step), run_dir / LAST)
    return run_dir


def rng_state() -> dict:
    """The RNG states of torch, numpy, Python (and CUDA), as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    else:  # format 1: numpy's own tuple
        np.random.set_state(numpy_state)
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


def _format1_globals() -> list:
    """What a format-1 checkpoint holds besides tensors and plain values: numpy's RNG state as an array (array
    reconstruction only) and torch's version string class."""
    core = getattr(np, "_core", None) or np.core
    return [
        core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        torch.torch_version.TorchVersion,
    ]


def _refused_global(exc: Exception) -> bool:
    """True when torch's weights_only unpickler refused a global (a class or function the file names), rather
    than failing on bytes that are not a pickle at all."""
    return "unsupported global" in str(exc).lower()


def strip_wrappers(state: dict) -> dict:
    """Drop a leading ``module.`` (DDP) and every ``_orig_mod.`` (torch.compile) from a state dict's keys, should
    a checkpoint written by other code carry them; ``moco train`` saves the unwrapped model."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "module":
            parts = parts[1:]
        out[".".join(p for p in parts if p != "_orig_mod")] = value
    return out


def safe_load(path: Path, hint: str = "Use a checkpoint written by `moco train`"):
    """``torch.load(path, weights_only=True)`` on the CPU (format-1 checkpoints' numpy and version classes
    allowed): a file that names any other class or function is refused, so loading never runs its code.

    Raises:
        ArtifactError: the file holds objects other than tensors and plain values (``hint`` says what to do).
        Exception: whatever torch raises for a file that is not a readable pickle (callers make it one line).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not _refused_global(exc):
            raise  # not a pickle torch can read: corrupt or foreign
    with torch.serialization.safe_globals(_format1_globals()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if not _refused_global(exc):
                raise
            raise ArtifactError(
                f"{path} holds objects other than tensors and plain values; refusing to load it "
                f"(loading could run code). {hint}"
            ) from exc


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint (or a run directory's last one) on the CPU, without running any code it might hold.

    Raises:
        ArtifactError: missing, unreadable, unsafe, or not a moco-retrieval checkpoint.
    """
    path = resolve_checkpoint(path)
    try:
        ckpt = safe_load(path)
    except ArtifactError:
        raise
    except Exception as exc:  # torch raises many types for a corrupt or foreign file
        raise ArtifactError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ArtifactError(f"{path} is not a moco-retrieval checkpoint (train one with `moco train`)")
    if ckpt.get("format_version", 0) > CHECKPOINT_VERSION:
        raise ArtifactError(f"{path} was written by a newer moco-retrieval (format {ckpt['format_version']})")
    return ckpt
