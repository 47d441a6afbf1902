"""``moco embeddings``: the live items of an index directory, with their vectors, as a Parquet file."""

from __future__ import annotations

import argparse

EPILOG = """\
columns: id, path (readable), path_bytes (the raw name where it is not UTF-8), label, width, height, sha256,
vector (float32 x D, L2-normalized). Rows are the live items of the live generation; deleted ones are absent.

examples:
  moco embeddings photos.index --out photos.parquet
  moco embeddings photos.index --out photos --npy     # photos.npy (float32 [N, D]) + photos.parquet (the rest)
  python -c "import pandas as pd; print(pd.read_parquet('photos.parquet').head())"
  duckdb -c "select label, count(*) from 'photos.parquet' group by label"
"""


def cmd_embeddings(args: argparse.Namespace) -> int:
    from moco_retrieval.indexer.embeddings_file import write_embeddings

    result = write_embeddings(args.index_dir, args.out, npy=args.npy, progress=not args.no_progress)
    print(
        f"wrote {result.rows} items ({result.dim}-d vectors, generation {result.generation}) to "
        f"{', '.join(map(str, result.paths))} in {result.seconds:.1f} s "
        f"({result.rows / max(result.seconds, 1e-9):,.0f} rows/s)"
    )
    return 0


def add_npy_flag(p: argparse.ArgumentParser) -> None:
    """``--npy``, as ``moco embeddings`` and ``moco embed`` take it."""
    p.add_argument(
        "--npy",
        action="store_true",
        help="vectors to FILE.npy (float32 [N, D]) and the other columns to FILE.parquet, row for row "
        "(clip-retrieval's layout)",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "embeddings",
        help="write an index's items and their vectors to Parquet (or .npy)",
        description="Write every live item of INDEX_DIR (id, path, label, size, sha256 and its "
        "embedding) to a Parquet file, for clustering, dashboards or other indexes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("index_dir", metavar="INDEX_DIR", help="an index directory written by `moco index`")
    p.add_argument("--out", required=True, metavar="FILE", help="the Parquet file to write (replaced atomically)")
    add_npy_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.set_defaults(func=cmd_embeddings)
