"""Launched by torchrun from the distributed tests: train from a TrainConfig JSON, dump this rank's state.

    torchrun --standalone --nproc_per_node=2 tests/_dist_worker.py CONFIG.json OUT_PREFIX

Each rank writes ``OUT_PREFIX.rank<R>.pt`` with its model's parameters and buffers after training.
"""

import os
import sys

import torch

from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.train import train


def main() -> None:
    config_path, prefix = sys.argv[1], sys.argv[2]
    cfg = TrainConfig.load(config_path)
    result = train(cfg)
    state = {
        "params": {k: v.detach().cpu() for k, v in result.model.named_parameters()},
        "buffers": {k: v.detach().cpu() for k, v in result.model.named_buffers()},
        "steps": result.steps,
    }
    torch.save(state, f"{prefix}.rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
