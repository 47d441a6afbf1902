"""``moco demo``: the whole flow on the embedded default data (generated shapes), on this machine."""
from __future__ import annotations

from pathlib import Path

from trainer.config import TrainConfig
from trainer.demo_data import write_demo_dataset

DEMO_IMAGES_PER_CLASS = 100
DEMO_IMAGE_SIZE = 32


def demo_train_config(out: Path, epochs: int, device: str) -> TrainConfig:
    """A CPU-sized MoCo v2 run: ResNet-18 (ImageNet stem, the cheapest) at 32 px, batch 32, queue 256.

    About 250 steps at the default 10 epochs: minutes on two CPU cores, far too short to learn the pattern
    classes (see the k-NN figures it prints); it shows the whole flow, not a good model.
    """
    return TrainConfig(
        data_dir=str(out / "data"), out_dir=str(out / "run"), arch="resnet18", stem="imagenet",
        image_size=DEMO_IMAGE_SIZE, epochs=epochs, batch_size=32, lr=0.48, queue_size=256, momentum=0.99,
        workers=2, device=device, knn_every=max(1, epochs // 5), save_every=max(1, epochs),
    )


def run_demo(out: str | Path, epochs: int = 10, device: str = "auto", serve: bool = True, host: str = "127.0.0.1",
             port: int = 7860) -> None:
    from trainer.train import train

    out = Path(out)
    data = write_demo_dataset(out / "data", per_class=DEMO_IMAGES_PER_CLASS, size=DEMO_IMAGE_SIZE * 2)
    print(f"demo images: {data} (8 pattern classes x {DEMO_IMAGES_PER_CLASS})")
    result = train(demo_train_config(out, epochs, device))
    first = _first_knn(result.run_dir)
    print(f"k-NN top-1 before training: {100 * first:.1f}%" if first is not None else "")
    print(f"k-NN top-1 after {result.epochs_done} epochs: {100 * result.knn_acc:.1f}%" if result.knn_acc is not None else "")
    print(f"({result.steps} steps: enough to exercise the flow, not to learn; MoCo needs thousands of steps "
          f"before it beats random features, see README)")
    print(f"run directory: {result.run_dir} (metrics.png shows the curves)")
    encoder = export_demo_encoder(result.run_dir, out)
    print(f"encoder: {encoder} (ONNX, checked against PyTorch)")
    index_demo_images(data, encoder, out / "index", device)
    if serve:
        serve_demo_index(out / "index", device, host, port)
    else:
        print(f"to search it: moco serve {out / 'index'}")


def export_demo_encoder(run_dir: Path, out: Path) -> Path:
    """Export the demo run's encoder to ``out/encoder.onnx`` (verified); returns the file."""
    from trainer.export import export_encoder

    return export_encoder(run_dir, out / "encoder.onnx").path


def index_demo_images(data: Path, encoder: Path, index_dir: Path, device: str) -> None:
    """Index the demo images with the exported encoder into ``index_dir`` and print the summary table.

    Always a rebuild: every demo run exports a new encoder file (another sha256), which an update refuses.
    """
    from app.cmd_index import print_index_result
    from indexer.build import IndexConfig, build_index_dir

    device = "cuda" if device.startswith("cuda") else device
    print_index_result(build_index_dir(IndexConfig(str(data), str(encoder), str(index_dir), device=device,
                                                   rebuild=True)))


def serve_demo_index(index_dir: Path, device: str, host: str, port: int) -> None:
    """The last step: serve the demo index (web app + JSON API) until Ctrl-C; prints the URL."""
    from app.server import check_port, serve_forever
    from serve.engine import EngineConfig, SearchEngine

    check_port(host, port)
    with SearchEngine(index_dir, EngineConfig(device=device)) as engine:
        serve_forever(engine, host, port)


def _first_knn(run_dir: Path) -> float | None:
    from trainer.plots import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "epoch" and r.get("epoch") == 0]
    return rows[0]["knn_acc"] if rows else None
