"""The one-writer lock of an output directory: ``moco train``'s run directory and ``moco index``'s index directory.

A writer holds an exclusive ``flock`` on ``DIR/.lock`` for its whole run; a second writer of the same directory
is refused at once, in one line, instead of writing beside the first (two trainings on one ``--out`` used to
append the same steps twice to ``metrics.jsonl``). The kernel drops the lock when its process ends, however it
ends, so a killed run never leaves the directory locked. Where there is no ``flock`` (not POSIX) nothing is
locked.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moco_retrieval.contracts.atomic import output_errors
from moco_retrieval.contracts.errors import ArtifactError

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None

LOCK_FILE = ".lock"


@contextmanager
def writer_lock(lock_file: str | os.PathLike, command: str, directory: str | os.PathLike) -> Iterator[None]:
    """Hold ``lock_file`` (created if needed) exclusively while the block runs.

    Args:
        lock_file: the lock file, inside ``directory`` (which must exist).
        command: the writer, as the user typed it (``"moco train"``), for the message.
        directory: what the lock protects, for the message.

    Raises:
        ArtifactError: ``"another `<command>` is writing <directory>; wait for it to finish"``.
        OutputError: the lock file cannot be created.
    """
    if fcntl is None:
        yield
        return
    with output_errors(lock_file):
        f = open(lock_file, "a+")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArtifactError(f"another `{command}` is writing {directory}; wait for it to finish") from None
        yield
    finally:
        f.close()


def directory_lock(directory: str | os.PathLike, command: str) -> Iterator[None]:
    """:func:`writer_lock` on ``directory/.lock``."""
    return writer_lock(Path(directory) / LOCK_FILE, command, directory)
