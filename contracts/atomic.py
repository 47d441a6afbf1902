"""Atomic file writes, the one implementation every stage uses: write a temporary file in the target's folder,
flush and fsync it, rename it over the target, fsync the folder. A crash at any moment leaves the old file or
the new one, never a half-written one, and a failure removes the temporary file.

An ``OSError`` while writing becomes an :class:`~contracts.errors.OutputError` with a one-line message
(:class:`output_errors`), so a full disk reads "disk full while writing X", not a traceback.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

from moco_retrieval.contracts.errors import OutputError

# mkstemp creates files readable by their owner only; a published file gets the usual mode (0666 less the umask),
# so a server running as another user can read an index or an encoder. Read once: os.umask can only be set to read.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class output_errors:
    """Context manager: an OSError while writing ``what`` (full disk, permissions...) becomes an OutputError."""

    def __init__(self, what: str | os.PathLike, hint: str = "choose a writable location"):
        self.what = what
        self.hint = hint

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not issubclass(exc_type, OSError):
            return False
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(
                f"disk full while writing {self.what}; free some space{_free_space(self.what)} and "
                "rerun the same command (finished work is kept)"
            ) from exc
        raise OutputError(f"cannot write {self.what} ({exc.strerror or exc}); {self.hint}") from exc


class WriteErrors:
    """Wrap a binary file for a writer that turns the ``OSError`` of a failed write into an error of its own
    (``torch.save`` raises ``RuntimeError: enforce fail at inline_container.cc`` on a full disk): the block
    re-raises the ``OSError`` the file raised, so :class:`output_errors` (around it, as in
    :func:`atomic_write`) makes it one line."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self) -> WriteErrors:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and self.error is not None and exc is not self.error:
            raise self.error from exc
        return False


def _free_space(path: str | os.PathLike) -> str:
    """`` (N MB free there)`` for the disk ``path`` is (or would be) on; empty when that cannot be told."""
    for folder in Path(path).absolute().parents:
        try:
            return f" ({shutil.disk_usage(folder).free / 1e6:,.1f} MB free there)"
        except OSError:
            continue
    return ""


def check_writable(folder: str | os.PathLike, what: str, hint: str) -> Path:
    """Create ``folder`` if needed and prove it can be written (a probe file, removed), before long work.

    Raises:
        OutputError: ``"cannot write to <what> <folder> (<reason>); <hint>"``.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write to {what} {folder} ({exc.strerror or exc}); {hint}") from exc
    return folder


def check_free_space(folder: str | os.PathLike, needed: int, what: str) -> None:
    """Refuse to start writing ``needed`` bytes of ``what`` into ``folder`` when its disk has less free space:
    one line before the work instead of a full disk part-way through it (or a SIGBUS, for a file written
    through a memory map, which no write error reports).

    Raises:
        OutputError: less than ``needed`` bytes free.
    """
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # cannot tell here: the writes will say
        return
    if free < needed:
        raise OutputError(
            f"disk full: {what} needs {needed / 1e6:,.1f} MB and {folder} has {free / 1e6:,.1f} MB "
            "free; free some space and rerun the same command (finished work is kept)"
        )


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


# mkstemp's names for atomic_path: "." + the target's name + "." + 8 random characters + ".tmp"
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")


def temp_file_target(name: str) -> str | None:
    """The name of the file an :func:`atomic_path` temporary file named ``name`` was to become, else None."""
    match = _TEMP_NAME.match(name)
    return match.group("target") if match else None


def remove_stale_temp_files(folder: str | os.PathLike, owned: Callable[[str], bool]) -> tuple[int, int]:
    """Delete the temporary files that writes killed mid-way (kill -9, power loss) left in ``folder``, for the
    targets ``owned(target name)`` accepts; a failed write removes its own, a killed one cannot. Call it only
    while holding the folder's writer lock: a running write's temporary file looks the same.

    Returns:
        ``(files removed, bytes freed)``.
    """
    removed = freed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, 0
    for name in names:
        target = temp_file_target(name)
        if target is None or not owned(target):
            continue
        path = Path(folder) / name
        try:
            size = path.lstat().st_size
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to delete: nothing to free
            continue
        removed, freed = removed + 1, freed + size
    return removed, freed


@contextmanager
def atomic_path(path: str | os.PathLike, hint: str = "choose a writable location") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends without an error, the file written there
    is fsynced and renamed over ``path``. For writers that want a path (memory maps, ``onnx.save``)."""
    path = Path(path)
    with output_errors(path, hint):
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_UMASK)
        os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with output_errors(path, hint):
            _fsync_file(tmp)
            os.replace(tmp, path)
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", hint: str = "choose a writable location") -> Iterator[IO]:
    """Yield an open file (``mode`` ``"wb"`` or ``"w"``) that replaces ``path`` atomically when the block ends
    without an error. ``f.name`` is the temporary path (to check the file before it is published)."""
    # text: UTF-8, and a file name that is not UTF-8 (a str with surrogate escapes) is written as its own bytes
    text = {} if "b" in mode else {"encoding": "utf-8", "errors": "surrogateescape"}
    with atomic_path(path, hint) as tmp:
        with output_errors(path, hint), open(tmp, mode, **text) as f:
            yield f
            f.flush()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def write_json_atomic(
    path: str | os.PathLike, obj, hint: str = "choose a writable location", indent: int | None = 2
) -> None:
    """``obj`` as key-sorted JSON (one trailing newline), atomically: indented for people, or compact with
    ``indent=None`` for files only programs read (encoded in C: ``json.dump`` and any indent encode in Python,
    10 us per small object)."""
    text = json.dumps(obj, indent=indent, sort_keys=True, separators=None if indent is not None else (",", ":"))
    with atomic_write(path, "w", hint) as f:
        f.write(text + "\n")


def copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make ``dst`` a copy of ``src`` (never a link: for a file someone else may later change in place, such
    as the user's own model file), atomically."""
    with atomic_path(dst) as tmp:
        with output_errors(dst):
            shutil.copyfile(src, tmp)


def link_or_copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make ``dst`` hold ``src``'s content: a hard link when the filesystem allows (files that are never
    modified in place can share their blocks), else a copy; atomically either way."""
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            with output_errors(dst):  # a full disk while copying (a first index's encoder) is one line too
                shutil.copyfile(src, tmp)
