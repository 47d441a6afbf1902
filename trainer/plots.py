"""The training plot: loss per step and k-NN accuracy per epoch, read back from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from moco_retrieval.contracts.atomic import atomic_path, output_errors


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Draw loss (left axis, by step) and k-NN top-1 accuracy, plain and whitened (right axis, by epoch), into
    ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "step"]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    knn = [(r["step"], 100 * r["knn_acc"]) for r in epochs if r.get("knn_acc") is not None]
    whitened = [(r["step"], 100 * r["knn_acc_whitened"]) for r in epochs if r.get("knn_acc_whitened") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if steps:
        ax.plot(*zip(*steps), color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("InfoNCE loss", color="tab:blue")
    if knn:
        ax2 = ax.twinx()
        ax2.plot(*zip(*knn), "o-", color="tab:orange", label="k-NN top-1")
        if whitened:
            ax2.plot(*zip(*whitened), "s--", color="tab:red", label="k-NN top-1, whitened (as exported)")
        ax2.legend(loc="lower right")
        ax2.set_ylabel("k-NN top-1 accuracy (%)", color="tab:orange")
    ax.set_title("MoCo training")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(out_png, hint="free some space or choose another --out") as tmp, output_errors(out_png):
            fig.savefig(tmp, format="png")  # a full disk is one line, and never leaves half a plot
    finally:
        plt.close(fig)
    return Path(out_png)
