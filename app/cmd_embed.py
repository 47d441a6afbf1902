"""``moco embed``: embed an image folder with an exported encoder straight into Parquet (or .npy), no index kept."""

from __future__ import annotations

import argparse

EPILOG = """\
columns: id (the files in path order), path (readable), path_bytes (the raw name where it is not UTF-8),
label (first-level subfolder or --labels), width, height, sha256, vector (float32 x D, L2-normalized).
Unreadable files are skipped and listed, as `moco index` does.

Stop it at any moment and rerun the same command: it goes on from the last finished shard (the work is kept
in FILE.work/ beside the output and deleted once the file is written).

examples:
  moco embed photos/ --model encoder.onnx --out photos.parquet
  moco embed photos/ --model encoder.onnx --out photos --npy   # photos.npy (float32 [N, D]) + photos.parquet
  python -c "import pandas as pd; print(pd.read_parquet('photos.parquet').head())"
"""

GENERATED = ("labels_csv", "batch_size", "workers", "device", "shard_size", "progress")  # IndexConfig's flags


def register(sub) -> None:
    from moco_retrieval.app.cmd_embeddings import add_npy_flag
    from moco_retrieval.contracts.options import add_arguments
    from moco_retrieval.indexer.config import IndexConfig

    p = sub.add_parser(
        "embed",
        help="embed an image folder into Parquet (or .npy) without building an index",
        description="Embed every image of IMAGE_DIR with an exported encoder and write id, path, "
        "label, size, sha256 and the embedding of each to a Parquet file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("image_dir", metavar="IMAGE_DIR", help="folder of images (searched recursively)")
    p.add_argument("--model", required=True, metavar="ENCODER_ONNX", help="encoder.onnx written by `moco export`")
    p.add_argument(
        "--out", dest="out_dir", required=True, metavar="FILE", help="the Parquet file to write (replaced atomically)"
    )
    add_npy_flag(p)
    add_arguments(p, IndexConfig, only=GENERATED)
    p.set_defaults(func=cmd_embed)


def cmd_embed(args: argparse.Namespace) -> int:
    from moco_retrieval.app.cmd_index import print_skipped
    from moco_retrieval.contracts.options import from_arguments
    from moco_retrieval.indexer.config import IndexConfig
    from moco_retrieval.indexer.embed_folder import embed_folder

    result = embed_folder(from_arguments(IndexConfig, args), npy=args.npy)
    run, written = result.index, result.written
    resumed = f" (+{run.resumed} resumed)" if run.resumed else ""
    print(
        f"embedded {run.embedded} images{resumed}; wrote {written.rows} rows ({written.dim}-d) to "
        f"{', '.join(map(str, written.paths))}"
    )
    print_skipped(run.skipped, f"skipped {len(run.skipped)} unreadable files:")
    return 0
