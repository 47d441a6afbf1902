"""``moco serve``, ``moco search`` and ``moco classify``: answering queries over an index directory."""

from __future__ import annotations

import argparse
import json

from moco_retrieval.contracts.knn import KNN_K, KNN_TEMPERATURE, SEARCH_K

EPILOG_SERVE = """\
The page at / is the web app (upload, paste or webcam; click a result to search from it). The JSON API:
  curl -F image=@query.jpg 'http://127.0.0.1:7860/api/search?k=10'
  curl -F image=@query.jpg 'http://127.0.0.1:7860/api/classify?k=20'
  curl http://127.0.0.1:7860/api/items/42            (and /api/items/42/image, /api/items/42/neighbors)
  curl http://127.0.0.1:7860/api/stats               (and /api/health)
The API is documented at /docs. When `moco index` publishes a new generation of INDEX_DIR, the server
switches to it without a restart.

Several processes: --workers N starts N server processes on the same port (connections are spread over
them). The index is memory-mapped, so they share one copy of it in memory; each one switches to a newly
published generation by itself. With GPUs (and a FAISS that sees them), Flat and IVF indexes are searched
on them (--faiss-gpu); HNSW and on-disk IVF-PQ stay on the CPU, as do searches deeper than 2048.

examples:
  moco serve index/                              # http://127.0.0.1:7860/
  moco serve index/ --host 0.0.0.0 --port 8000   # reachable from other machines
  moco serve index/ --workers 4 --no-ui          # 4 API processes sharing one memory-mapped index
"""

EPILOG_SEARCH = """\
examples:
  moco search index/ query.jpg              # the 10 most similar indexed images
  moco search index/ query.jpg -k 3 --json  # machine-readable
  moco search index/ query.jpg --min-score 0.9          # every image at least 0.9 similar (up to 1000)
  moco search index/ new_photos/ --out neighbours.csv   # a whole folder: one row per image (or .jsonl)
  moco search index/ query.jpg --label sneaker --label boot --exclude 42   # only those labels, never item 42
"""

EPILOG_CLASSIFY = """\
The k nearest labeled images vote for their label with weight exp(similarity / temperature), as in the
k-NN evaluation of the MoCo papers (k={k}, T={t}). Labels are the first-level subfolders of the indexed folder.

examples:
  moco classify index/ query.jpg
  moco classify index/ query.jpg -k 50 --json
  moco classify index/ new_photos/ --out labels.csv     # query, label, share, ids, paths, scores
"""


ENGINE_FLAGS = ("model", "device", "threads")  # EngineConfig fields every command of this module takes
SERVE_FLAGS = ENGINE_FLAGS + ("poll_seconds", "faiss_gpu", "knn_k", "max_queries")  # and those only a server needs


def _engine_config(args, **fixed):
    from moco_retrieval.contracts.options import from_arguments
    from moco_retrieval.serve.config import EngineConfig

    return from_arguments(EngineConfig, args, **fixed)


