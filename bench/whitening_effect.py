#!/usr/bin/env python3
"""What PCA whitening (``moco export``'s default, ``trainer/whitening.py``) does to k-NN top-1 on labeled
collections: each model's features of ``val/`` (or ``test/``) classified against ``train/``, plain and whitened
with the whitening fitted on ``train/`` alone (no labels), keeping ``n / r`` directions for several ``r``.

A model is a run directory or checkpoint, or ``random_bn:ARCH:STEM:SIZE:SEED`` (a random backbone with its
BatchNorm statistics fitted to ``train/``, issue 20's baseline). Paired: the same features, whitened or not.

    python bench/whitening_effect.py --data /work/datasets/tuxpaint_split \\
        --model runs/tux_s0 --model random_bn:resnet18:imagenet:32:0 --out bench/results/whitening_tux.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402

RATIOS = (20, 10, 5, 4, 3, 2, 1)  # keep min(D, n // r) directions


def backbone_for(model: str, train_paths: list, torch):
    """``(backbone in eval mode, image size)`` of a run directory / checkpoint or a ``random_bn:...`` spec."""
    from torch.optim.swa_utils import update_bn
    from torch.utils.data import DataLoader

    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.eval_transform import eval_transform
    from moco_retrieval.trainer.evaluate import _Images
    from moco_retrieval.trainer.export import load_backbone

    if not model.startswith("random_bn:"):
        backbone, cfg, _ = load_backbone(model)
        return backbone.eval(), cfg.image_size
    _, arch, stem, size, seed = model.split(":")
    torch.manual_seed(int(seed))
    backbone, _ = build_resnet(arch, stem)
    loader = DataLoader(_Images(train_paths, eval_transform(int(size))), batch_size=256)
    with torch.no_grad():  # a batch of one has no batch statistics
        update_bn((x for x in loader if len(x) > 1), backbone)
    return backbone.eval(), int(size)


def plot(doc: dict, png: Path) -> None:
    """k-NN top-1 against the number of whitened directions kept, one line per model, its plain features dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, row in enumerate(doc["rows"]):
        color = f"C{i}"
        label = (
            row["model"] if row["model"].startswith("random_bn:") else Path(row["model"]).parent.name or row["model"]
        )
        dims = sorted(row["whitened"], key=int)
        ax.plot([int(d) for d in dims], [100 * row["whitened"][d] for d in dims], "o-", color=color, label=label)
        ax.axhline(100 * row["plain"], color=color, linestyle="--", linewidth=1)
    ax.axvline(doc["rows"][0]["train"] / 4, color="grey", linestyle=":", label="n / 4 (moco export's default)")
    ax.set_xscale("log")
    ax.set_xlabel("whitened directions kept (log)")
    ax.set_ylabel(f"k-NN top-1 (k = {doc['k']}), %")
    ax.set_title(f"PCA whitening fitted on train/, {Path(doc['data']).name} (dashed: not whitened)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier result")
    p.add_argument("--data", help="a labeled split: train/<class>/... and val/ or test/<class>/...")
    p.add_argument("--model", action="append", help="run dir, checkpoint or random_bn:A:S:SIZE:SEED")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    if not (args.data and args.model and args.out):
        p.error("--data, --model and --out are required (or --replot JSON)")

    import torch

    from moco_retrieval.trainer.evaluate import embed_files, knn_top1, load_labeled_pair
    from moco_retrieval.trainer.whitening import fit_pca_whitening

    torch.set_num_threads(2)
    data = Path(args.data)
    test_dir = data / "val" if (data / "val").is_dir() else data / "test"
    train, test, classes = load_labeled_pair(data / "train", test_dir)
    rows = []
    for model in args.model:
        tic = time.perf_counter()
        backbone, size = backbone_for(model, train.paths, torch)
        xb, xq = embed_files(backbone, train.paths, size), embed_files(backbone, test.paths, size)
        n, dim = xb.shape

        def top1(b, q) -> float:
            b, q = torch.nn.functional.normalize(b, dim=1), torch.nn.functional.normalize(q, dim=1)
            found = knn_top1(b.numpy(), train.labels, q.numpy(), test.labels, len(classes), ks=(args.k,))
            return round(found[0]["top1"], 4)

        row = {
            "model": model,
            "image_size": size,
            "train": n,
            "test": len(xq),
            "feature_dim": dim,
            "plain": top1(xb, xq),
        }
        row["whitened"] = {}
        for dims in sorted({min(dim, n // r) for r in RATIOS if n // r >= 1}):
            whitening = fit_pca_whitening(xb, dims)
            with torch.no_grad():
                row["whitened"][str(dims)] = top1(whitening(xb), whitening(xq))
        row["seconds"] = round(time.perf_counter() - tic, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    doc = {
        "benchmark": "whitening_effect",
        "data": str(data),
        "classes": len(classes),
        "k": args.k,
        "ratios": list(RATIOS),
        "machine": machine(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
