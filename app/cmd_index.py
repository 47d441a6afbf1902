"""``moco index``: embed an image folder with an exported encoder into a FAISS + LMDB index directory."""

from __future__ import annotations

import argparse

EPILOG_INDEX = """\
what it does:
  Scans IMAGE_DIR recursively (sorted; .jpg .jpeg .jpe .jfif .png .webp .bmp .tif .tiff .gif .avif .ico;
  hidden files and folders are ignored; symlinks are followed, each folder once), labels each image by its
  first-level subfolder (or by --labels), embeds it with the encoder and publishes a generation of INDEX_DIR
  (generations/gNNNNNN/: manifest.json, vectors.faiss, meta.lmdb/ and a copy of the encoder, everything
  `moco serve` needs; CURRENT names the live one).

  Rerun it on the same folder to update the index: only new or changed files are embedded, deleted files
  are removed, and the counts of added / updated / removed / unchanged images are printed. A file whose
  mtime or label changed but whose bytes did not (a copy without -p, a checkout, an edited --labels CSV)
  keeps its vector: its sha256 is compared with the one on record, and the encoder does not run for it.
  Stop it at any moment (Ctrl-C, kill, power loss) and rerun the same command: it resumes from the last
  finished shard.
  Readers (`moco serve`) see the old index or the new one, never a mix.

  Unreadable files (corrupt, truncated, empty, not an image, over 89 megapixels) are skipped, listed at the
  end and in INDEX_DIR/report.json; files with other extensions are counted there by extension.

  Moved or renamed the image folder? `moco index NEW_DIR --out INDEX_DIR --reattach` points the index at it:
  files with the same relative path, size and mtime keep their ids and vectors, files with the same bytes
  keep their vectors, only the rest is embedded.

updates cost what changed:
  An update shares the previous index's files and writes only a small delta (the new vectors, the removed
  ids, the changed metadata); readers keep serving the old generation until the new one is published. Once
  the changes pass 5% of the index (and 1,000 images), the run also publishes a compaction: the index rebuilt
  from the live vectors with its recall measured again (--compact now forces one, never skips it). A rescan
  of a huge folder is itself slow (~8 s per million files here); --changed-list FILE names the added,
  changed and deleted files instead (one relative path per line), and nothing else is looked at.

many processes, GPUs or machines (torchrun):
  torchrun --nproc_per_node 4 -m moco_retrieval index photos/ --model encoder.onnx --out photos.index
  Every rank embeds its share of the files (one GPU per rank where there are GPUs); rank 0 waits for the
  others, then builds and publishes. Ranks meet through INDEX_DIR/work/, so INDEX_DIR (and IMAGE_DIR) must be
  on a filesystem every node sees. Kill any rank and rerun the same command: finished shards are kept.

index types (--index-type):
  auto    exact search below 100k images, HNSW below 1M, IVF above, IVF-PQ when vectors do not fit in
          --max-index-memory, with its inverted lists on disk when even the PQ codes do not
  flat    exact inner product (best quality, memory and time grow with the corpus)
  hnsw    graph index, fast and accurate, more memory
  ivf     inverted lists, trained on a sample
  ivfpq   inverted lists of compressed vectors (64 bytes each at 512-d), for corpora larger than RAM;
          results are re-ranked with the stored float16 vectors
  or any FAISS factory string, e.g. "OPQ64,IVF4096,PQ64"
  Approximate indexes are tuned until recall@10 against exact search reaches --target-recall; the
  measured recall is printed and stored in the manifest.

examples:
  moco index photos/ --model encoder.onnx --out photos.index
  moco index photos/ --model encoder.onnx --out photos.index                  # later: update with changes
  moco index tiles/ --model encoder.onnx --out tiles.index --index-type ivfpq --workers 15 --batch-size 256
  moco index photos/ --model new_encoder.onnx --out photos.index --rebuild   # another model: start over
  moco index photos/ --model encoder.onnx --out photos.index --changed-list new_and_deleted.txt
  moco index tiles/ --model encoder.onnx --out tiles.index --max-index-memory 8G  # IVF-PQ on disk past 8 GiB
  moco index --verify --out photos.index     # check every file against the sha256 its manifest recorded

damaged files:
  Each generation's manifest records the size and sha256 of its files. Opening a generation checks the sizes,
  an update also hashes the small files it reads, a compaction everything it rebuilds from, and --verify every
  file. A damaged file is refused in one line naming it, with an older generation that is intact if there is
  one; the live generation is never replaced by a damaged one.
"""


def register(sub) -> None:
    from moco_retrieval.contracts.options import add_arguments
    from moco_retrieval.indexer.config import GROUPS, IndexConfig

    p = sub.add_parser(
        "index",
        help="index an image folder for similarity search (FAISS + LMDB)",
        description="Embed every image of IMAGE_DIR with an exported encoder and build a searchable "
        "index directory; rerun to update it incrementally.",
        epilog=EPILOG_INDEX,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p, IndexConfig, groups=GROUPS)
    p.set_defaults(func=cmd_index)