def cmd_serve(args: argparse.Namespace) -> int:
    from moco_retrieval.app.server import check_port, serve_forever, serve_workers
    from moco_retrieval.serve.engine import SearchEngine

    check_port(args.host, args.port)  # before the (slower) engine start
    if args.workers != 1:
        from moco_retrieval.contracts.errors import ConfigError
        from moco_retrieval.indexer.encoder import available_cores

        if args.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {args.workers}")
        threads = args.threads or max(1, available_cores() // args.workers)  # the cores, shared by the workers
        config = _engine_config(args, threads=threads)
        _check_index(args.index_dir, args.model)  # once here: a bad index fails in one line, not in N workers
        serve_workers(
            args.index_dir, config, args.host, args.port, ui=args.ui, workers=args.workers, metrics=args.metrics
        )
        return 0
    config = _engine_config(args)
    with SearchEngine(args.index_dir, config) as engine:
        serve_forever(engine, args.host, args.port, ui=args.ui, metrics=args.metrics)
    return 0


def _check_index(index_dir: str, model: str | None) -> None:
    """Open the live generation and check its model without starting an encoder (the supervisor of the
    workers stays small).

    Raises:
        ArtifactError: not an index directory, unreadable, or ``model`` is not the model it was built with.
    """
    import hashlib
    from pathlib import Path

    from moco_retrieval.indexer.encoder import read_encoder_metadata
    from moco_retrieval.indexer.index_dir import IndexDirectory
    from moco_retrieval.indexer.manifest import check_encoder_copy

    with IndexDirectory.open(index_dir) as directory:
        path = Path(model) if model else directory.encoder_path
        if not model:
            check_encoder_copy(path, directory.manifest, index_dir)
        meta = read_encoder_metadata(path)
        directory.manifest.check_encoder(
            hashlib.sha256(path.read_bytes()).hexdigest(),
            meta["embedding_dim"],
            path,
            str(index_dir),
            "serve it with the model it was built with",
        )


def _many(args) -> bool:
    """Whether the query is a batch (several images, a folder, or a file or format asked for)."""
    import os

    return len(args.image) > 1 or os.path.isdir(args.image[0]) or args.out is not None or args.format is not None


def _answer_many(args, answer, row, columns) -> int:
    """Answer every query image into rows: decoded in worker processes, embedded in whole batches with the served
    encoder (on the CPU two batches at once, each on half the cores unless ``--threads`` says otherwise),
    answered by ``answer(engine, vectors)`` (``search_vectors`` / ``classify_vectors``)."""
    from contextlib import closing

    from moco_retrieval.app.query_files import answer_files, decode_workers, expand_queries, output_format, write_rows
    from moco_retrieval.indexer.encoder_lanes import CPU_LANES, lane_threads
    from moco_retrieval.serve.engine import SearchEngine

    fmt = output_format(args.out, args.format)  # before the engine starts: a bad --out fails at once
    paths = expand_queries(args.image)
    config = _engine_config(args, poll_seconds=0, threads=args.threads or lane_threads(CPU_LANES))
    with SearchEngine(args.index_dir, config) as engine:  # no watcher: one encoder
        batch = engine.config.max_batch
        answers = answer_files(
            engine.encoder,
            paths,
            lambda xq: answer(engine, xq),
            batch,
            decode_workers(len(paths), batch, engine.config.decode_slots),
            progress=args.progress and len(paths) > batch,
            lanes=CPU_LANES if engine.encoder.provider == "CPUExecutionProvider" else 1,
        )
        with closing(answers):  # leaving early (an error, a closed pipe) stops the decoding processes
            n = write_rows((row(path, res) for path, res in answers), args.out, fmt, columns)
    if args.out is not None:
        print(f"{n} queries answered into {args.out}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from moco_retrieval.serve.engine import SearchEngine

    if _many(args):
        from moco_retrieval.app.query_files import SEARCH_COLUMNS, search_row

        flt = _filter(args)
        return _answer_many(
            args, lambda engine, xq: engine.search_vectors(xq, args.k, args.min_score, flt), search_row, SEARCH_COLUMNS
        )
    from moco_retrieval.serve.answers import search_answer

    with SearchEngine(args.index_dir, _engine_config(args, poll_seconds=0)) as engine:
        (res,) = engine.search(args.image, args.k, args.min_score, _filter(args))
        root, k = engine.image_root, engine.resolve_k(args.k, args.min_score)
    if args.json:  # the HTTP answer's schema, and where the paths are
        print(json.dumps({**search_answer(res, k, args.min_score), "image_root": str(root)}, indent=2))
        return 0
    from moco_retrieval.contracts.filenames import display_name

    print(f"{len(res.hits)} nearest of {args.image[0]} (paths relative to {root}):")
    print(f"{'rank':>4}  {'score':>6}  {'id':>6}  {'label':<16}  path")
    for rank, hit in enumerate(res.hits, 1):
        label = display_name(hit.get("label")) or "-"
        print(f"{rank:>4}  {hit['score']:6.3f}  {hit['id']:>6}  {label:<16}  {display_name(hit['path'])}")
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    from moco_retrieval.serve.engine import SearchEngine

    if _many(args):
        from moco_retrieval.app.query_files import CLASSIFY_COLUMNS, classify_row

        return _answer_many(
            args,
            lambda engine, xq: engine.classify_vectors(xq, args.k, args.temperature),
            classify_row,
            CLASSIFY_COLUMNS,
        )
    from moco_retrieval.serve.answers import classify_answer

    with SearchEngine(args.index_dir, _engine_config(args, poll_seconds=0)) as engine:
        (res,) = engine.classify(args.image, args.k, args.temperature)
        k = engine.config.knn_k if args.k is None else args.k
    if args.json:  # the HTTP answer's schema
        print(json.dumps(classify_answer(res, k, args.temperature), indent=2))
        return 0
    if res.label is None:
        print(f"no labeled item among the {len(res.neighbors)} nearest neighbours of {args.image[0]}")
        return 0
    voters = sum(1 for h in res.neighbors if h.get("label") is not None)
    print(
        f"{args.image[0]}: {res.label} ({100 * res.probabilities[res.label]:.1f}%, {voters} labeled neighbours "
        f"of k={len(res.neighbors)} voting)"
    )
    for label, p in list(res.probabilities.items())[:5]:
        print(f"  {label:<20} {100 * p:5.1f}%")
    return 0


def _common(p: argparse.ArgumentParser, flags: tuple[str, ...] = ENGINE_FLAGS) -> None:
    from moco_retrieval.contracts.options import add_arguments
    from moco_retrieval.serve.config import EngineConfig

    p.add_argument("index_dir", metavar="INDEX_DIR", help="an index directory written by `moco index`")
    add_arguments(p, EngineConfig, only=flags)


def _filter(args):
    """The SearchFilter of the filter flags, or ``None``."""
    from moco_retrieval.serve.search_filter import SearchFilter

    flt = SearchFilter(
        labels=tuple(args.label or ()),
        path_prefix=args.path_prefix,
        min_width=args.min_width,
        max_width=args.max_width,
        min_height=args.min_height,
        max_height=args.max_height,
        exclude=tuple(args.exclude or ()),
    )
    return flt or None


def _filter_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("filters (only items that pass all of them)")
    g.add_argument("--label", action="append", metavar="LABEL", help="items with this label; repeat for several")
    g.add_argument(
        "--path-prefix", metavar="PREFIX", help="items whose relative path starts with this (a folder: shoes/)"
    )
    for name, what in (
        ("min-width", "at least this wide"),
        ("max-width", "at most this wide"),
        ("min-height", "at least this tall"),
        ("max-height", "at most this tall"),
    ):
        g.add_argument(f"--{name}", type=int, metavar="PX", help=f"images {what} (pixels)")
    g.add_argument("--exclude", type=int, action="append", metavar="ID", help="never this item id; repeatable")


def _batch_output(p: argparse.ArgumentParser) -> None:
    from moco_retrieval.app.query_files import FORMATS

    p.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="write one row per query image to FILE (.csv or .jsonl); several images or a folder "
        "without --out print JSONL",
    )
    p.add_argument("--format", choices=FORMATS, default=None, help="the rows' format (default: --out's suffix)")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar over many images (for logs)",
    )


