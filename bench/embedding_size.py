#!/usr/bin/env python3
"""k-NN top-1 of trained runs and of random weights (BN fitted or as built), embedded at several input sizes: what
``trainer.embedding_size`` (``moco export``'s default size) rests on (issue 20).

Each model's backbone embeds ``train/`` and ``val/`` (or ``test/``) at every ``--sizes`` side through the
evaluation transform; k-NN top-1 (k 20, T 0.07) is measured plain and PCA-whitened as ``moco export`` whitens
(fitted on at most 10,000 ``train/`` images spread over the folder, ``min(D, n // 4)`` directions); with
``--mirror``, also whitened on the mirror-averaged features (``trainer.mirror_average``); with ``--layer3`` as well,
also on layer3's average-pooled features beside layer4's (each L2-normalised, concatenated, mirror-averaged); with
``--refit-bn``, a trained model is measured again after its BN statistics are fitted at each size as random BN's
are (``refit_bn``: FixRes / AdaBN's re-estimation, the training's crops replaced by the images). A model is
a run directory or checkpoint, ``random_bn:ARCH:STEM:SEED`` (random weights, BN statistics fitted on up to
10,000 ``train/`` images at each size: issue 20's baseline) or ``random:ARCH:STEM:SEED`` (the same weights with
their BN as built, mean 0 and variance 1, so each BN is the identity: the stronger random line on three of four
collections, ``bench/results/random_weights_baselines.json``). Rows are appended to ``--out``; ``--summary``
prints the mean per collection, model kind and size of one or more result files and plots them (``--png``);
``--curve`` plots the mirror-averaged readout of a run's checkpoints against its epochs, each random line as a
band.

    python bench/embedding_size.py --data /work/datasets/icons_split --sizes 32,48,64 \\
        --out bench/results/embedding_size_30m.json runs/icons_s0 random_bn:resnet18:imagenet:0 random:resnet18:imagenet:0
    python bench/embedding_size.py --summary bench/results/embedding_size_30m.json \\
        --png bench/results/embedding_size_30m.png
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402

MAX_FIT_IMAGES = 10_000
RANDOM_KINDS = ("random_bn", "random")  # model-name prefixes of the random-weight baselines, before the ":"


def model_kind(model: str) -> str:
    """``random_bn``, ``random`` or ``trained``: which line a model's rows belong to."""
    prefix = model.split(":", 1)[0]
    return prefix if prefix in RANDOM_KINDS and ":" in model else "trained"


def _spread(items: list, n: int) -> list:
    step = max(1.0, len(items) / n)
    return [items[int(i * step)] for i in range(min(n, len(items)))]


def backbone_at(model: str, size: int, train_paths: list):
    """``(backbone in eval mode, {"trained_size", "epoch", "step"} or {})`` of a run / checkpoint, of
    ``random_bn:ARCH:STEM:SEED`` with its BN statistics fitted at ``size``, or of ``random:ARCH:STEM:SEED`` as
    built."""
    import torch

    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.export import load_backbone

    kind = model_kind(model)
    if kind == "trained":
        backbone, cfg, ckpt = load_backbone(model)
        return backbone.eval(), {"trained_size": cfg.image_size, "epoch": ckpt["epoch"], "step": ckpt["step"]}
    _, arch, stem, seed = model.split(":")
    torch.manual_seed(int(seed))
    backbone, _ = build_resnet(arch, stem)
    return (fit_bn(backbone, size, train_paths) if kind == "random_bn" else backbone.eval()), {}


def fit_bn(backbone, size: int, train_paths: list):
    """``backbone`` (in place, returned in eval mode) with its BatchNorm statistics replaced by those of up to
    ``MAX_FIT_IMAGES`` ``train/`` images at ``size``, as ``moco export`` re-estimates them
    (``trainer.bn_statistics``): random BN's fit, and with ``--refit-bn`` a trained encoder's."""
    from moco_retrieval.trainer.bn_statistics import refit_bn_statistics

    refit_bn_statistics(backbone, size, _spread(train_paths, MAX_FIT_IMAGES))
    return backbone


