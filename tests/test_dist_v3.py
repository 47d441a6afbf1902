"""Two real gloo processes under torchrun train MoCo v3 (keys gathered across ranks): identical parameters."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_train_config
from tests.test_dist import run_two_ranks

pytestmark = pytest.mark.dist


def test_ddp_v3__ranks_end_with_identical_parameters(shapes_dir, tmp_path):
    cfg = tiny_train_config(
        shapes_dir,
        tmp_path / "run",
        moco_version=3,
        epochs=1,
        batch_size=16,
        dim=16,
        mlp_hidden=32,
        lr=1.0,
        lr_scale=False,
    )
    rank0, rank1 = run_two_ranks(cfg, tmp_path / "state")
    assert rank0["steps"] == rank1["steps"] == 96 // 16
    assert "queue" not in rank0["buffers"]
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    # the query encoder and predictor trained (LARS moved them); the key encoder followed by EMA, not equal yet
    assert not torch.equal(rank0["params"]["encoder_q.head.0.weight"], rank0["params"]["encoder_k.head.0.weight"])
    assert any(name.startswith("predictor.") for name in rank0["params"])
    assert (tmp_path / "run" / "checkpoint_last.pt").exists()
