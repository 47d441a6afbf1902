"""Spreading the embedding of one ``moco index`` run over several processes, GPUs or machines: which files
each rank embeds, and how rank 0 learns that the others are done. Torch-free: ranks meet through files.

Launched by ``torchrun`` (or SLURM; see :mod:`contracts.launch`), every rank scans the folder and plans the
run against the live generation itself (the same deterministic plan on every rank: the scan is sorted and
the generation is read-only), then embeds its part: the plan's files in chunks of ``shard_size``, chunk
``c`` going to rank ``c % world_size``. It writes its results as its own resumable shards
(:mod:`indexer.shards`), touches a progress file as each shard is written, and finally a *done marker*
holding a digest of the files it was given::

    work/<model>/rank_001.progress    files of its part done so far (rewritten after every shard)
    work/<model>/rank_001.done        {"digest", "files", "world_size"}: its whole part is in finished shards

Rank 0 embeds its own part, then waits until every other rank's marker holds the digest of *that rank's
part of rank 0's plan*. A marker left by an earlier launch with the same plan counts too: it means that
work is already in finished shards. Rank 0 then looks every planned file up in the shards of all ranks,
embeds whatever is still missing itself (a file another rank did not see), builds and publishes; the other
ranks just exit. If a rank stops making progress (killed, crashed, hung) for ``timeout`` seconds, rank 0
stops with a one-line error; rerunning the same command resumes every rank from its finished shards.

Why files rather than ``torch.distributed``: the indexer stays torch-free and runs on every backend and
launcher (gloo, NCCL or none); the shards have to be on a filesystem every rank sees anyway.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from moco_retrieval.contracts.atomic import write_json_atomic, write_text_atomic
from moco_retrieval.contracts.errors import IndexBuildError
from moco_retrieval.contracts.launch import WorldInfo, world_info_from_env

LOG = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # how long rank 0 waits for a rank that makes no progress
POLL_S = 0.2

__all__ = ["WorldInfo", "world_info_from_env", "part_of_plan", "plan_digest", "Rendezvous", "DEFAULT_TIMEOUT_S"]


def part_of_plan(entries: Sequence, rank: int, world_size: int, chunk: int) -> list:
    """The entries of ``rank``: chunks of ``chunk`` consecutive entries, dealt round-robin over the ranks."""
    if world_size <= 1:
        return list(entries)
    return [e for i, e in enumerate(entries) if (i // chunk) % world_size == rank]


def plan_digest(entries: Sequence) -> str:
    """sha256 of the (path, size, mtime) of ``entries``: equal digests mean the same work."""
    h = hashlib.sha256()
    for e in entries:
        h.update(f"{e.path}\0{e.bytes}\0{e.mtime_ns}\n".encode())
    return h.hexdigest()


class Rendezvous:
    """The files ranks of one run meet through, in the shard folder of their model."""

    def __init__(self, folder: Path, world: WorldInfo, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.folder = Path(folder)
        self.world = world
        self.timeout_s = timeout_s

    def _progress(self, rank: int) -> Path:
        return self.folder / f"rank_{rank:03d}.progress"

    def _done(self, rank: int) -> Path:
        return self.folder / f"rank_{rank:03d}.done"

    def progress(self, files_done: int) -> None:
        """Tell rank 0 this rank is alive and how far it got."""
        write_text_atomic(self._progress(self.world.rank), f"{files_done} {time.time():.3f}\n")

    def mark_done(self, digest: str, files: int) -> None:
        write_json_atomic(
            self._done(self.world.rank), {"digest": digest, "files": files, "world_size": self.world.world_size}
        )

    def _read_done(self, rank: int) -> str | None:
        try:
            return json.loads(self._done(rank).read_text()).get("digest")
        except (OSError, ValueError, AttributeError):
            return None

    def _read_progress(self, rank: int) -> str | None:
        try:
            return self._progress(rank).read_text()
        except OSError:
            return None

    def wait_for_peers(self, digests: dict[int, str], on_wait: Callable[[list[int]], None] | None = None) -> None:
        """Rank 0: return once every rank in ``digests`` has marked that part done.

        Raises:
            IndexBuildError: a rank made no progress for ``timeout_s`` seconds.
        """
        waiting = {r for r, d in digests.items() if r != self.world.rank}
        last_seen = {r: (self._read_progress(r), time.monotonic()) for r in waiting}
        told = False
        while waiting:
            for r in sorted(waiting):
                if self._read_done(r) == digests[r]:
                    waiting.discard(r)
                    continue
                seen = self._read_progress(r)
                if seen != last_seen[r][0]:
                    last_seen[r] = (seen, time.monotonic())
                elif time.monotonic() - last_seen[r][1] > self.timeout_s:
                    raise IndexBuildError(
                        f"rank {r} of {self.world.world_size} made no progress for {self.timeout_s:.0f} s (stopped, "
                        "killed or hung); rerun the same command to resume (finished shards are kept), or raise "
                        "--rank-timeout"
                    )
            if waiting:
                if not told:
                    LOG.info("rank 0 done with its part; waiting for ranks %s", ", ".join(map(str, sorted(waiting))))
                    if on_wait is not None:
                        on_wait(sorted(waiting))
                    told = True
                time.sleep(POLL_S)
