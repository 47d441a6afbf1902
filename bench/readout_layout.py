#!/usr/bin/env python3
"""Readouts that keep where things are in the frame, against ``moco export``'s global average of layer4: k-NN
top-1 of ``val/`` (or ``test/``) against ``train/``, each readout plain and PCA-whitened as ``moco export``
whitens (fitted on at most 10,000 ``train/`` images, no labels, ``min(D, n // 4)`` directions; above 512, also
at 512).

Readouts of one ResNet forward pass (at 32 px the ImageNet stem leaves layer3 a 2x2 map and layer4 1x1):

- ``global l4``: layer4 averaged over its map (what ``moco export`` bakes in);
- ``l3 2x2``: layer3 average-pooled to 2x2 and flattened (keeps coarse layout);
- ``l4 + l3 2x2``, ``l4 + l3avg``, ``l4 + l4 2x2``: blocks L2-normalised, then concatenated (a spatial
  pyramid; ``l4 2x2`` only where layer4's map is larger than 1x1).

A model is a run directory or checkpoint, or ``random_bn:ARCH:STEM:SIZE:SEED`` (issue 20's baseline: random
weights with BatchNorm statistics fitted to ``train/``). Issue 20 asks the trained encoder to beat that baseline
read out the same way, so each readout is judged by its margin over random BN as well as by its accuracy.

    python bench/readout_layout.py --data /work/datasets/icons_split --out bench/results/readout_layout_icons.json \\
        --model runs/icons_s0 --model random_bn:resnet18:imagenet:32:0
    python bench/readout_layout.py --summary bench/results/readout_layout_*.json
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

from bench.machine import machine  # noqa: E402
from bench.whitening_effect import backbone_for  # noqa: E402

CAPPED_DIM = 512  # the backbone's own width: a readout wider than it, whitened down to it


def feature_maps(backbone, paths: list, image_size: int, torch) -> dict:
    """``{readout part: [N, C]}`` of ``paths`` in one pass: layer3 / layer4 averaged and pooled to 2x2."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from moco_retrieval.trainer.eval_transform import eval_transform
    from moco_retrieval.trainer.evaluate import _Images

    got: dict = {}
    hooks = [
        backbone.layer3.register_forward_hook(lambda m, i, o: got.__setitem__("l3", o)),
        backbone.layer4.register_forward_hook(lambda m, i, o: got.__setitem__("l4", o)),
    ]
    parts: dict[str, list] = {"l4avg": [], "l3avg": [], "l3g2": [], "l4g2": []}
    try:
        with torch.no_grad():
            for x in DataLoader(_Images(paths, eval_transform(image_size)), batch_size=256):
                backbone(x)
                parts["l4avg"].append(got["l4"].mean((2, 3)))
                parts["l3avg"].append(got["l3"].mean((2, 3)))
                parts["l3g2"].append(F.adaptive_avg_pool2d(got["l3"], 2).flatten(1))
                parts["l4g2"].append(F.adaptive_avg_pool2d(got["l4"], 2).flatten(1))
    finally:
        for h in hooks:
            h.remove()
    out = {k: torch.cat(v) for k, v in parts.items()}
    out["l4_map"] = tuple(got["l4"].shape[2:])
    return out


def readouts(f: dict, torch) -> dict:
    """``{name: [N, D]}``; a concatenation normalises each block first (each gets the same say)."""
    import torch.nn.functional as F

    def cat(*xs):
        return torch.cat([F.normalize(x, dim=1) for x in xs], 1)

    out = {
        "global l4": f["l4avg"],
        "l3 2x2": f["l3g2"],
        "l4 + l3 2x2": cat(f["l4avg"], f["l3g2"]),
        "l4 + l3avg": cat(f["l4avg"], f["l3avg"]),
    }
    if f["l4_map"] != (1, 1):  # at 1x1, layer4 pooled to 2x2 is the global average again
        out["l4 2x2"] = f["l4g2"]
        out["l4 + l4 2x2"] = cat(f["l4avg"], f["l4g2"])
    return out


