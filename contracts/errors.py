"""The project's one typed error hierarchy, mapped to CLI exit codes and HTTP statuses.

Pure Python (no torch): every package raises these, the ``moco`` CLI prints ``moco: error: <message>`` and
exits with ``exit_code``; the HTTP API answers ``http_status`` with ``{"error": <message>}``.
Messages are one line and say what to do.
"""

from __future__ import annotations


class MocoError(Exception):
    """Base class: a problem the user can fix, reported in one line."""

    exit_code = 1
    http_status = 500


class ConfigError(MocoError):
    """An option value that cannot work (bad number, unknown arch, device not present)."""

    exit_code = 2
    http_status = 400


class DataError(MocoError):
    """Input images that cannot be used: missing or empty folder, too few images, an unreadable image."""

    exit_code = 3
    http_status = 400


class UnknownItemError(DataError):
    """An item id that an index does not hold (never existed, or removed)."""

    http_status = 404


class ImageGoneError(DataError):
    """An indexed item whose image file is no longer the file that was indexed: deleted, replaced (by a
    symlink, a FIFO, another file), changed, or now resolving outside the image folder."""

    http_status = 410


class UploadTooLargeError(DataError):
    """An uploaded file over the server's size limit."""

    http_status = 413


class BatchTooLargeError(DataError):
    """A batch request with more queries (images or ids) than the server's stated limit."""

    http_status = 413


class ArtifactError(MocoError):
    """A run directory, checkpoint, ONNX model or index directory that is missing, foreign or mismatched."""

    exit_code = 4
    http_status = 409


class OutputError(MocoError):
    """An output location that cannot be written (permissions, full disk)."""

    exit_code = 5
    http_status = 500


class ExportError(MocoError):
    """An ONNX export that failed or did not match PyTorch."""

    exit_code = 6
    http_status = 500


class IndexBuildError(MocoError):
    """A FAISS index or metadata store that could not be built (or a rank of the build that stopped)."""

    exit_code = 7
    http_status = 500
