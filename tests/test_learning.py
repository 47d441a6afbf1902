"""MoCo learns with the auto recipe: 75 to 1,600 CPU steps on the generated demo data, and the
weighted k-NN accuracy of the trained backbone is clearly above the same backbone at random initialisation (the
step-0 point).

Each run leaves everything but the model and its length to ``--recipe auto`` (the default), whose values come
from the learning curves in ``bench/results/learning_curves_*``: for MoCo v2 on a CPU the real-collection recipe
(batch 256, lr 0.06, the longest queue the images allow), for v3 a high learning rate for small batches; T 0.2, a
key momentum following the run's length, a short warm-up for v3. Features
first get *worse* than random ones (the dip); the schedule's cosine has to take the run past it.

The three runs are real ``moco train`` processes started together, one thread each, so each run's arithmetic
does not depend on the machine's core count. The k-NN figures in each test were measured so (v2 and the ViT on a
CPU with native bf16, in bf16, then the default there; the v3 ResNet in fp32 and in bf16: 800 steps ended inside
the dip on an AVX-512 CPU, 1,200 on an EPYC). CPUs now train in fp32 unless --amp, as AVX2 CPUs always did;
training is deterministic on a given CPU, and the asserted margin of 6 points leaves room for another CPU's
rounding. On a CPU the auto
recipe picks the ImageNet stem, about 9x cheaper per image than the small one at 32 px, so these runs take
more steps than the small-stem runs they replaced in less time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moco_retrieval.trainer.demo_data import write_demo_dataset

# the module fixture trains for ~9 minutes on two cores: above the suite's 900 s per-test limit on a slower machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--image-size", "32", "--workers", "0", "--device", "cpu", "--seed", "0", "--save-every", "1000"]
# name: (epochs, steps that makes, options); on a CPU the auto recipe picks batch 256 for MoCo v2 (6 steps per epoch
# of 1,600 images), 32 for MoCo v3
RECIPES = {
    "v2_resnet18": (64, 384, ["--moco-version", "2", "--arch", "resnet18"]),
    # 1,600 steps: a run of 800 ends in or just past the dip, by CPU, and one of 1,200 did on an EPYC (see the test)
    "v3_resnet18": (32, 1600, ["--moco-version", "3", "--arch", "resnet18"]),
    "v3_vit_tiny": (3, 75, ["--moco-version", "3", "--arch", "vit_tiny", "--patch-size", "8", "--batch-size", "64"]),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    """Train every recipe at once on 1,600 labeled 32 px demo images (8 classes, also the leave-one-out k-NN
    set); per recipe: return code, the log, and k-NN top-1 by epoch."""
    root = tmp_path_factory.mktemp("learning")
    data = write_demo_dataset(root / "data", per_class=200, size=32, seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    runs = {}
    for name, (epochs, _, options) in RECIPES.items():
        log = open(root / f"{name}.log", "w")
        cmd = [
            sys.executable,
            "-m",
            "moco_retrieval",
            "train",
            str(data),
            "--out",
            str(root / name),
            *COMMON,
            *options,
            "--epochs",
            str(epochs),
            "--knn-every",
            str(epochs),
        ]
        runs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log)
    results = {}
    for name, (proc, log) in runs.items():
        returncode = proc.wait(timeout=1800)
        log.close()
        metrics = root / name / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        results[name] = {
            "returncode": returncode,
            "log": (root / f"{name}.log").read_text()[-3000:],
            "knn": {r["epoch"]: r["knn_acc"] for r in rows if r["kind"] == "epoch" and r.get("knn_acc") is not None},
            "steps": max((r["step"] for r in rows), default=0),
            "run_dir": root / name,
        }
    return results


def check_learned(trained: dict, name: str) -> None:
    epochs, steps, _ = RECIPES[name]
    result = trained[name]
    assert result["returncode"] == 0, result["log"]
    knn = result["knn"]
    print(f"{name}: k-NN top-1 {knn[0]:.3f} at random init, {knn[epochs]:.3f} after {result['steps']} steps")
    assert result["steps"] == steps
    assert knn[epochs] >= knn[0] + 0.06, knn
    config = json.loads((result["run_dir"] / "config.json").read_text())
    given = set(RECIPES[name][2])
    derived = {"lr", "temperature"} | ({"batch_size"} if "--batch-size" not in given else set())
    assert config["recipe"] == "auto" and derived <= set(config["derived"]), config["derived"]


def test_train_v2_resnet18__knn_accuracy_beats_random_init(trained):
    check_learned(trained, "v2_resnet18")  # measured: 49.6% -> 58.2% (batch 256; batch 32, 1,400 steps: 81.1%)


def test_train_v3_resnet18__knn_accuracy_beats_random_init(trained):
    # measured, one thread, from 49.6% at random init. 800-step runs: 66.1% (fp32, AVX2 EPYC), 54.8% (fp32) and
    # 53.5% (bf16 autocast, the default there) on an AVX-512 Xeon with native bf16: the end of the dip, by CPU.
    # 1,200-step runs on that Xeon: 77.5% (fp32), 63.6% (bf16); 1,600 steps, fp32 on AVX2: 78.4%. On another
    # AMD EPYC (2026-12-04) 1,200 steps ended at 52.7% (fp32, one thread: the margin missed by 3 points); with two
    # threads the same run was at 37.5 / 43.6 / 49.4 / 54.5 / 58.0% at epochs 3 / 9 / 12 / 15 / 21: a slow climb
    # out of a deep dip, so the run is now 1,600 steps
    check_learned(trained, "v3_resnet18")


def test_train_v3_vit_tiny__knn_accuracy_beats_random_init(trained):
    check_learned(trained, "v3_vit_tiny")  # measured: 44.1% -> 52.1%
