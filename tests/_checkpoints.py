"""Real checkpoints without training: a model built from a config, made non-trivial, saved in the run format.

Training even one epoch costs tens of seconds on a shared CPU; export only needs a checkpoint file in the
format ``moco train`` writes. The BN running statistics are randomised (so eval-mode BN is not the identity)
and the momentum (key) encoder gets different weights from the query encoder, so a test can tell which one
an export used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moco_retrieval.trainer.checkpoint import write_random_init_checkpoint
from moco_retrieval.trainer.variants import build_model
from tests.conftest import tiny_train_config


def _non_trivial(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
        for param in model.encoder_k.parameters():  # a momentum encoder that differs from the query encoder
            param.add_(0.5 * torch.randn_like(param))


def write_checkpoint(data_dir: Path | None, run_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write ``run_dir/checkpoint_last.pt`` for ``tiny_train_config`` + ``overrides``; returns ``run_dir``."""
    cfg = tiny_train_config(data_dir or run_dir / "no-data", run_dir, run_id=f"test-run-{seed}", **overrides)
    return write_random_init_checkpoint(cfg, run_dir, seed=seed, change=_non_trivial, epoch=3, step=42)


def _saved_model(run_dir: Path) -> torch.nn.Module:
    from moco_retrieval.trainer.checkpoint import load_checkpoint
    from moco_retrieval.trainer.config import TrainConfig

    ckpt = load_checkpoint(run_dir)
    model = build_model(TrainConfig.from_dict(ckpt["config"]), bn_splits=1)
    model.load_state_dict(ckpt["model"])
    return model


def key_backbone(run_dir: Path) -> torch.nn.Module:
    """The momentum encoder's backbone of a checkpoint (the one an export must NOT use), eval mode."""
    return _saved_model(run_dir).encoder_k.backbone.eval()


def query_backbone(run_dir: Path) -> torch.nn.Module:
    """The query encoder's backbone of a checkpoint (the one export and ``--init`` use), eval mode."""
    return _saved_model(run_dir).encoder_q.backbone.eval()
