"""Everything distributed, in one place: launch environment, process group, rank helpers, gathers.

Every function works without a process group (one process, ``rank() == 0``, ``world_size() == 1``), so the
model and the loop never branch on how they were started.

Launch with torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)::

    # one machine, 8 GPUs (NCCL)
    torchrun --nproc_per_node=8 -m moco_retrieval train DATA --out RUN
    # two machines, 8 GPUs each: run on both, with node_rank 0 and 1
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST0 --master_port=29500 \\
        -m moco_retrieval train DATA --out RUN
    # two CPU processes (gloo), e.g. for tests
    torchrun --nproc_per_node=2 -m moco_retrieval train DATA --out RUN --device cpu
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as tdist

from moco_retrieval.contracts.launch import WorldInfo, world_info_from_env  # noqa: F401 (re-exported: the one home)

LOG = logging.getLogger(__name__)


def init(device: torch.device) -> WorldInfo:
    """Join the process group when launched with more than one process (NCCL on CUDA, gloo on CPU).

    With one process this does nothing, so ``moco train`` needs no launcher.
    """
    info = world_info_from_env()
    if info.world_size > 1 and not tdist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        tdist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=60))
        LOG.info("joined process group: rank %d of %d (%s)", info.rank, info.world_size, backend)
    return info


def cleanup() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        tdist.barrier()


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy ``x`` from rank ``src`` to every rank, in place; returns ``x``."""
    if is_distributed():
        tdist.broadcast(x, src)
    return x


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from rank ``src`` to all ranks."""
    if not is_distributed():
        return obj
    holder = [obj]
    tdist.broadcast_object_list(holder, src)
    return holder[0]


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ranks (a new tensor)."""
    if not is_distributed():
        return x.clone()
    y = x.clone()
    tdist.all_reduce(y)
    return y / world_size()


@torch.no_grad()
def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` ([n, ...], same n on every rank) from all ranks in rank order: [world*n, ...].

    No gradient flows back through the result (MoCo's keys and shuffle-BN need none).
    """
    if not is_distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    tdist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def gather_objects(obj) -> list:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out
