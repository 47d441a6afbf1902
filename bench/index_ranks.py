"""``moco index`` on real images with 1 and N ranks, end to end in images/s, against the encoder alone.

Three measurements on the same folder and encoder (JSON out):

- **encoder ceiling**: ``OnnxEncoder.embed`` on already decoded, resized batches of ``--batch-size`` with all
  cores (ONNX Runtime's intra-op threads): no reading, decoding, shards, LMDB or FAISS;
- **1 rank**: ``moco index IMAGE_DIR --out A`` as a subprocess, from nothing to a published generation;
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
import platform
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

OUT = Path(__file__).resolve().parent / "results"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def encoder_ceiling(model: Path, images: Path, count: int, batch_size: int) -> dict:
    from moco_retrieval.contracts.images import walk_image_files
    from moco_retrieval.indexer.decode import decode_files
    from moco_retrieval.indexer.encoder import OnnxEncoder

    encoder = OnnxEncoder(model, device="cpu")
    paths = [f.path for f in walk_image_files(images)][:count]
    pixels = np.stack([d.pixels for d in decode_files(images, paths, encoder.image_size, encoder.resize, 0)])
    encoder.embed(pixels[:batch_size])  # warm-up
    tic = time.perf_counter()
    for start in range(0, len(pixels), batch_size):
        encoder.embed(pixels[start : start + batch_size])
    seconds = time.perf_counter() - tic
    return {
        "images": len(pixels),
        "seconds": round(seconds, 2),
        "images_per_s": round(len(pixels) / seconds, 1),
        "threads": "all cores",
        "batch_size": batch_size,
    }


def run_index(cmd: list[str], count: int) -> dict:
    tic = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    indexed = int(re.search(r"^images in index\s+(\d+)", proc.stdout, re.M).group(1))
    throughput = re.search(r"^throughput\s+(.*)$", proc.stdout, re.M)
    return {
        "command": " ".join(cmd),
        "wall_s": round(wall, 2),
        "images": indexed,
        "images_per_s_end_to_end": round(indexed / wall, 1),
        "reported": throughput.group(1) if throughput else None,
        "summary": [line for line in proc.stdout.splitlines() if line and not line.startswith(" ")],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="folder of real images")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the torchrun run (default 2)")
    p.add_argument("--model", type=Path, default=None, help="encoder.onnx (default: a random ResNet-18, 32 px)")
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

            model = make_encoder(work)
        from moco_retrieval.contracts.images import walk_image_files

        count = len(walk_image_files(args.images))
        result = {
            "benchmark": "index_ranks",
            "machine": {"host": platform.node(), "cpus": os.cpu_count()},
            "images_dir": str(args.images),
            "images": count,
            "batch_size": args.batch_size,
            "model": str(model),
        }
        result["encoder_ceiling"] = encoder_ceiling(model, args.images, args.ceiling_images, args.batch_size)
        print("encoder", json.dumps(result["encoder_ceiling"]), flush=True)
        common = ["--model", str(model), "--device", "cpu", "--batch-size", str(args.batch_size), "--no-progress"]
        one = [sys.executable, "-m", "moco_retrieval", "index", str(args.images), "--out", str(work / "one"), *common]
        result["one_rank"] = run_index(one, count)
        print("1 rank", json.dumps(result["one_rank"]), flush=True)
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
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
