"""Two real gloo processes under torchrun train MoCo v2: both ranks end with identical parameters and queues."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_train_config

pytestmark = pytest.mark.dist
WORKER = Path(__file__).with_name("_dist_worker.py")


def run_two_ranks(cfg, prefix: Path, timeout: int = 300) -> list[dict]:
    """Train ``cfg`` with two gloo processes; return each rank's dumped state."""
    config_path = prefix.with_suffix(".json")
    config_path.write_text(cfg.to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(WORKER),
            str(config_path),
            str(prefix),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize(
    "objective",
    [{}, {"small_crops": 2, "small_crop_size": 16}, {"symmetric": True}],
    ids=["two_views", "small_crops", "symmetric"],
)
def test_ddp_v2__ranks_end_with_identical_parameters_and_queue(shapes_dir, tmp_path, objective):
    """Also with multi-crop, whose small crops' forward leaves BN's running statistics alone, and with the
    symmetric loss, whose two query forwards and two cross-process key shuffles run inside the one DDP forward of
    each step."""
    cfg = tiny_train_config(shapes_dir, tmp_path / "run", epochs=1, batch_size=16, queue_size=32)
    cfg = cfg.replace(**objective)
    rank0, rank1 = run_two_ranks(cfg, tmp_path / "state")
    assert rank0["steps"] == rank1["steps"] == 96 // 16
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    assert torch.equal(rank0["buffers"]["queue"], rank1["buffers"]["queue"])
    assert int(rank0["buffers"]["queue_ptr"]) == (6 * 16) % 32
    # training moved the weights: the query encoder differs from a fresh initialisation's key copy
    assert not torch.equal(rank0["params"]["encoder_q.head.0.weight"], rank0["params"]["encoder_k.head.0.weight"])
    assert (tmp_path / "run" / "checkpoint_last.pt").exists()
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["small_crops"] == objective.get("small_crops", 0)
    assert saved["symmetric"] is objective.get("symmetric", False)


def test_ddp_v2__time_budget_run_plans_and_stops_at_the_same_step_on_every_rank(shapes_dir, tmp_path):
    cfg = tiny_train_config(shapes_dir, tmp_path / "run", epochs=None, time_budget="8s", batch_size=16, queue_size=32)
    rank0, rank1 = run_two_ranks(cfg, tmp_path / "state")
    assert rank0["steps"] == rank1["steps"] > 0  # rank 0's clock decided for both
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name  # the same schedule on both ranks
