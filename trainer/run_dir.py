"""One ``moco train`` per run directory, and what killed writes left in it.

A run holds ``RUN_DIR/.lock`` (:mod:`contracts.locks`) from before it reads the directory until it ends, so a
second ``moco train`` on the same ``--out`` is refused in one line (two runs used to train side by side and
append the same steps twice to ``metrics.jsonl``). Under torchrun only rank 0 holds it; the other ranks write
nothing there. With the lock held, the run deletes the temporary files that atomic writes killed mid-way
(kill -9 during a checkpoint write) left behind: a 130 MB ``.checkpoint_last.pt.*.tmp`` each, which no run
used to remove.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import ExitStack
from pathlib import Path

from moco_retrieval.contracts.atomic import remove_stale_temp_files
from moco_retrieval.contracts.errors import ArtifactError
from moco_retrieval.contracts.locks import directory_lock
from moco_retrieval.trainer import dist

LOG = logging.getLogger(__name__)

COMMAND = "moco train"
# what the run writes atomically into its directory: only these temporary files are its own to delete
# (an export into the run directory, running meanwhile, writes its own)
_RUN_FILES = re.compile(r"^(checkpoint_(last|\d+)\.pt|config\.json|metrics\.jsonl|metrics\.png|skipped_files\.txt)$")


class RunDirLock:
    """The run directory's writer lock, taken once (:meth:`acquire`) and held until the ``with`` block ends."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self._stack = ExitStack()
        self.held = False

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self.held = False

    def acquire(self) -> None:
        """Take the lock (rank 0 only; a no-op once held) and delete stale temporary files. The run directory
        must exist.

        Raises:
            ArtifactError: another ``moco train`` holds it.
        """
        if self.held or dist.rank() != 0:
            return
        self._stack.enter_context(directory_lock(self.run_dir, COMMAND))
        self.held = True
        removed, freed = remove_stale_temp_files(self.run_dir, lambda name: bool(_RUN_FILES.match(name)))
        if removed:
            LOG.warning(
                "removed %d temporary file%s (%.1f MB) that a killed run left in %s",
                removed,
                "" if removed == 1 else "s",
                freed / 1e6,
                self.run_dir,
            )

    def acquire_if_present(self) -> None:
        """Before anything else, where the run directory already exists (a rerun): refuse a second run at once,
        on every rank, rather than after the scan. A directory that does not exist yet is locked when it is
        created; one that cannot be written is left to the writable check, whose message says so."""
        error = None
        if dist.rank() == 0 and self.run_dir.is_dir() and os.access(self.run_dir, os.W_OK):
            try:
                self.acquire()
            except ArtifactError as exc:
                error = str(exc)
        error = dist.broadcast_object(error)
        if error is not None:
            raise ArtifactError(error)