def measure(data: Path, models: list[str], k: int) -> dict:
    import torch
    import torch.nn.functional as F

    from moco_retrieval.trainer.evaluate import knn_top1, load_labeled_pair
    from moco_retrieval.trainer.whitening import WHITEN_MAX_IMAGES, fit_pca_whitening, whitening_dim

    torch.set_num_threads(2)
    test_dir = data / "val" if (data / "val").is_dir() else data / "test"
    train, test, classes = load_labeled_pair(data / "train", test_dir)

    def top1(b, q) -> float:
        found = knn_top1(
            F.normalize(b, dim=1).numpy(),
            train.labels,
            F.normalize(q, dim=1).numpy(),
            test.labels,
            len(classes),
            ks=(k,),
        )
        return round(found[0]["top1"], 4)

    rows = []
    for model in models:
        tic = time.perf_counter()
        backbone, size = backbone_for(model, train.paths, torch)
        rb = readouts(feature_maps(backbone, train.paths, size, torch), torch)
        rq = readouts(feature_maps(backbone, test.paths, size, torch), torch)
        row = {"model": model, "image_size": size, "plain": {}, "whitened": {}, "whitened_512": {}, "dims": {}}
        order = torch.randperm(len(train.paths), generator=torch.Generator().manual_seed(0))
        pick = order[:WHITEN_MAX_IMAGES]  # the whitening is fitted on at most what moco export fits on
        for name, xb in rb.items():
            row["plain"][name] = top1(xb, rq[name])
            fit = xb[pick]
            dim = whitening_dim(len(fit), xb.shape[1])
            row["dims"][name] = [xb.shape[1], dim]
            with torch.no_grad():
                w = fit_pca_whitening(fit, dim)
                row["whitened"][name] = top1(w(xb), w(rq[name]))
                if dim > CAPPED_DIM:
                    w = fit_pca_whitening(fit, CAPPED_DIM)
                    row["whitened_512"][name] = top1(w(xb), w(rq[name]))
        row["seconds"] = round(time.perf_counter() - tic, 1)
        rows.append(row)
        print(model, "whitened", row["whitened"], flush=True)
    return {
        "benchmark": "readout_layout",
        "machine": machine(),
        "data": str(data),
        "train": len(train.paths),
        "test": len(test.paths),
        "k": k,
        "rows": rows,
    }


def summary(docs: list[dict]) -> list[dict]:
    """Per collection and readout: trained and random-BN whitened k-NN top-1 (mean, sd over models), the margin."""

    def mean_sd(values: list[float]) -> list[float]:
        return [
            round(100 * statistics.mean(values), 1),
            round(100 * statistics.stdev(values), 1) if len(values) > 1 else 0.0,
        ]

    out = []
    for doc in docs:
        trained = [r for r in doc["rows"] if not r["model"].startswith("random_bn:")]
        random_bn = [r for r in doc["rows"] if r["model"].startswith("random_bn:")]
        for name in doc["rows"][0]["whitened"]:
            t = mean_sd([r["whitened"][name] for r in trained])
            b = mean_sd([r["whitened"][name] for r in random_bn]) if random_bn else None
            out.append(
                {
                    "data": doc["data"],
                    "readout": name,
                    "trained_whitened": t,
                    "random_bn_whitened": b,
                    "margin_points": round(t[0] - b[0], 1) if b else None,
                    "models": [len(trained), len(random_bn)],
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="a labeled split: train/<class>/... and val/ or test/<class>/...")
    p.add_argument("--model", action="append", help="run dir, checkpoint or random_bn:ARCH:STEM:SIZE:SEED")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--out", type=Path)
    p.add_argument("--summary", nargs="+", type=Path, metavar="JSON", help="only print the table of earlier results")
    args = p.parse_args()
    if args.summary:
        for row in summary([json.loads(f.read_text()) for f in args.summary]):
            print(json.dumps(row))
        return
    if not (args.data and args.model and args.out):
        p.error("--data, --model and --out are required (or --summary JSON...)")
    doc = measure(args.data, args.model, args.k)
    doc["summary"] = summary([doc])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
