"""``IndexConfig``: every option of ``moco index``, with its default and its help, stated once.

The CLI's flags are generated from these fields (``contracts.options``), the Python API builds the same
object, and ``indexer.build`` takes nothing else. Light to import (no FAISS, no ONNX Runtime): ``moco --help``
builds every command's flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.contracts.options import option
from moco_retrieval.indexer.ranks import DEFAULT_TIMEOUT_S

TARGET_RECALL = 0.95  # recall@10 against exact search that approximate indexes are tuned to reach
COMPACT_MODES = ("auto", "now", "never")
DEVICES = ("auto", "cpu", "cuda")
GROUPS = ("input and output", "encoder", "index", "updates", "runs")  # the sections of `moco index --help`, in order


def parse_bytes(text: str | int | None) -> int | None:
    """``"8G"``, ``"512M"``, ``"1.5T"`` or a number of bytes -> bytes.

    Raises:
        ConfigError: not a size.
    """
    if text is None or isinstance(text, int):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = str(text).strip().lower().removesuffix("b").removesuffix("i")
    try:
        value = float(s[:-1]) * units[s[-1]] if s and s[-1] in units else float(s)
    except ValueError:
        raise ConfigError(f"--max-index-memory must be a size like 8G or 512M, got {text!r}") from None
    if value <= 0:
        raise ConfigError(f"--max-index-memory must be positive, got {text!r}")
    return int(value)


_REQUIRED = dataclasses.MISSING


@dataclass
class IndexConfig:
    """Everything ``moco index`` needs; the CLI builds it from its flags and nothing more."""

    image_dir: str = option(
        _REQUIRED,
        "folder of images (searched recursively); not needed with --verify alone",
        "input and output",
        flag="IMAGE_DIR",
        nargs="?",
    )
    model: str = option(
        _REQUIRED,
        "encoder.onnx written by `moco export` (required unless --verify is given alone)",
        "input and output",
        metavar="ENCODER_ONNX",
    )
    out_dir: str = option(
        _REQUIRED,
        "index directory to create or update",
        "input and output",
        flag="--out",
        metavar="INDEX_DIR",
        required=True,
    )
    index_type: str = option(
        "auto",
        "auto, flat, hnsw, ivf, ivfpq or a FAISS factory string (see index types below)",
        "index",
        metavar="TYPE",
    )
    batch_size: int = option(64, "images per encoder call", "encoder")
    workers: int | None = option(
        None,
        "processes decoding images; 0 decodes in the main process (default: the cores minus one, at most 16)",
        "encoder",
    )
    device: str = option("auto", "where the encoder runs: auto uses a GPU when one works", "encoder", choices=DEVICES)
    labels_csv: str | None = option(
        None,
        "path,label CSV (paths relative to IMAGE_DIR) instead of first-level subfolder labels",
        "input and output",
        flag="--labels",
        metavar="CSV",
    )
    rebuild: bool = option(
        False, "ignore the existing index (built with another model or folder) and embed everything again", "updates"
    )
    shard_size: int = option(1024, "embeddings per resumable shard: at most this much work is lost on a crash", "runs")
    target_recall: float = option(TARGET_RECALL, "recall@10 approximate indexes are tuned to reach", "index")
    progress: bool = option(True, "no progress bar (for logs)", "runs")
    max_index_memory: int | str | None = option(
        None,
        "RAM the index may take when served, e.g. 8G: auto picks IVF-PQ past it, and keeps IVF-PQ lists on "
        "disk when even they do not fit (default: half this machine's RAM)",
        "index",
        metavar="SIZE",
        type=str,
    )
    reattach: bool = option(
        False,
        "the image folder moved (or was renamed): index IMAGE_DIR in place of the one "
        "this index was built from; files with the same relative path, size and mtime "
        "keep their ids and vectors",
        "updates",
    )
    compact: str = option(
        "auto",
        "rebuild the index from its live vectors after this update: auto once changes pass 5%% of it, now, or never",
        "updates",
        choices=COMPACT_MODES,
    )
    changed_list: str | None = option(
        None,
        "update only these files: one relative path per line (added, changed or deleted); the folder is not rescanned",
        "updates",
        metavar="FILE",
    )
    rank_timeout: float = option(
        DEFAULT_TIMEOUT_S,
        "under torchrun: how long rank 0 waits for a rank that makes no progress, in seconds",
        "runs",
        metavar="SECONDS",
    )
    verify: bool = option(
        False,
        "check the sha256 of every file of the live generation against its manifest "
        "(otherwise their sizes are checked, and the hashes of what an update reads); "
        "alone (`moco index --verify --out INDEX_DIR`) it only checks, else it checks "
        "before updating",
        "updates",
    )

    def __post_init__(self):
        if self.image_dir is None or self.model is None:
            raise ConfigError(
                "moco index needs IMAGE_DIR and --model (only `moco index --verify --out INDEX_DIR` "
                "checks an index without them)"
            )
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"--workers must be 0 or more, got {self.workers}")
        if self.shard_size < 1:
            raise ConfigError(f"--shard-size must be at least 1, got {self.shard_size}")
        if not 0 < self.target_recall <= 1:
            raise ConfigError(f"--target-recall must be in (0, 1], got {self.target_recall}")
        if self.compact not in COMPACT_MODES:
            raise ConfigError(f"--compact must be one of {', '.join(COMPACT_MODES)}, got {self.compact!r}")
        if self.rank_timeout <= 0:
            raise ConfigError(f"--rank-timeout must be positive, got {self.rank_timeout}")
        self.max_index_memory = parse_bytes(self.max_index_memory)
