"""Shared, real serving artifacts for the serve tests: a generated labeled corpus, an exported ONNX encoder
(random-init ResNet-18 at 32 px, written in the checkpoint format and exported), and a published index
directory built by the real ``moco index`` pipeline.

The corpus classes differ by colour (with noise, brightness changes and a random occluding rectangle), not
by shape: an untrained ResNet separates colours but not the demo's shapes (measured: a random-init encoder
gets 13-37% k-NN accuracy on the 8 shape classes, chance is 12.5%), and these tests check the engine, not
the model. The pytest fixtures over these live in :mod:`tests._serve_fixtures`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
CORPUS_PER_CLASS = 12
HELD_OUT_PER_CLASS = 4


def write_colour_corpus(root: Path, per_class: int, seed: int, size: int = 32) -> Path:
    """``root/<colour>/<colour>_NNN.png``: noisy images dominated by their class colour, each with a random
    rectangle of a random colour over up to a quarter of it."""
    rng = np.random.default_rng(seed)
    for name, rgb in COLOURS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = np.asarray(rgb, dtype=np.float64) * rng.uniform(0.7, 1.0) + rng.normal(0, 18, (size, size, 3))
            w, h = rng.integers(4, size // 2 + 1, size=2)
            x, y = rng.integers(0, size - w + 1), rng.integers(0, size - h + 1)
            img[y : y + h, x : x + w] = rng.uniform(0, 255, size=3)
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / name / f"{name}_{i:03d}.png")
    return root


def build_index(image_dir: Path, encoder: Path, out: Path):
    """Run the real indexing pipeline (``moco index``) in this process, without worker processes."""
    from moco_retrieval.indexer.build import IndexConfig, build_index_dir

    return build_index_dir(IndexConfig(str(image_dir), str(encoder), str(out), workers=0, progress=False, device="cpu"))


def build_index_in_subprocess(image_dir: Path, encoder: Path, out: Path) -> None:
    """Re-index as ``moco index`` does, in another process: py-lmdb cannot open a store twice in one process,
    and a serving engine of this process holds the live generation's store open."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from tests._serve_helpers import build_index; "
        "build_index(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(image_dir), str(encoder), str(out)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )


def export_random_encoder(out_dir: Path, seed: int = 0) -> Path:
    """A real encoder.onnx from a randomly initialised (untrained) tiny ResNet-18 checkpoint."""
    import torch

    from tests._checkpoints import write_checkpoint
    from moco_retrieval.trainer.export import export_encoder

    torch.set_num_threads(1)
    run = write_checkpoint(None, out_dir / f"run{seed}", seed=seed)
    path = out_dir / f"encoder{seed}.onnx"
    export_encoder(run, path, verify=False, image_size=32)  # the training size (serving tests need no more)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    """A real uvicorn server in a background thread of this process, on a free loopback port."""

    def __init__(self, app):
        import threading
        import time

        import uvicorn

        from moco_retrieval.app.http_protocol import uvicorn_options

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = uvicorn_options() | {"timeout_graceful_shutdown": 2}  # SSE streams of the UI stay open
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def serve_workers_process(index: Path, workers: int = 2, *options: str):
    """``moco serve INDEX --workers N`` as its own process on a free port, until the ``with`` block ends (then
    Ctrl-C, as a user stops it); yields its URL once the supervisor says every worker serves."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    @contextlib.contextmanager
    def running():
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moco_retrieval",
                "serve",
                str(index),
                "--port",
                str(port),
                "--workers",
                str(workers),
                "--device",
                "cpu",
                "--poll-seconds",
                "0",
                *options,
            ],
            cwd=Path(__file__).resolve().parents[1],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline()
            assert f"with {workers} workers" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    return running()
