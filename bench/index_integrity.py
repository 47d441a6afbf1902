"""What the checks of a generation's files cost (issue 18): the size check at every open, and the full hash of
``moco index --verify``, on an index built by ``bench/index_scale.py``.

    python bench/index_scale.py build --work W --n 100000 --index-type flat
    python bench/index_scale.py add --work W --count 1000 --changed-list
    python bench/index_integrity.py --work W --out bench/results/index_integrity_100k.json

Each measurement is the median of ``--repeat`` runs in this process (the page cache warm after the first):

    check_sizes_s    integrity.check_files at open: a stat of every recorded file against its size
    open_s           the whole IndexDirectory open (the size check included): manifest, FAISS (memory-mapped),
                     removed ids, LMDB headers and environments
    verify_s         integrity.verify_index_dir: the sha256 of every file and vector block, then an open
    verify_cli_s     `moco index --verify --out W/index` as a subprocess (interpreter start included), once
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="an index_scale.py work folder (its index/ is used)")
    p.add_argument("--repeat", type=int, default=20, help="runs per measurement (verify: a fifth of them)")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write the row to")
    args = p.parse_args()

    from moco_retrieval.indexer import integrity
    from moco_retrieval.indexer.index_dir import IndexDirectory
    from moco_retrieval.indexer.layout import IndexLayout
    from moco_retrieval.indexer.manifest import IndexManifest

    index = args.work.absolute() / "index"
    layout = IndexLayout(index)
    live = layout.current()
    manifest = IndexManifest.read(layout.generation(live).manifest)

    def open_close():
        with IndexDirectory(index, live):
            pass

    open_close()  # warm the page cache
    check_sizes = _median(lambda: integrity.check_files(layout, live, manifest), args.repeat)
    open_s = _median(open_close, args.repeat)
    verified = integrity.verify_index_dir(index)
    verify = _median(lambda: integrity.verify_index_dir(index), max(1, args.repeat // 5))
    tic = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "moco_retrieval", "index", "--verify", "--out", str(index)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    verify_cli = time.perf_counter() - tic
    row = {
        "benchmark": "index_integrity",
        "command": " ".join(sys.argv),
        "machine": machine(),
        "generation": live,
        "items": verified.count,
        "factory": manifest.factory,
        "files": len(manifest.files),
        "block_files": len(manifest.block_files),
        "bytes_hashed": verified.checked.bytes_hashed,
        "check_sizes_s": round(check_sizes, 6),
        "open_s": round(open_s, 4),
        "verify_s": round(verify, 3),
        "verify_mb_per_s": round(verified.checked.bytes_hashed / 1e6 / verify, 1),
        "verify_cli_s": round(verify_cli, 3),
        "verify_cli_stdout": proc.stdout.strip().splitlines(),
    }
    print(json.dumps(row, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
