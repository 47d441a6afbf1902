"""Learning curves: k-NN top-1 against wall-clock minutes of ``moco train --time-budget``, per recipe and data set.

Each (data set, recipe) pair is one real ``moco train`` run in its own process, one after another (a curve
against wall-clock time is only worth something measured alone: ``--lock`` takes an exclusive ``flock`` per
run so other work on the machine can wait its turn). The monitor's k-NN accuracy (leave-one-out on a labeled
folder, or ``train/`` as the memory bank and ``val/`` classified) is read back from ``metrics.jsonl`` with the
budget clock's ``elapsed_s``; the point at 0 minutes is the randomly initialised network. Writes a JSON of every
curve and a plot beside it (same name, ``.png``), one panel per data set.

    python bench/learning_curves.py --datasets demo tuxpaint=/work/datasets/tuxpaint_split \\
        icons=/work/datasets/icons_split --recipes auto_v2 paper_v2 auto_v3 --budget 150s \\
        --lock /tmp/moco-cpu.lock --out bench/results/learning_curves_cpu_budget.json

A data set is ``demo`` (the generated demo images, 8 classes x 200 at 64 px, as ``moco demo`` makes them) or
``name=FOLDER``: a labeled folder (``FOLDER/<class>/...``), or one split into ``train/`` and ``val/`` (training
on ``train/`` only, the monitor classifying ``val/`` against ``train/``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

COMMON = ["--arch", "resnet18", "--image-size", "32", "--seed", "0", "--log-every", "10", "--save-every", "1000"]
RECIPES: dict[str, list[str]] = {
    "auto_v2": ["--moco-version", "2"],  # the default: MoCo v2, --recipe auto
    "auto_v2_fp32": ["--moco-version", "2", "--no-amp"],  # the same in float32, to compare bf16 with
    "paper_v2": ["--moco-version", "2", "--recipe", "paper", "--stem", "imagenet"],  # the papers' values
    "auto_v3": ["--moco-version", "3"],
    "paper_v3": ["--moco-version", "3", "--recipe", "paper", "--stem", "imagenet"],
    "auto_v3_vit": ["--moco-version", "3", "--arch", "vit_tiny", "--patch-size", "8"],
}


def read_curve(metrics: Path) -> dict:
    """``{"knn": [[minutes, acc], ...], "steps": [[minutes, step], ...]}`` from a run's ``metrics.jsonl``."""
    knn, steps = [], []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut off when the run was stopped
                continue
            minutes = (row.get("elapsed_s") or 0.0) / 60
            if row.get("kind") == "epoch" and row.get("knn_acc") is not None:
                knn.append([round(minutes, 4), row["knn_acc"]])
            if row.get("kind") == "step":
                steps.append([round(minutes, 4), row["step"]])
    return {"knn": knn, "steps": steps}


def dataset_folders(spec: str, work: Path) -> tuple[str, Path, Path]:
    """``(name, training folder, k-NN folder)`` of a ``--datasets`` entry."""
    if spec == "demo":
        from trainer.demo_data import write_demo_dataset

        folder = write_demo_dataset(work / "demo-data", per_class=200, size=64, seed=0)
        return "demo", folder, folder
    name, _, folder = spec.partition("=")
    folder = Path(folder)
    if not folder.is_dir():
        raise SystemExit(f"--datasets {spec}: {folder} is not a folder")
    train = folder / "train" if (folder / "train").is_dir() and (folder / "val").is_dir() else folder
    return name, train, folder


def run_one(name: str, recipe: str, train: Path, knn: Path, work: Path, budget: str, extra: list[str],
            lock: str | None) -> dict:
    out = work / f"{name}-{recipe}"
    args = [*COMMON, *RECIPES[recipe], "--time-budget", budget, "--knn-dir", str(knn), *extra]
    cmd = [sys.executable, "-m", "app.cli", "train", str(train), "--out", str(out), *args]
    if lock:
        cmd = ["flock", "-x", lock, *cmd]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tic = time.perf_counter()
    with open(work / f"{name}-{recipe}.log", "w") as log:
        returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    result = {"args": args, "returncode": returncode, "wall_seconds": time.perf_counter() - tic,
              "derived": {k: v["value"] for k, v in config.get("derived", {}).items()}, **read_curve(out / "metrics.jsonl")}
    print(f"{name} {recipe}: rc {returncode}, k-NN {[(m, round(a, 3)) for m, a in result['knn']]}", flush=True)
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["datasets"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        runs = report["datasets"][name]["runs"]
        initial = []
        for recipe, res in runs.items():
            if res["knn"]:
                minutes, accs = zip(*res["knn"])
                ax.plot(minutes, [100 * a for a in accs], marker="o", markersize=3, label=recipe,
                        linestyle="--" if recipe.startswith("paper") else "-")
                initial.append(100 * res["knn"][0][1])
        if initial:
            ax.axhline(sum(initial) / len(initial), color="grey", linestyle=":", linewidth=1.2,
                       label="random init")
        ax.set_title(f"{name} ({report['datasets'][name]['images']} training images)")
        ax.set_xlabel(f"minutes of training (--time-budget {report['budget']}, 2 CPU cores)")
        ax.set_ylabel("k-NN top-1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("MoCo learning curves, ResNet-18 at 32 px: --recipe auto against the papers' values")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["demo"], metavar="demo|NAME=FOLDER")
    p.add_argument("--recipes", nargs="+", default=["auto_v2", "paper_v2"], choices=list(RECIPES), metavar="NAME",
                   help=f"recipes to run (from: {', '.join(RECIPES)})")
    p.add_argument("--budget", default="150s", help="--time-budget of every run")
    p.add_argument("--extra", default="", help="more `moco train` options for every run, e.g. --extra=--device=cuda")
    p.add_argument("--lock", default=None, help="take this file's exclusive flock around each run")
    p.add_argument("--work", default=None, help="folder for the data and run directories (default: beside --out)")
    p.add_argument("--out", default="bench/results/learning_curves_budget.json")
    args = p.parse_args(argv)

    from contracts.images import walk_image_files

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "learning_curves", "host": platform.node(), "cpu_count": os.cpu_count(),
              "budget": args.budget, "common_args": COMMON, "extra_args": args.extra.split(), "command":
              " ".join(sys.argv), "datasets": {}}
    for spec in args.datasets:
        name, train, knn = dataset_folders(spec, work)
        entry = report["datasets"][name] = {"train": str(train), "knn": str(knn), "runs": {},
                                            "images": len(walk_image_files(train))}
        for recipe in args.recipes:
            entry["runs"][recipe] = run_one(name, recipe, train, knn, work, args.budget, args.extra.split(), args.lock)
            out.write_text(json.dumps(report, indent=1) + "\n")  # partial results survive an interruption
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
