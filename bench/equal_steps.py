"""Recipe ablations at equal optimizer steps: k-NN top-1 of ``moco train`` variants on real collections, several
seeds, beside the raw-pixel and random-weight baselines (issue 20).

Why equal steps and not equal time: a change that costs nothing per step (the crop scale, the blur, the key
momentum, the lr) learns the same in N steps however busy the machine is, so the runs can share the cores (each
run one thread, ``--parallel`` at once) and still compare fairly. A change that costs compute (``--stem
nopool``) is compared at equal steps here and must then pay for its cost in images/s (``bench/train_throughput.py``).

Each run is ``moco train DATA/train --knn-dir DATA --epochs E`` with MoCo v2, ResNet-18 at 32 px and the auto
recipe, plus the variant's options; E per data set is chosen so that each run takes about as many steps as a
4-minute default run on 2 cores (about 200 at batch 256). The monitor classifies ``val/`` against ``train/``
(at most 5,000 images each, evenly spread). Baselines per data set (``learning_curves.random_baselines``): the
random network, the same with BatchNorm statistics fitted, and L2 k-NN on the raw pixels (best k of 1/5/20).

    python bench/equal_steps.py --data tuxpaint=/work/datasets/tuxpaint_split:100 \\
        icons=/work/datasets/icons_split:50 openclipart=/work/datasets/openclipart_split:12 \\
        fashion_mnist=/work/datasets/fashion_mnist_split:1 \\
        --variant c20= nb=--no-blur c50="--crop-min-scale 0.5" np="--stem nopool" m999="--momentum 0.999" \\
        --seeds 0 1 --work /tmp/exp/runs --out bench/results/equal_steps_cpu.json

A finished run (its ``DONE`` marker) is not run again, so the same command resumes an interrupted ablation and
summarizes what is there (``--summarize-only`` runs nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

COMMON = ["--arch", "resnet18", "--image-size", "32", "--moco-version", "2", "--device", "cpu", "--workers", "1"]
COMMON += ["--save-every", "1000", "--log-every", "10"]


def run_dir(work: Path, name: str, tag: str, seed: int) -> Path:
    return work / f"{name}-{tag}-s{seed}"


def train_one(work: Path, name: str, folder: Path, epochs: int, tag: str, options: list[str], seed: int) -> None:
    out = run_dir(work, name, tag, seed)
    if (out / "DONE").exists():
        return
    cmd = [sys.executable, "-m", "moco_retrieval", "train", str(folder / "train"), "--out", str(out), *COMMON]
    cmd += ["--seed", str(seed), "--epochs", str(epochs), "--knn-every", str(max(1, (epochs + 4) // 5))]
    cmd += ["--knn-dir", str(folder), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(f"{out}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if rc == 0:
        (out / "DONE").touch()
    print(f"{name} {tag} seed {seed}: rc {rc}", flush=True)


def read_run(out: Path) -> dict | None:
    if not (out / "DONE").exists():
        return None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    knn = [[r["epoch"], r["knn_acc"]] for r in rows if r["kind"] == "epoch" and r.get("knn_acc") is not None]
    config = json.loads((out / "config.json").read_text())
    return {
        "steps": max(r["step"] for r in rows if "step" in r),
        "knn": knn,
        "final": knn[-1][1],
        "derived": {k: v["value"] for k, v in config.get("derived", {}).items()},
    }


def summarize(data: dict, variants: dict, seeds: list[int], work: Path, baselines: dict) -> dict:
    report = {"common": COMMON, "variants": variants, "seeds": seeds, "datasets": {}}
    for name, (folder, epochs) in data.items():
        entry = {"folder": str(folder), "epochs": epochs, "baselines": baselines.get(name), "variants": {}}
        for tag in variants:
            runs = {seed: read_run(run_dir(work, name, tag, seed)) for seed in seeds}
            finals = [r["final"] for r in runs.values() if r]
            entry["variants"][tag] = {
                "runs": {str(s): r for s, r in runs.items() if r},
                "mean": statistics.fmean(finals) if finals else None,
                "sd": statistics.stdev(finals) if len(finals) > 1 else None,
                "seeds": len(finals),
            }
        report["datasets"][name] = entry
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["datasets"])
    fig, axes = plt.subplots(1, len(names), figsize=(max(6.5, 4.2 * len(names)), 4.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        entry = report["datasets"][name]
        tags = [t for t, v in entry["variants"].items() if v["mean"] is not None]
        means = [100 * entry["variants"][t]["mean"] for t in tags]
        sds = [100 * (entry["variants"][t]["sd"] or 0) for t in tags]
        ax.bar(tags, means, yerr=sds, color="tab:blue", alpha=0.8, capsize=3)
        base = entry.get("baselines") or {}
        for key, style, text in (
            ("random", ":", "random init"),
            ("random_bn", "-.", "random, BN fitted"),
            ("pixels", "--", "raw pixels"),
        ):
            if base.get(key) is not None:
                value = base[key] if not isinstance(base[key], list) else statistics.fmean(base[key])
                ax.axhline(100 * value, color="grey", linestyle=style, label=f"{text}: {100 * value:.1f}%")
        low = min(means + [100 * (base.get("pixels") or 1)]) - 8 if means else 0
        ax.set_ylim(max(0, low), None)
        steps = sorted({run["steps"] for v in entry["variants"].values() for run in v["runs"].values()})
        ax.set_title(f"{name} ({entry['epochs']} epochs, {'/'.join(map(str, steps))} steps)")
        ax.set_ylabel("k-NN top-1 (%), mean ± sd over seeds")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("MoCo v2, ResNet-18 at 32 px, auto recipe: variants at equal steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, metavar="NAME=FOLDER:EPOCHS")
    p.add_argument("--variant", nargs="+", required=True, metavar='TAG="OPTIONS"')
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--parallel", type=int, default=2, help="runs at once, one thread each")
    p.add_argument("--work", type=Path, required=True, help="folder of the run directories")
    p.add_argument("--cache-dir", default=None, help="MOCO_CACHE_DIR of the runs")
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--baselines", type=Path, nargs="*", default=[], help="JSON files of baselines already measured")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "equal_steps_cpu.json")
    args = p.parse_args(argv)
    data = {}
    for spec in args.data:
        name, _, rest = spec.partition("=")
        folder, _, epochs = rest.rpartition(":")
        data[name] = (Path(folder), int(epochs))
    variants = {tag: shlex.split(opts) for tag, _, opts in (v.partition("=") for v in args.variant)}
    if args.cache_dir:
        os.environ["MOCO_CACHE_DIR"] = args.cache_dir
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.summarize_only:
        jobs = [
            (name, folder, epochs, tag, opts, seed)
            for seed in args.seeds
            for tag, opts in variants.items()
            for name, (folder, epochs) in data.items()
        ]
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda job: train_one(args.work, *job), jobs))
    from learning_curves import random_baselines

    baselines = {}
    for path in args.baselines:  # {name: random_baselines(...)}, as this script measures them
        baselines.update(json.loads(path.read_text()))
    for name, (folder, _) in data.items():
        if name not in baselines:
            baselines[name] = random_baselines(folder, args.seeds, args.cache_dir)
    report = summarize(data, {t: " ".join(o) for t, o in variants.items()}, args.seeds, args.work, baselines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