def register(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "serve",
        help="serve search and classification over HTTP with a web app",
        description="Start a web server over an index directory: a web app at / (drop an image, "
        "see its nearest neighbours and a k-NN label), and a JSON API under /api.",
        epilog=EPILOG_SERVE,
        formatter_class=fmt,
    )
    _common(p, SERVE_FLAGS)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)",
    )
    p.add_argument("--port", type=int, default=7860, help="port to listen on (default 7860)")
    p.add_argument("--no-ui", dest="ui", action="store_false", help="serve only the JSON API, without the web app")
    p.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="no Prometheus metrics at /metrics (they are on by default)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes on the port, sharing one memory-mapped index (default 1); the encoder "
        "threads are split between them unless --threads is given",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "search",
        help="print the indexed images most similar to an image",
        description="Embed IMAGE with the index's model and print its nearest indexed images "
        "(cosine similarity), best first.",
        epilog=EPILOG_SEARCH,
        formatter_class=fmt,
    )
    _common(p)
    p.add_argument("image", metavar="IMAGE", nargs="+", help="query image files or folders of them")
    p.add_argument(
        "-k",
        type=int,
        default=None,
        help=f"how many neighbours (default {SEARCH_K}; with --min-score, at most this many)",
    )
    p.add_argument(
        "--min-score",
        type=float,
        default=None,
        help="every neighbour with a cosine similarity of at least this (-1 to 1), up to -k",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (one image)")
    _batch_output(p)
    _filter_flags(p)
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "classify",
        help="predict an image's label from its labeled nearest neighbours",
        description="Predict IMAGE's label by a weighted vote of its k nearest labeled indexed images.",
        epilog=EPILOG_CLASSIFY.format(k=KNN_K, t=KNN_TEMPERATURE),
        formatter_class=fmt,
    )
    _common(p)
    p.add_argument("image", metavar="IMAGE", nargs="+", help="image files or folders of them to classify")
    p.add_argument("-k", type=int, default=None, help=f"neighbours that vote (default {KNN_K}, as the API's)")
    p.add_argument(
        "--temperature",
        type=float,
        default=KNN_TEMPERATURE,
        help=f"vote weight exp(similarity / T) (default {KNN_TEMPERATURE})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text (one image)")
    _batch_output(p)
    p.set_defaults(func=cmd_classify)
