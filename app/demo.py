"""``moco demo``: the whole flow on the embedded default data (generated shapes), on this machine."""
from __future__ import annotations

from pathlib import Path

from trainer.config import TrainConfig
from trainer.demo_data import write_demo_dataset

DEMO_IMAGES_PER_CLASS = 100
DEMO_IMAGE_SIZE = 32


def demo_train_config(out: Path, epochs: int, device: str) -> TrainConfig:
    """A CPU-sized MoCo v2 run: ResNet-18 with the small stem at 32 px, batch 128, queue 1024."""
    return TrainConfig(
        data_dir=str(out / "data"), out_dir=str(out / "run"), arch="resnet18", image_size=DEMO_IMAGE_SIZE,
        epochs=epochs, batch_size=128, lr=0.06, queue_size=1024, momentum=0.99, workers=2, device=device,
        knn_every=max(1, epochs // 5), save_every=max(1, epochs),
    )


def run_demo(out: str | Path, epochs: int = 10, device: str = "auto") -> None:
    from trainer.train import train

    out = Path(out)
    data = write_demo_dataset(out / "data", per_class=DEMO_IMAGES_PER_CLASS, size=DEMO_IMAGE_SIZE * 2)
    print(f"demo images: {data} (8 shape classes x {DEMO_IMAGES_PER_CLASS})")
    result = train(demo_train_config(out, epochs, device))
    first = _first_knn(result.run_dir)
    print(f"k-NN top-1 before training: {100 * first:.1f}%" if first is not None else "")
    print(f"k-NN top-1 after {result.epochs_done} epochs: {100 * result.knn_acc:.1f}%" if result.knn_acc is not None else "")
    print(f"run directory: {result.run_dir} (metrics.png shows the curves)")


def _first_knn(run_dir: Path) -> float | None:
    from trainer.plots import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "epoch" and r.get("epoch") == 0]
    return rows[0]["knn_acc"] if rows else None
