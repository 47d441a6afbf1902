"""The launcher's environment, read in one place: which process of how many this is.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` for every process it
starts (on one node or many); SLURM's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and
``SLURM_NTASKS_PER_NODE`` stand in when torchrun's are absent. Without a launcher a process is rank 0 of 1.
``trainer.dist`` joins a torch process group with it; ``indexer.ranks`` (torch-free) splits the embedding
work of ``moco index`` with it and meets the other ranks through files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WorldInfo:
    local_rank: int  # this process's number on its node (the GPU it should use)
    rank: int  # this process's number among all of them, 0 .. world_size - 1
    world_size: int  # processes in the job, on all nodes
    local_world_size: int = 1  # processes on this node (they share its cores)


def _int(env, *names: str, default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(str(value).split("(")[0].split(",")[0])  # SLURM writes e.g. "2(x3)" per node
            except ValueError:
                continue
    return default


def world_info_from_env(env=None) -> WorldInfo:
    """Read the launcher's environment (torchrun, or SLURM's variables when torchrun's are absent)."""
    env = os.environ if env is None else env
    local_rank = _int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0)
    rank = _int(env, "RANK", "SLURM_PROCID", default=0)
    world_size = _int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_world = _int(env, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=1 if world_size == 1 else 0)
    if local_world < 1:  # a launcher that does not say: assume every process is on this node
        local_world = world_size
    return WorldInfo(local_rank, rank, world_size, local_world)
