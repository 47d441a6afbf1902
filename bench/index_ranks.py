"""``moco index`` on real images with 1 and N ranks, end to end in images/s, against the encoder alone.

Four measurements on the same folder and encoder (JSON out):

- **encoder ceiling**: ``OnnxEncoder.embed`` on already decoded, resized batches of ``--batch-size`` with all
  cores (ONNX Runtime's intra-op threads): no reading, decoding, shards, LMDB or FAISS;
- **the machine's limit** (issue 25): the cores divided by the single-core milliseconds of decoding one image
  (the indexer's decoder in one process) plus encoding it (ONNX Runtime with one intra-op thread), what one
  process could reach if every core did one or the other all the time;
- **1 rank**: ``moco index IMAGE_DIR --out A`` as a subprocess, from nothing to a published generation, and
  its fraction of the limit (the mean of the limit measured before and after it, ``limit`` and ``limit_after``:
  this VM's speed drifts by 5-10% within minutes), and of the **same-run limit**: the CPU seconds its encoder
  lanes and decode processes spent in that very run (``bench/cpu_accounting.py``), spread over the cores;
- **N ranks**: ``torchrun --standalone --nproc_per_node N -m moco_retrieval index IMAGE_DIR --out B``, the same.

End-to-end images/s = images indexed / wall time of the command (its start-up included). Both indexes are
checked to hold the same items. The encoder is exported from a random-weight checkpoint (throughput does
not depend on training) unless ``--model`` is given.

    python bench/index_ranks.py --images /work/scratch/fmnist60k --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def encoder_ceiling(model: Path, images: Path, count: int, batch_size: int, threads: int | None = None) -> dict:
    """The encoder alone on decoded batches, with ``threads`` intra-op threads (default: all cores), and the
    single-core cost of reading, decoding and resizing the same files (the indexer's decoder in this process)."""
    from moco_retrieval.contracts.images import walk_image_files
    from moco_retrieval.indexer.decode import decode_files
    from moco_retrieval.indexer.encoder import OnnxEncoder

    encoder = OnnxEncoder(model, device="cpu", threads=threads)
    paths = [f.path for f in walk_image_files(images)][:count]
    tic = time.perf_counter()
    pixels = np.stack([d.pixels for d in decode_files(images, paths, encoder.image_size, encoder.resize, 0)])
    decode_seconds = time.perf_counter() - tic
    encoder.embed(pixels[:batch_size])  # warm-up
    tic = time.perf_counter()
    for start in range(0, len(pixels), batch_size):
        encoder.embed(pixels[start : start + batch_size])
    seconds = time.perf_counter() - tic
    return {
        "images": len(pixels),
        "seconds": round(seconds, 2),
        "images_per_s": round(len(pixels) / seconds, 1),
        "threads": threads or "all cores",
        "batch_size": batch_size,
        "decode_ms_per_image_one_core": round(1000 * decode_seconds / len(pixels), 4),
    }


def machine_limit(one_thread: dict, cores: int) -> dict:
    """The most images/s one machine can index when every core either decodes or encodes: ``cores`` divided
    by the single-core seconds of decoding plus encoding one image."""
    encode_ms = 1000 / one_thread["images_per_s"]
    decode_ms = one_thread["decode_ms_per_image_one_core"]
    return {
        "cores": cores,
        "encode_ms_per_image_one_core": round(encode_ms, 4),
        "decode_ms_per_image_one_core": decode_ms,
        "images_per_s": round(cores * 1000 / (encode_ms + decode_ms), 1),
    }


def run_index(cmd: list[str], count: int) -> dict:
    tic = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return _index_row(cmd, proc.stdout, wall)


def _index_row(cmd: list[str], stdout: str, wall: float) -> dict:
    indexed = int(re.search(r"^images in index\s+(\d+)", stdout, re.M).group(1))
    throughput = re.search(r"^throughput\s+(.*)$", stdout, re.M)
    return {
        "command": " ".join(cmd),
        "wall_s": round(wall, 2),
        "images": indexed,
        "images_per_s_end_to_end": round(indexed / wall, 1),
        "reported": throughput.group(1) if throughput else None,
        "summary": [line for line in stdout.splitlines() if line and not line.startswith(" ")],
    }


def run_index_accounted(cmd: list[str], work: Path, cores: int) -> dict:
    """One process of ``moco index`` with every thread's CPU seconds (``bench.cpu_accounting``), and the limit
    read from the same run: the CPU its two encoder lanes (its two busiest threads: one intra-op thread each
    on a CPU) and its decode processes spent, spread over ``cores``. The machine's drift cancels."""
    from bench.cpu_accounting import account

    out = work / "stdout.txt"
    with open(out, "w") as stdout:
        acct = account(cmd, cwd=REPO, env=ENV, stdout=stdout)
    row = _index_row(cmd, out.read_text(), acct["wall_s"])
    main = [t for t in acct["threads"] if t["pid"] == acct["threads"][0]["pid"]]  # the busiest thread's process
    lanes = sum(t["cpu_s"] for t in sorted(main, key=lambda t: -t["cpu_s"])[:2])
    decoders = sum(t["cpu_s"] for t in acct["threads"] if "forkserver" in t["command"])
    limit_s = (lanes + decoders) / cores
    row["cpu"] = {
        "total_s": acct["cpu_s"],
        "encoder_lanes_s": round(lanes, 2),
        "decoders_s": round(decoders, 2),
        "idle_core_s": round(cores * acct["wall_s"] - acct["cpu_s"], 2),
        "threads": acct["threads"],
    }
    row["same_run_limit_images_per_s"] = round(row["images"] / limit_s, 1)
    row["of_same_run_limit"] = round(limit_s / acct["wall_s"], 3)
    return row


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="folder of real images")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the torchrun run (default 2; 1: no torchrun run)")
    p.add_argument(
        "--model", type=Path, default=None, help="encoder.onnx (default: a random ResNet-18, --image-size px)"
    )
    p.add_argument("--image-size", type=int, default=32, help="input side of that random encoder (default 32)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ceiling-images", type=int, default=8192, help="images the encoder alone embeds")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder, deleted)")
    p.add_argument("--out", type=Path, default=OUT / "index_ranks.json")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="moco-ranks-"))
    try:
        model = args.model
        if model is None:
            from bench.index_scale import make_encoder

            model = make_encoder(work, args.image_size)
        from moco_retrieval.contracts.images import walk_image_files
        from moco_retrieval.indexer.encoder import available_cores

        count = len(walk_image_files(args.images))
        result = {
            "benchmark": "index_ranks",
            "machine": machine(),
            "images_dir": str(args.images),
            "images": count,
            "batch_size": args.batch_size,
            "model": str(model),
        }
        result["encoder_ceiling"] = encoder_ceiling(model, args.images, args.ceiling_images, args.batch_size)
        print("encoder", json.dumps(result["encoder_ceiling"]), flush=True)
        one_thread = encoder_ceiling(model, args.images, args.ceiling_images, args.batch_size, threads=1)
        result["encoder_one_thread"] = one_thread
        result["limit"] = machine_limit(one_thread, available_cores())
        print("limit", json.dumps(result["limit"]), flush=True)
        common = ["--model", str(model), "--device", "cpu", "--batch-size", str(args.batch_size), "--no-progress"]
        one = [sys.executable, "-m", "moco_retrieval", "index", str(args.images), "--out", str(work / "one"), *common]
        result["one_rank"] = run_index_accounted(one, work, available_cores())
        # the limit again after the run: on a shared VM the machine's speed drifts within a minute, and the run
        # is compared with the mean of the limit measured on both sides of it
        after = encoder_ceiling(model, args.images, args.ceiling_images, args.batch_size, threads=1)
        result["limit_after"] = machine_limit(after, available_cores())
        bracket = (result["limit"]["images_per_s"] + result["limit_after"]["images_per_s"]) / 2
        result["one_rank"]["of_limit"] = round(result["one_rank"]["images_per_s_end_to_end"] / bracket, 3)
        print("1 rank", json.dumps(result["one_rank"]), flush=True)
        if args.ranks < 2:
            return _write(result, args.out)
        many = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.ranks}",
            "-m",
            "moco_retrieval",
            "index",
            str(args.images),
            "--out",
            str(work / "many"),
            *common,
        ]
        result[f"{args.ranks}_ranks"] = run_index(many, count)
        print(f"{args.ranks} ranks", json.dumps(result[f"{args.ranks}_ranks"]), flush=True)

        from moco_retrieval.indexer.index_dir import IndexDirectory

        with IndexDirectory.open(work / "one") as a, IndexDirectory.open(work / "many") as b:
            ids = a.index.ids()
            result["same_items"] = bool(
                np.array_equal(ids, b.index.ids())
                and [r["path"] for r in a.records(ids[::97])] == [r["path"] for r in b.records(ids[::97])]
            )
        _write(result, args.out)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
