"""``moco demo``: the whole flow on the embedded default data (generated pattern images), on this machine.

Generate 1,600 labeled images (8 pattern classes), train MoCo v2 ResNet-18 with the auto recipe for a fixed
number of steps (or a time budget), report the k-NN accuracy of the trained network against the same network at random
initialisation, export it to ONNX, index the images and serve them.
"""

from __future__ import annotations

from pathlib import Path

from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.demo_data import write_demo_dataset

DEMO_IMAGES_PER_CLASS = 200
DEMO_IMAGE_SIZE = 32
# A fixed length, not a time budget: where a short run ends on its curve depends steeply on its step count (on
# 2 CPU cores a 150 s budget made 1,340 steps and 73.2% in one run, 1,130 steps and 56.7% in another), so the
# demo trains a fixed number of steps and shows the same result on every machine of a kind, only slower or faster.
DEMO_EPOCHS = 96
DEMO_STEPS = DEMO_EPOCHS * 6  # at the auto batch of 256 (MoCo v2 on a CPU): 6 steps an epoch of 1,600 images


def demo_train_config(out: Path, budget: str | None, device: str, epochs: int = DEMO_EPOCHS) -> TrainConfig:
    """A CPU-sized MoCo v2 run: ResNet-18 at 32 px, everything else from the auto recipe, for ``epochs`` (or for
    ``budget`` when one is given)."""
    return TrainConfig(
        data_dir=str(out / "data"),
        out_dir=str(out / "run"),
        arch="resnet18",
        image_size=DEMO_IMAGE_SIZE,
        time_budget=budget,
        epochs=None if budget else epochs,
        workers=2,
        device=device,
        save_every=10**6,
    )


def run_demo(
    out: str | Path,
    budget: str | None = None,
    device: str = "auto",
    serve: bool = True,
    host: str = "127.0.0.1",
    port: int = 7860,
) -> None:
    from moco_retrieval.trainer.train import train

    out = Path(out)
    cfg = demo_train_config(out, budget, device)  # a bad --time-budget fails here, before any work
    data = write_demo_dataset(out / "data", per_class=DEMO_IMAGES_PER_CLASS, size=DEMO_IMAGE_SIZE * 2)
    print(f"demo images: {data} (8 pattern classes x {DEMO_IMAGES_PER_CLASS})", flush=True)
    result = train(cfg)
    print(knn_report(result), flush=True)
    print(f"run directory: {result.run_dir} (metrics.png shows the curves, config.json the recipe and why)")
    encoder = export_demo_encoder(result.run_dir, out)
    print(f"encoder: {encoder} (ONNX, checked against PyTorch)")
    index_demo_images(data, encoder, out / "index", device)
    if serve:
        serve_demo_index(out / "index", device, host, port)
    else:
        print(f"to search it: moco serve {out / 'index'}")


def knn_report(result) -> str:
    """What the demo learned, in words: k-NN top-1 before and after, and what the numbers mean."""
    if result.knn_acc is None or result.knn_before is None:
        return f"trained {result.steps} steps"
    gain = 100 * (result.knn_acc - result.knn_before)
    return (
        f"k-NN top-1 at random init: {100 * result.knn_before:.1f}%; after {result.steps} steps "
        f"({result.epochs_done} epochs): {100 * result.knn_acc:.1f}% ({gain:+.1f} points)\n"
        "(each demo image is classified by a vote of its 20 most similar other images in the network's "
        "embedding space; 12.5% is chance over 8 classes, and a random network already scores about 50% "
        "on colour and brightness alone: the gain is what self-supervised training added)"
    )


def export_demo_encoder(run_dir: Path, out: Path) -> Path:
    """Export the demo run's encoder to ``out/encoder.onnx`` (verified); returns the file."""
    from moco_retrieval.trainer.export import export_encoder

    return export_encoder(run_dir, out / "encoder.onnx").path


def index_demo_images(data: Path, encoder: Path, index_dir: Path, device: str) -> None:
    """Index the demo images with the exported encoder into ``index_dir`` and print the summary table.

    Always a rebuild: every demo run exports a new encoder file (another sha256), which an update refuses.
    """
    from moco_retrieval.app.cmd_index import print_index_result
    from moco_retrieval.indexer.build import IndexConfig, build_index_dir

    device = "cuda" if device.startswith("cuda") else device
    print_index_result(
        build_index_dir(IndexConfig(str(data), str(encoder), str(index_dir), device=device, rebuild=True))
    )


def serve_demo_index(index_dir: Path, device: str, host: str, port: int) -> None:
    """The last step: serve the demo index (web app + JSON API) until Ctrl-C; prints the URL."""
    from moco_retrieval.app.server import check_port, serve_forever
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    check_port(host, port)
    with SearchEngine(index_dir, EngineConfig(device=device)) as engine:
        serve_forever(engine, host, port)
