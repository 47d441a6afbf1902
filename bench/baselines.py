"""What a trained encoder must beat on one labeled collection, at full size: k-NN top-1 of raw pixels (L2, k of
1 / 5 / 20) and of a random ResNet-18 at 32 px (``--image-size``), as initialised and with its BatchNorm
statistics fitted, several seeds (issue 20's two baselines). The same measurement as
``bench/learning_curves.py``'s baseline lines, over up to ``--max-images`` images per split instead of the
monitor's 5,000, so that it compares with ``moco eval knn`` on the whole collection.

    python bench/baselines.py --data /work/scratch/acc30/data --max-images 60000 --seeds 0 1 2 \\
        --out bench/results/baselines_fmnist60k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench.learning_curves import IMAGE_SIZE, random_baselines  # noqa: E402
from bench.machine import machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a labeled folder: train/<class>/... and val/ or test/<class>/...")
    p.add_argument("--max-images", type=int, default=5000, help="images per split (evenly spread)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--cache-dir", default=None, help="decoded-image cache (default: the trainer's)")
    p.add_argument(
        "--image-size", type=int, default=IMAGE_SIZE, help="px the pixels and the random networks are read at"
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    start = time.perf_counter()
    found = random_baselines(Path(args.data), args.seeds, args.cache_dir, args.max_images, args.image_size)
    spread = {
        name: {"mean": round(statistics.mean(found[name]), 4), "sd": round(statistics.stdev(found[name]), 4)}
        for name in ("random", "random_bn")
        if len(found[name]) > 1
    }
    result = {
        "benchmark": "baselines",
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "data": args.data,
        "max_images": args.max_images,
        "image_size": args.image_size,
        "protocol": f"the monitor's k-NN (k 20, T 0.07) at {args.image_size} px for the networks; L2 majority vote "
        "for the pixels",
        **found,
        "spread": spread,
        "seconds": round(time.perf_counter() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("random", "random_bn", "pixels_by_k", "spread")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