def measure(
    data: Path,
    models: list[str],
    sizes: list[int],
    out: Path,
    mirror: bool = False,
    layer3: bool = False,
    refit_bn: bool = False,
) -> None:
    import torch
    import torch.nn.functional as F

    from moco_retrieval.trainer.evaluate import embed_files, load_labeled_pair
    from moco_retrieval.trainer.knn import knn_accuracy
    from moco_retrieval.trainer.mirror_average import mirror as flip
    from moco_retrieval.trainer.whitening import fit_pca_whitening, whitening_dim

    class Mirrored(torch.nn.Module):  # the backbone on the mirrors (MirrorAveraged in two passes, below)
        def __init__(self, backbone):
            super().__init__()
            self.backbone = backbone

        def forward(self, images):
            return self.backbone(flip(images))

    class Layers34(torch.nn.Module):  # a ResNet's layer3 (average-pooled) beside its output, each normalised
        def __init__(self, backbone):
            super().__init__()
            self.backbone, self.pooled3 = backbone, None
            backbone.layer3.register_forward_hook(lambda module, inputs, output: setattr(self, "pooled3", output))

        def forward(self, images):
            layer4 = F.normalize(self.backbone(images), dim=1)
            return torch.cat([F.normalize(self.pooled3.mean((2, 3)), dim=1), layer4], dim=1)

    def whitened(xtr, xte) -> float:
        fit = xtr[_spread(list(range(len(xtr))), MAX_FIT_IMAGES)]
        whitening = fit_pca_whitening(fit, whitening_dim(len(fit), xtr.shape[1]))
        white = knn_accuracy(F.normalize(whitening(xtr), dim=1), ytr, F.normalize(whitening(xte), dim=1), yte)
        return round(100 * white, 2)

    def with_mirrors(model, xtr, xte, size: int) -> tuple:
        """``model``'s features of the mirrors added to ``xtr`` / ``xte`` (its features of the images), normalised:
        what MirrorAveraged embeds."""
        return tuple(
            F.normalize(x + embed_files(Mirrored(model), paths, size, batch_size=512), dim=1)
            for x, paths in ((xtr, train.paths), (xte, test.paths))
        )

    def readouts(backbone, size: int) -> dict:
        """k-NN top-1 of ``backbone``'s features at ``size``: plain, whitened, and with ``mirror`` mirror-averaged."""
        xtr = embed_files(backbone, train.paths, size, batch_size=512)
        xte = embed_files(backbone, test.paths, size, batch_size=512)
        got = {"plain": round(100 * knn_accuracy(xtr, ytr, xte, yte), 2), "whitened": whitened(xtr, xte)}
        if mirror:
            got["whitened_mirror"] = whitened(*with_mirrors(backbone, xtr, xte, size))
        return got

    test_dir = data / "test" if (data / "test").is_dir() else data / "val"
    train, test, _ = load_labeled_pair(data / "train", test_dir)
    ytr, yte = torch.as_tensor(train.labels), torch.as_tensor(test.labels)
    doc = json.loads(out.read_text()) if out.exists() else {"benchmark": "embedding_size", "rows": []}
    doc.update(machine=machine(), protocol=__doc__.split("\n\n")[1].replace("\n", " "))
    for model in models:
        row = {"model": model, "data": str(data), "command": "python " + " ".join(sys.argv), "by_size": {}}
        for size in sizes:
            tic = time.perf_counter()
            backbone, trained = backbone_at(model, size, train.paths)
            row.update(trained)
            got = readouts(backbone, size)
            if mirror and layer3:  # layer4 is embedded again here, beside layer3: a second pass, for this option only
                both = Layers34(backbone)
                xtr = embed_files(both, train.paths, size, batch_size=512)
                xte = embed_files(both, test.paths, size, batch_size=512)
                got["whitened_mirror_layer34"] = whitened(*with_mirrors(both, xtr, xte, size))
            if refit_bn and trained:  # the same checkpoint with BN statistics fitted at this size, as random BN's
                got["refit_bn"] = readouts(fit_bn(backbone, size, train.paths), size)
            row["by_size"][str(size)] = {**got, "seconds": round(time.perf_counter() - tic, 1)}
            print(data.name, model, size, row["by_size"][str(size)], flush=True)
        doc["rows"].append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")


