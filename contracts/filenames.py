"""File names as the file system has them: how every stage stores the name of a file losslessly and shows it
readably, whatever bytes it holds.

On POSIX a file name is bytes, not text. Python decodes it with the file-system encoding (UTF-8) and turns
each byte that is not valid UTF-8 into a lone surrogate (``surrogateescape``): the name ``b"caf\\xe9.png"``
(Latin-1) walks as the str ``"caf\\udce9.png"``. That str is the path everywhere in the project (the folder
walk, the scan, the records, the work shards), and:

- **stored** losslessly: :func:`encode_name` is ``os.fsencode``, the original bytes (LMDB keys);
  :func:`decode_name` is its inverse. JSON files (records inside LMDB, work shards, ``report.json``) hold the
  str itself: the ``json`` module writes a lone surrogate as the escape ``\\udce9`` (``ensure_ascii``, its
  default, which every writer here keeps) and reads it back unchanged;
- **shown** readably with :func:`display_name`: valid UTF-8 as it is; each byte that is not as ``\\xNN``
  (Python's backslash escape); control characters, such as a newline inside a name, as ``\\n``, ``\\t``,
  ``\\x07``. A shown name is always one printable line of valid Unicode (safe to print, log, put in an error
  message or an HTTP JSON answer), though not always the file's exact bytes: the API identifies files by id.

Names that differ only in Unicode normalization (NFC ``é`` vs NFD ``e`` + combining accent) are different
byte strings, so different files, and are kept apart as such.
"""

from __future__ import annotations

import os


def encode_name(path: str) -> bytes:
    """The file-system bytes of a path (``os.fsencode``): lossless, also for names that are not UTF-8."""
    return os.fsencode(path)


def decode_name(raw: bytes | memoryview) -> str:
    """The inverse of :func:`encode_name` (``os.fsdecode``)."""
    return os.fsdecode(bytes(raw))


def _escape(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii")  # "\n" -> "\\n", "\x07" -> "\\x07", "\u2028" -> "\\u2028"


def display_name(path: str | None) -> str | None:
    """``path`` as one readable line: undecodable bytes as ``\\xNN``, control characters escaped (see above)."""
    if path is None:
        return None
    if path.isascii() and path.isprintable():  # most names: no surrogate, nothing to escape (two C scans)
        return path
    try:
        text = os.fsencode(path).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no file system produced (e.g. from a labels CSV)
        text = path.encode("utf-8", "backslashreplace").decode("utf-8")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
