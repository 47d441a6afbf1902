"""What the scale benchmarks (``bench/index_scale.py``, ``bench/serve_scale.py``) share: the synthetic vectors
of their corpus and the JSON file their rows go to (one module both import, so neither imports the other)."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results"
DIM = 512
CHUNK = 65_536  # vectors generated together (one seed per chunk)
CLUSTERS = 1000
SPREAD = 0.6


def chunk_vectors(chunk: int, d: int = DIM, seed: int = 0) -> np.ndarray:
    """float32 ``[CHUNK, d]`` L2-normalized rows of chunk ``chunk``: Gaussian blobs around fixed centres (the
    shape of real embeddings, as in ``bench/faiss_indexes.py``)."""
    centres = np.random.default_rng(12345).normal(size=(CLUSTERS, d)).astype(np.float32)
    rng = np.random.default_rng([seed, chunk])
    x = centres[rng.integers(0, CLUSTERS, CHUNK)]
    x += SPREAD * rng.standard_normal(size=(CHUNK, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def record(args, phase: str, row: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = (
        json.loads(out.read_text())
        if out.is_file()
        else {
            "benchmark": "index_scale",
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": [],
        }
    )
    row = {"phase": phase, "label": args.label, "legacy": args.legacy, "command": " ".join(sys.argv), **row}
    data["rows"].append(row)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
