"""``moco duplicates``: groups of near-identical images of an index directory, as JSON or CSV."""

from __future__ import annotations

import argparse

EPILOG = """\
Each item is compared with its -k nearest neighbours (through the index, never all pairs); pairs scoring at
least --threshold join one group (connected components), so copies, re-encodes, crops and resizes of one photo
fall together. Needs no encoder: the stored vectors are the queries.

examples:
  moco duplicates index/ --threshold 0.95                  # JSON on stdout
  moco duplicates index/ --threshold 0.98 --out dupes.csv  # group, id, path, score
"""


def cmd_duplicates(args: argparse.Namespace) -> int:
    import json

    from moco_retrieval.app.query_files import output_format
    from moco_retrieval.contracts.atomic import atomic_write
    from moco_retrieval.contracts.errors import ConfigError
    from moco_retrieval.contracts.filenames import display_name
    from moco_retrieval.indexer.duplicates import duplicate_groups, iter_group_rows
    from moco_retrieval.indexer.index_dir import IndexDirectory

    if not -1.0 <= args.threshold <= 1.0:
        raise ConfigError(f"--threshold must be from -1 to 1 (a cosine similarity), got {args.threshold}")
    if args.k < 1:
        raise ConfigError(f"-k must be at least 1, got {args.k}")
    fmt = "json" if args.out is None or args.out.lower().endswith(".json") else output_format(args.out, None)
    with IndexDirectory.open(args.index_dir) as directory:
        groups = duplicate_groups(directory.index, args.threshold, args.k)
        rows = [dict(row, path=display_name(row["path"])) for row in iter_group_rows(groups, directory.records)]
    if fmt == "csv":
        import csv

        with atomic_write(args.out, "w") as f:
            writer = csv.DictWriter(f, fieldnames=("group", "id", "path", "score"))
            writer.writeheader()
            writer.writerows(rows)
    else:
        by_group: dict[int, list[dict]] = {}
        for row in rows:
            by_group.setdefault(row["group"], []).append({k: row[k] for k in ("id", "path", "score")})
        body = {
            "threshold": args.threshold,
            "k": args.k,
            "groups": [
                {
                    "size": len(g.ids),
                    "items": by_group.get(n, []),
                    "pairs": [[a, b, round(s, 6)] for a, b, s in g.pairs],
                }
                for n, g in enumerate(groups, 1)
            ],
        }
        text = json.dumps(body, indent=2, ensure_ascii=False) + "\n"
        if args.out is None:
            print(text, end="")
        else:
            with atomic_write(args.out, "w") as f:
                f.write(text)
    if args.out is not None:
        print(f"{len(groups)} groups ({len(rows)} items) written to {args.out}")
    return 0


def register(sub) -> None:
    from moco_retrieval.indexer.duplicates import DUPLICATE_K

    p = sub.add_parser(
        "duplicates",
        help="list groups of near-identical indexed images",
        description="Find groups of near-duplicate images in an index directory: connected "
        "components of pairs at least --threshold similar.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("index_dir", metavar="INDEX_DIR", help="an index directory written by `moco index`")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.95,
        help="cosine similarity at which two images count as duplicates (default 0.95)",
    )
    p.add_argument("-k", type=int, default=DUPLICATE_K, help=f"neighbours compared per image (default {DUPLICATE_K})")
    p.add_argument("--out", metavar="FILE", default=None, help="write FILE (.json or .csv) instead of JSON on stdout")
    p.set_defaults(func=cmd_duplicates)
