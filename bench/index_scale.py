"""Index scale benchmark: build, update and serve 1M-10M vectors through the real ``moco index`` path.

Only the encoder is skipped: a :class:`SyntheticCorpus` hands the build clustered, L2-normalized 512-d vectors
(a deterministic function of each file's number) instead of running the ONNX model, so a million vectors fit
on a 2-core machine in minutes. Everything else is the real pipeline: the folder scan (real, empty files
under ``WORK/files`` unless ``--no-files``), the plan against the live generation, resumable work shards,
LMDB, vector blocks, FAISS build / update, publish. The generations carry a real ``encoder.onnx``
(random-weight ResNet-18 at 32 px, 512-d), so ``moco serve`` opens them like any other index.

Phases (each one run, each appends its rows to ``--out``):

    build    index N files from scratch (``--n``, ``--index-type``, ``--max-index-memory``)
    add      create ``--count`` new files and rerun the index: the publish of +count items (a full rescan,
             or with ``--changed-list`` only the listed files)
    remove   delete ``--count`` files and rerun: the publish of -count items
    serve    RSS per worker and search QPS / recall@10 of the live generation in ``--workers`` processes
             (vector queries against exact ground truth; see also ``bench/serve_workers.py`` for HTTP)

``--no-files`` (10M) skips the files: the build's scan is synthetic (``scanner=``), and later updates must
use ``--changed-list`` (their new files are created for real, removed ones simply never existed).

``--legacy`` runs against code from before issue 12 (no ``embedder`` argument in ``build_index_dir``): the
same corpus is injected by replacing ``indexer.build.OnnxEncoder`` and ``indexer.build._embed``.

    python bench/index_scale.py build --work /work/scratch/scale1m --n 1000000 --index-type flat
    python bench/index_scale.py add --work /work/scratch/scale1m --count 1000
    python bench/index_scale.py remove --work /work/scratch/scale1m --count 1000 --changed-list
    python bench/index_scale.py serve --work /work/scratch/scale1m --workers 1 2 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.scale_data import CHUNK, OUT, chunk_vectors, record as _record  # noqa: E402

FILES_PER_DIR = 1000


def file_path(i: int) -> str:
    """The relative path of synthetic item ``i`` (its number is in the name)."""
    return f"c{i // FILES_PER_DIR:05d}/i{i:09d}.png"


def item_number(path: str) -> int:
    return int(path.rsplit("/", 1)[-1][1:10])


class EncoderIdentity:
    """What the build needs to know about the model, read from a real encoder file (never run)."""

    def __init__(self, path: Path):
        from moco_retrieval.indexer.encoder import read_encoder_metadata

        self.path = Path(path)
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self.metadata = read_encoder_metadata(self.path)
        self.embedding_dim = self.metadata["embedding_dim"]
        self.image_size = self.metadata["image_size"]
        self.resize = self.metadata["resize"]
        self.provider = "synthetic"


class SyntheticCorpus:
    """Vectors for synthetic files: item ``i``'s vector is row ``i % CHUNK`` of :func:`chunk_vectors`."""

    def __init__(self, encoder: Path, seed: int = 0):
        self.encoder = EncoderIdentity(encoder)
        self.seed = seed
        self._cache: tuple[int, np.ndarray] | None = None

    def vectors(self, numbers: np.ndarray) -> np.ndarray:
        out = np.empty((len(numbers), self.encoder.embedding_dim), dtype=np.float32)
        order = np.argsort(numbers, kind="stable")
        for pos in order:
            i = int(numbers[pos])
            if self._cache is None or self._cache[0] != i // CHUNK:
                self._cache = (i // CHUNK, chunk_vectors(i // CHUNK, self.encoder.embedding_dim, self.seed))
            out[pos] = self._cache[1][i % CHUNK]
        return out

    def embed_into(self, entries, shards, progress: bool = False) -> dict:
        """Put the vectors of ``entries`` (FoundFile) that no finished shard holds into ``shards``."""
        tic = time.perf_counter()
        pending = [e for e in entries if shards.lookup(e.path, e.bytes, e.mtime_ns) is None]
        t_vectors = 0.0
        for start in range(0, len(pending), CHUNK):  # a chunk at a time: 10M rows would be 20 GB at once
            part = pending[start : start + CHUNK]
            toc = time.perf_counter()
            vectors = self.vectors(np.array([item_number(e.path) for e in part], dtype=np.int64))
            t_vectors += time.perf_counter() - toc
            for e, v in zip(part, vectors):
                shards.add(
                    {
                        "path": e.path,
                        "stat_bytes": e.bytes,
                        "mtime_ns": e.mtime_ns,
                        "sha256": hashlib.sha256(e.path.encode()).hexdigest(),
                        "width": 32,
                        "height": 32,
                        "bytes": e.bytes,
                        "error": None,
                    },
                    v,
                )
        shards.flush()
        total = time.perf_counter() - tic
        return {
            "embedded": len(pending),
            "resumed": len(entries) - len(pending),
            "embed": total,
            "decode_wait": 0.0,
            "encoder": t_vectors,
            "decode_cpu": 0.0,
        }


def install_legacy(corpus: SyntheticCorpus) -> None:
    """Inject ``corpus`` into a pre-issue-12 ``indexer.build`` (it opened the encoder and embedded inline)."""
    import moco_retrieval.indexer.build as build

    build.OnnxEncoder = lambda path, device="auto", threads=None: corpus.encoder
    build._embed = lambda cfg, encoder, image_root, todo, shards: corpus.embed_into(todo, shards)


def make_encoder(work: Path, image_size: int = 32) -> Path:
    """A real encoder.onnx (random-weight ResNet-18 with the ImageNet stem, ``image_size`` px, 512-d), exported
    in a child process so that torch never counts in this process's memory."""
    path = work / "encoder.onnx"
    if not path.is_file():
        import subprocess

        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from bench.index_scale import "
                "_export; _export(Path(sys.argv[1]), int(sys.argv[2]))",
                str(work),
                str(image_size),
            ],
            check=True,
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
    return path