def cmd_index(args: argparse.Namespace) -> int:
    from moco_retrieval.contracts.options import from_arguments
    from moco_retrieval.indexer.build import build_index_dir
    from moco_retrieval.indexer.config import IndexConfig

    if args.verify and args.image_dir is None and args.model is None:
        return cmd_verify(args.out_dir)
    cfg = from_arguments(IndexConfig, args)
    result = build_index_dir(cfg)
    if result.mode == "rank":
        t = result.timings
        print(
            f"rank {result.rank} of {result.world_size}: embedded {result.embedded} images"
            + (f" (+{result.resumed} resumed)" if result.resumed else "")
            + f" in {t.get('embed', 0):.1f} s; rank 0 builds and publishes"
        )
        return 0
    print_index_result(result)
    return 0


def cmd_verify(out: str) -> int:
    """``moco index --verify --out INDEX_DIR``: check the live generation's files against their checksums."""
    from moco_retrieval.indexer.integrity import verify_index_dir

    result = verify_index_dir(out)
    checked = result.checked
    rows = [("index directory", result.index_dir), ("generation", f"{result.generation} (live), {result.count} items")]
    if result.recorded:
        rows.append(
            (
                "verified",
                f"{checked.hashed} files, {checked.bytes_hashed / 1e6:,.1f} MB: sha256 as recorded "
                f"in the manifest ({checked.seconds:.2f} s); the generation opens",
            )
        )
    else:
        rows.append(
            (
                "verified",
                "the generation opens, but its manifest records no checksums (written before "
                "they were): `moco index --compact now` writes a generation that has them",
            )
        )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def print_index_result(result) -> None:
    """The summary table of a ``moco index`` run (and the skipped files, names shown readably)."""
    from moco_retrieval.indexer.scan import describe_not_images

    t = result.timings
    state = "published now" if result.published else "unchanged, still live"
    if result.compacted:
        state = "published now, then compacted"
    rows = [
        ("index directory", result.index_dir),
        ("generation", f"{result.generation} ({state})"),
        *([("image folder", f"{result.reattached} -> re-attached here")] if result.reattached else []),
        ("images in index", f"{result.count}"),
        ("added", f"{result.added}"),
        ("updated", f"{result.updated}"),
        ("removed", f"{result.removed}"),
        ("unchanged", f"{result.unchanged}"),
        ("exact duplicates", f"{result.duplicates}"),
        ("skipped (unreadable)", f"{len(result.skipped)}"),
        ("not images (ignored)", describe_not_images(result.not_images) if result.not_images else "0"),
        (
            "embedded this run",
            f"{result.embedded}"
            + (f" (+{result.resumed} resumed)" if result.resumed else "")
            + (f" (+{result.reused} unchanged bytes: vectors reused)" if result.reused else ""),
        ),
        (
            "index",
            result.factory
            + "".join(f", {k}={v}" for k, v in result.search_params.items())
            + (
                f" (+{result.delta_count} in the delta, {result.removed_count} removed since the last compaction)"
                if result.delta_count or result.removed_count
                else ""
            ),
        ),
        (
            "recall@10",
            "exact"
            if result.recall_at_10 == 1.0 and not result.search_params
            else (f"{result.recall_at_10:.3f}" if result.recall_at_10 is not None else "-"),
        ),
    ]
    if result.embedded and t.get("embed"):
        rows.append(
            (
                "throughput",
                f"{result.embedded / t['embed']:.1f} images/s end to end; encoder "
                f"{t['encoder']:.1f} s, waiting for decoding {t['decode_wait']:.1f} s",
            )
        )
    if result.world_size > 1:
        rows.append(("ranks", f"{result.world_size} (waited {t.get('wait_for_ranks', 0):.1f} s for the others)"))
    publish = sum(t.get(k, 0) for k in ("plan", "commit", "index", "publish"))
    rows.append(
        (
            "time",
            f"{t.get('total', 0):.1f} s (scan {t.get('scan', 0):.1f} s, embedding {t.get('embed', 0):.1f} s, "
            f"plan + commit + publish {publish:.1f} s"
            + (
                f", compaction {t.get('compact_metadata', 0) + t.get('compact_index', 0):.1f} s"
                if result.compacted
                else ""
            )
            + ")",
        )
    )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print_skipped(result.skipped, f"skipped files (also in {result.report_path}):")


def print_skipped(skipped: list[dict], heading: str, most: int = 20) -> None:
    """The files a run could not index (``[{path, reason}]``), names shown readably: the first ``most``."""
    from moco_retrieval.contracts.filenames import display_name

    if not skipped:
        return
    print(heading)
    for item in skipped[:most]:
        print(f"  {display_name(item['path'])}: {item['reason']}")
    if len(skipped) > most:
        print(f"  ... and {len(skipped) - most} more")
