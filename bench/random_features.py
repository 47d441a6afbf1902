"""What a ResNet-18 sees before any training: k-NN top-1 of randomly initialised features, by stem and by layer.

Issue 20 asks whether the resolution the network sees holds back learning on small images: at 32 px the
ImageNet stem leaves a 1x1 map at layer4, ``nopool`` a 2x2 one and ``small`` a 4x4 one. This measures the
starting point of each (no weights trained, BatchNorm statistics fitted to the k-NN bank's evaluation crops with
``torch.optim.swa_utils.update_bn``, as ``bench/learning_curves.py``'s ``random_bn`` baseline), read at the
global average pool of layer2, layer3, layer4, and of layer3 and layer4 concatenated (each L2-normalised
first). The k-NN is the monitor's (:class:`trainer.monitor.KnnMonitor`: ``val/`` classified against ``train/``,
at most 5,000 images each, k = 20, temperature 0.07).

    python bench/random_features.py --data /work/datasets/fashion_mnist_split --sizes 32 \\
        --stems imagenet nopool small --out bench/results/random_features_fmnist.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from moco_retrieval.trainer.backbones import build_resnet  # noqa: E402
from moco_retrieval.trainer.knn import knn_accuracy  # noqa: E402
from moco_retrieval.trainer.monitor import KnnMonitor  # noqa: E402

LAYERS = ("layer2", "layer3", "layer4")


@torch.no_grad()
def pooled_layers(backbone: torch.nn.Module, batches) -> dict[str, torch.Tensor]:
    """``{layer: [N, C] global-average-pooled outputs}`` of ``backbone`` (eval mode) over the input batches."""
    pooled: dict[str, list[torch.Tensor]] = {name: [] for name in LAYERS}
    hooks = [
        getattr(backbone, name).register_forward_hook(
            lambda _m, _i, out, name=name: pooled[name].append(F.adaptive_avg_pool2d(out, 1).flatten(1))
        )
        for name in LAYERS
    ]
    try:
        for x in batches:
            backbone(x)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(parts) for name, parts in pooled.items()}


def measure(monitor: KnnMonitor, stem: str, seed: int) -> dict[str, float]:
    """k-NN top-1 per layer (and layer3+layer4) of a random ResNet-18 with ``stem``, BN statistics fitted."""
    from torch.optim.swa_utils import update_bn

    cpu = torch.device("cpu")
    torch.manual_seed(seed)
    backbone, _ = build_resnet("resnet18", stem)
    with torch.no_grad():  # a batch of one has no batch statistics
        update_bn((x for x in monitor.inputs(monitor.splits[0], cpu) if len(x) > 1), backbone)
    backbone.eval()
    bank, queries = (pooled_layers(backbone, monitor.inputs(split, cpu)) for split in monitor.splits)
    for feats in (bank, queries):
        feats["layer3+layer4"] = torch.cat(
            [F.normalize(feats["layer3"], dim=1), F.normalize(feats["layer4"], dim=1)], 1
        )
    train_labels, val_labels = (split.labels for split in monitor.splits)
    return {
        name: round(
            knn_accuracy(
                F.normalize(bank[name], dim=1),
                train_labels,
                F.normalize(queries[name], dim=1),
                val_labels,
                k=monitor.k,
                temperature=monitor.temperature,
            ),
            4,
        )
        for name in bank
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a folder split into train/<class>/... and val/<class>/...")
    p.add_argument("--sizes", type=int, nargs="+", default=[32], help="input sizes in pixels")
    p.add_argument("--stems", nargs="+", default=["imagenet", "nopool", "small"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="bench/results/random_features.json")
    args = p.parse_args()
    rows = []
    for size in args.sizes:
        monitor = KnnMonitor(args.data, size)
        if len(monitor.splits) != 2:
            raise SystemExit(f"{args.data} needs train/ and val/ subfolders")
        for stem in args.stems:
            for seed in args.seeds:
                start = time.perf_counter()
                row = {"size": size, "stem": stem, "seed": seed, "knn": measure(monitor, stem, seed)}
                row["seconds"] = round(time.perf_counter() - start, 1)
                print(row, flush=True)
                rows.append(row)
    result = {
        "benchmark": "random_features",
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "data": args.data,
        "protocol": "random ResNet-18, BN statistics fitted to the bank; monitor k-NN (k 20, T 0.07, <=5,000 each)",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