def _export(work: Path, image_size: int = 32) -> None:
    import torch

    from moco_retrieval.trainer.checkpoint import write_random_init_checkpoint
    from moco_retrieval.trainer.config import TrainConfig
    from moco_retrieval.trainer.export import export_encoder

    torch.set_num_threads(1)
    cfg = TrainConfig(
        data_dir="",
        out_dir=str(work / "run"),
        arch="resnet18",
        stem="imagenet",
        image_size=image_size,
        batch_size=16,
        queue_size=32,
        workers=0,
        device="cpu",
        knn_every=0,
    )
    run = write_random_init_checkpoint(cfg, work / "run", seed=0)
    export_encoder(run, work / "encoder.onnx", verify=False, image_size=image_size)


def make_files(root: Path, start: int, stop: int) -> None:
    """Create the (empty) files of items ``start..stop-1``: the scan stats them, nothing reads them."""
    made = set()
    for i in range(start, stop):
        rel = file_path(i)
        folder = rel.split("/")[0]
        if folder not in made:
            (root / folder).mkdir(parents=True, exist_ok=True)
            made.add(folder)
        (root / rel).touch()


def _state(work: Path) -> dict:
    try:
        return json.loads((work / "state.json").read_text())
    except FileNotFoundError:
        return {}


def _save_state(work: Path, state: dict) -> None:
    (work / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def synthetic_scan(state: dict):
    """A scanner (see ``indexer.build.build_index_dir``) listing items ``removed .. next`` without files."""
    from moco_retrieval.contracts.images import FoundFile
    from moco_retrieval.indexer.scan import ScanResult

    def scan(root, labels):
        entries = [
            FoundFile(file_path(i), f"c{i // FILES_PER_DIR:05d}", 0, 1) for i in range(state["removed"], state["next"])
        ]
        return ScanResult(root=Path(root), entries=entries, skipped=[])

    return scan


def _run_index(
    args, corpus: SyntheticCorpus, work: Path, state: dict, changed: list[str] | None = None
) -> tuple[dict, float, int]:
    from moco_retrieval.indexer.build import IndexConfig, build_index_dir

    cfg_kw = dict(index_type=state["index_type"], workers=0, progress=False, device="cpu")
    if state.get("max_index_memory") and not args.legacy:
        cfg_kw["max_index_memory"] = state["max_index_memory"]
    if changed is not None:
        listing = work / "changed.txt"
        listing.write_text("\n".join(changed) + "\n")
        cfg_kw["changed_list"] = str(listing)
    if getattr(args, "compact", None):
        cfg_kw["compact"] = args.compact
    cfg = IndexConfig(str(work / "files"), str(corpus.encoder.path), str(work / "index"), **cfg_kw)
    (work / "files").mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    if args.legacy:
        install_legacy(corpus)
        result = build_index_dir(cfg)
    else:
        scanner = synthetic_scan(state) if not state.get("files", True) and changed is None else None
        result = build_index_dir(cfg, embedder=corpus, scanner=scanner)
    wall = time.perf_counter() - tic
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from dataclasses import asdict

    row = asdict(result)
    row.pop("skipped", None)
    return row, wall, peak_rss


def phase_build(args, work: Path) -> None:
    state = _state(work)
    if state:
        raise SystemExit(f"{work} already holds a corpus ({state}); use another --work")
    work.mkdir(parents=True, exist_ok=True)
    encoder = make_encoder(work)
    tic = time.perf_counter()
    if not args.no_files:
        make_files(work / "files", 0, args.n)
    t_files = time.perf_counter() - tic
    state = {
        "n": args.n,
        "next": args.n,
        "removed": 0,
        "index_type": args.index_type,
        "max_index_memory": args.max_index_memory,
        "files": not args.no_files,
    }
    _save_state(work, state)
    corpus = SyntheticCorpus(encoder)
    row, wall, peak = _run_index(args, corpus, work, state)
    _record(
        args,
        "build",
        {
            "n": args.n,
            "index_type": args.index_type,
            "make_files_s": round(t_files, 1),
            "wall_s": round(wall, 2),
            "peak_rss_bytes": peak,
            "result": row,
            "disk_bytes": _du(work / "index"),
        },
    )


def phase_update(args, work: Path, sign: int) -> None:
    state = _state(work)
    corpus = SyntheticCorpus(make_encoder(work))
    if sign > 0:
        names = [file_path(i) for i in range(state["next"], state["next"] + args.count)]
        make_files(work / "files", state["next"], state["next"] + args.count)
        state["next"] += args.count
    else:  # remove the lowest-numbered live files
        names = [file_path(i) for i in range(state["removed"], state["removed"] + args.count)]
        for name in names:
            (work / "files" / name).unlink(missing_ok=not state.get("files", True))
        state["removed"] += args.count
    _save_state(work, state)
    if not state.get("files", True) and not args.changed_list:
        raise SystemExit("a --no-files corpus is updated with --changed-list")
    row, wall, peak = _run_index(args, corpus, work, state, names if args.changed_list else None)
    t = row["timings"]
    publish = wall - t.get("embed", 0.0)
    _record(
        args,
        "add" if sign > 0 else "remove",
        {
            "count": args.count,
            "changed_list": bool(args.changed_list),
            "wall_s": round(wall, 2),
            "publish_s_beyond_embedding": round(publish, 2),
            "peak_rss_bytes": peak,
            "result": row,
            "disk_bytes": _du(work / "index"),
        },
    )


def _du(path: Path) -> int:
    total, seen = 0, set()
    for p in path.rglob("*"):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("build", "add", "remove", "serve"))
    p.add_argument("--work", type=Path, required=True, help="scratch folder of this corpus (files, index)")
    p.add_argument("--n", type=int, default=1_000_000, help="build: corpus size")
    p.add_argument("--index-type", default="auto", help="build: --index-type of moco index")
    p.add_argument("--max-index-memory", default=None, help="build: --max-index-memory of moco index")
    p.add_argument("--no-files", action="store_true", help="build: scan nothing real (for 10M: no 10M files)")
    p.add_argument("--count", type=int, default=1000, help="add/remove: items")
    p.add_argument(
        "--changed-list",
        action="store_true",
        help="add/remove: pass the changed files as --changed-list instead of rescanning the folder",
    )
    p.add_argument("--compact", default=None, help="add/remove: --compact of moco index (auto, now, never)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="serve: processes")
    p.add_argument("--queries", type=int, default=1000, help="serve: held-out query vectors for recall and QPS")
    p.add_argument("--seconds", type=float, default=10.0, help="serve: search time per worker count")
    p.add_argument("--http", action="store_true", help="serve: also `moco serve --workers N` over HTTP")
    p.add_argument(
        "--cold",
        action="store_true",
        help="serve: drop the index's files from the page cache first (measures the disk)",
    )
    p.add_argument("--legacy", action="store_true", help="code from before issue 12 (see the docstring)")
    p.add_argument("--label", default="after", help="a tag stored with each row (e.g. before / after)")
    p.add_argument("--out", default=str(OUT / "index_scale.json"), help="JSON file the rows are appended to")
    args = p.parse_args()
    from moco_retrieval.app.cli import setup_logging

    setup_logging()
    work = args.work.absolute()
    if args.phase == "build":
        phase_build(args, work)
    elif args.phase in ("add", "remove"):
        phase_update(args, work, +1 if args.phase == "add" else -1)
    else:
        from bench.serve_scale import phase_serve

        phase_serve(args, work)


if __name__ == "__main__":
    main()