def _label(data: str) -> str:
    """A collection's name: its folder's, with the parent's where the folder is a generic ``data``."""
    path = Path(data)
    return f"{path.parent.name}/{path.name}" if path.name == "data" else path.name


def summary(docs: list[dict]) -> list[dict]:
    """Mean and sd of the whitened top-1 per collection, model kind (trained / random BN / random) and size."""
    groups: dict[tuple[str, str, int], list[float]] = {}
    for doc in docs:
        for row in doc["rows"]:
            kind = model_kind(row["model"])
            for size, got in row["by_size"].items():
                groups.setdefault((_label(row["data"]), kind, int(size)), []).append(got["whitened"])
                if "refit_bn" in got:
                    groups.setdefault((_label(row["data"]), kind + "_refit_bn", int(size)), []).append(
                        got["refit_bn"]["whitened"]
                    )
                for key, suffix in (("whitened_mirror", "_mirror"), ("whitened_mirror_layer34", "_mirror_layer34")):
                    if key in got:  # --mirror (--layer3): those readouts, each its own line
                        groups.setdefault((_label(row["data"]), kind + suffix, int(size)), []).append(got[key])
                    if key in got.get("refit_bn", {}):  # --refit-bn: the same readouts after the refit
                        group = (_label(row["data"]), kind + "_refit_bn" + suffix, int(size))
                        groups.setdefault(group, []).append(got["refit_bn"][key])
    return [
        {
            "data": data,
            "model": kind,
            "size": size,
            "whitened_mean": round(statistics.mean(v), 2),
            "sd": round(statistics.stdev(v), 2) if len(v) > 1 else None,
            "models": len(v),
        }
        for (data, kind, size), v in sorted(groups.items())
    ]


def plot(rows: list[dict], png: Path) -> None:
    """Whitened k-NN top-1 against the embedding size, a panel per collection: trained (solid), random BN
    (dashed) and random weights as built (dotted), mean of the models, with their sd as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collections = sorted({r["data"] for r in rows})
    fig, axes = plt.subplots(1, len(collections), figsize=(3.6 * len(collections), 3.4), squeeze=False)
    for ax, data in zip(axes[0], collections):
        for kind, style in (
            ("trained", "o-"),
            ("random_bn", "s--"),
            ("trained_mirror", "^-"),
            ("random_bn_mirror", "v--"),
            ("trained_mirror_layer34", "D-"),
            ("random_bn_mirror_layer34", "d--"),
            ("random", "x:"),
            ("random_mirror", "+:"),
            ("random_mirror_layer34", "1:"),
        ):
            pts = sorted(
                (r["size"], r["whitened_mean"], r["sd"] or 0) for r in rows if (r["data"], r["model"]) == (data, kind)
            )
            if pts:
                ax.errorbar(
                    [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], fmt=style, label=kind, capsize=2
                )
        ax.set_title(data.replace("_split", ""), fontsize=9)
        ax.set_xlabel("embedding size, px (trained at 32)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("k-NN top-1, whitened (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _epoch(row: dict) -> int | None:
    """The epochs a trained row's model had run: recorded, or in a ``checkpoint_NNNN.pt`` name."""
    if "epoch" in row:
        return row["epoch"]
    found = re.search(r"checkpoint_(\d+)\.pt$", row["model"])
    return int(found.group(1)) if found else None


def plot_curves(docs: list[dict], png: Path) -> None:
    """The mirror-averaged whitened top-1 of each run's checkpoints against its epochs, a panel per collection,
    with each random line's mean +- sd (the ``random_bn:`` and ``random:`` rows) as a band: how soon a run reaches
    its final readout, and whether it ends above random weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, dict[str, list]] = {}
    randoms: dict[tuple[str, str], list[float]] = {}  # (collection, kind) -> readouts
    for row in (row for doc in docs for row in doc["rows"]):
        got = next(iter(row["by_size"].values()))
        if "whitened_mirror" not in got:
            continue
        data = _label(row["data"])
        if model_kind(row["model"]) != "trained":
            randoms.setdefault((data, model_kind(row["model"])), []).append(got["whitened_mirror"])
        elif _epoch(row) is not None:
            run = str(Path(row["model"]).parent if row["model"].endswith(".pt") else Path(row["model"]))
            runs.setdefault(data, {}).setdefault(run, []).append((_epoch(row), got["whitened_mirror"]))
    collections = sorted(set(runs) | {data for data, _ in randoms})  # a panel for random lines alone too
    fig, axes = plt.subplots(1, len(collections), figsize=(3.6 * len(collections), 3.4), squeeze=False)
    for ax, data in zip(axes[0], collections):
        for run, points in sorted(runs.get(data, {}).items()):
            points.sort()
            ax.plot([e for e, _ in points], [a for _, a in points], "o-", ms=3, label=Path(run).name)
        for kind, colour, name in (("random_bn", "grey", "random BN"), ("random", "tab:brown", "random, BN as built")):
            if (data, kind) in randoms:
                got = randoms[data, kind]
                mean, sd = statistics.mean(got), statistics.stdev(got) if len(got) > 1 else 0.0
                ax.axhspan(mean - sd, mean + sd, color=colour, alpha=0.2)
                ax.axhline(mean, color=colour, ls="--", label=f"{name} ({len(got)})")
        ax.set_title(data.replace("_split", ""), fontsize=9)
        ax.set_xlabel("epochs trained")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("k-NN top-1, whitened, mirror (%)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="*", help="run dirs, checkpoints, random_bn:ARCH:STEM:SEED or random:ARCH:STEM:SEED")
    p.add_argument("--data", type=Path, help="a labeled split: train/<class>/... and val/ or test/<class>/...")
    p.add_argument("--sizes", default="32,48,64", help="embedding sizes in px, comma-separated")
    p.add_argument("--out", type=Path, help="results JSON (rows are appended)")
    p.add_argument("--mirror", action="store_true", help="also measure the mirror-averaged readout (whitened_mirror)")
    p.add_argument("--layer3", action="store_true", help="with --mirror: also layer3 beside layer4 (ResNets)")
    p.add_argument(
        "--refit-bn", action="store_true", help="trained models: also with BN statistics fitted at each size (refit_bn)"
    )
    p.add_argument("--summary", nargs="+", type=Path, metavar="JSON", help="print the means of these and plot them")
    p.add_argument("--curve", nargs="+", type=Path, metavar="JSON", help="plot checkpoints' readout by epoch (--png)")
    p.add_argument("--png", type=Path, help="with --summary or --curve: the plot")
    args = p.parse_args()
    if args.curve:
        if not args.png:
            p.error("--curve needs --png")
        plot_curves([json.loads(f.read_text()) for f in args.curve], args.png)
        print(f"wrote {args.png}")
        return
    if args.summary:
        rows = summary([json.loads(f.read_text()) for f in args.summary])
        for row in rows:
            print(json.dumps(row))
        if args.png:
            plot(rows, args.png)
            print(f"wrote {args.png}")
        return
    if not (args.data and args.models and args.out):
        p.error("--data, MODELS and --out are required (or --summary JSON...)")
    if args.layer3 and not args.mirror:
        p.error("--layer3 measures the mirror-averaged readout: add --mirror")
    import torch

    torch.set_num_threads(2)
    sizes = [int(s) for s in args.sizes.split(",")]
    measure(args.data, args.models, sizes, args.out, args.mirror, args.layer3, args.refit_bn)


if __name__ == "__main__":
    main()
