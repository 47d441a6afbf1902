"""Opening an indexed item's image file for serving: only the file that was indexed, checked at request time.

An index records each file's path relative to the image folder, its size and its mtime. Between indexing and
a request the file may have been deleted, replaced by a symlink to ``/etc/hostname``, by a FIFO, or by other
content. :func:`open_indexed_file` serves it only when, at request time, the path

- resolves (symlinks followed) to a place inside the image folder (as ``moco index`` requires of what it
  indexes), opened without following a link swapped in at the last step (``O_NOFOLLOW``) and without
  blocking (``O_NONBLOCK``: a FIFO never hangs the server);
- is a regular file (``fstat`` of the open descriptor, the same file that is then sent);
- has the recorded size and modification time (``mtime_ns``).

Otherwise it raises :class:`~contracts.errors.ImageGoneError` (HTTP 410) with the reason in one line; re-running
``moco index`` updates or drops the item.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from moco_retrieval.contracts.errors import ImageGoneError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.images import is_inside
from moco_retrieval.indexer.records import ItemRecord


def open_indexed_file(image_root: str | os.PathLike, record: ItemRecord) -> tuple[BinaryIO, os.stat_result]:
    """``(open binary file, its fstat)`` of ``record``'s image under ``image_root``, checked as above.

    Raises:
        ImageGoneError: the file is gone, outside the image folder, not a regular file, or changed since it was
            indexed.
    """
    what = f"the image of item {record.id} ({display_name(record.path)})"
    rerun = "re-run `moco index` to update the index"
    real_root = os.path.realpath(image_root)
    real = os.path.realpath(Path(image_root) / record.path)
    if not is_inside(real, real_root):
        raise ImageGoneError(f"{what} now resolves outside the image folder; not served ({rerun})")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise ImageGoneError(f"{what} is no longer on disk; {rerun}") from None
    except OSError as exc:  # ELOOP: a symlink put in place after the path was resolved
        raise ImageGoneError(f"{what} cannot be opened ({exc.strerror or exc}); {rerun}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageGoneError(f"{what} is no longer a regular file; {rerun}")
        if st.st_size != record.bytes or st.st_mtime_ns != record.mtime_ns:
            raise ImageGoneError(
                f"{what} changed since it was indexed ({st.st_size} bytes now, {record.bytes} indexed); {rerun}"
            )
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise
