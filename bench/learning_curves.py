"""Learning curves: k-NN top-1 accuracy against training steps for named MoCo recipes on the generated demo data.

Each recipe is one real ``moco train`` run in its own process, so several recipes can share one GPU (``--parallel``)
or run one after another on a CPU. Every run logs k-NN accuracy (leave-one-out on the 1,600 labeled demo images)
every ``--knn-every`` epochs; at ``--time-limit`` the runs still going are stopped and whatever they logged is kept.
Writes a JSON of every curve and a plot beside it (same name, ``.png``).

    # all recipes on one GPU, 10 at a time, fp32 like the CPU tests
    python bench/learning_curves.py --device cuda --parallel 10 --extra=--no-amp --out bench/results/learning_curves_gpu.json
    # one recipe on this CPU
    python bench/learning_curves.py --recipes v3_r18_lr4.8_t0.2 --device cpu --out /tmp/curves.json

The recipes share ``COMMON`` (32 px, batch 32, a 60-epoch schedule of 50 steps per epoch stopped at epoch 30):
a 1,500-step look at how soon each recipe's features beat the random-init baseline (the step-0 point). A recipe's
own options, then ``--extra``, come after ``COMMON`` on the command line, so they override it (argparse keeps the
last value). Results of the three GPU rounds and of the CPU runs are in ``bench/results/learning_curves_*``.
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

COMMON = ["--image-size", "32", "--batch-size", "32", "--epochs", "60", "--stop-at-epoch", "30", "--seed", "0", "--knn-every", "2",
          "--save-every", "1000", "--log-every", "10"]
R18 = ["--arch", "resnet18", "--stem", "imagenet"]
# the v2 recipe of tests/test_learning.py (50.5% -> 87.6% k-NN after 1,400 CPU steps); variants append overrides
V2 = ["--moco-version", "2", *R18, "--lr", "0.48", "--queue-size", "256", "--momentum", "0.99", "--temperature", "0.2",
      "--bn-splits", "2"]
V3_R18 = ["--moco-version", "3", *R18]
V3_R18_FAST = [*V3_R18, "--lr", "4.8", "--temperature", "0.2", "--warmup-epochs", "1"]  # the v3 ResNet test's recipe
VIT8 = ["--moco-version", "3", "--arch", "vit_tiny", "--patch-size", "8"]
VIT8_FAST = [*VIT8, "--lr", "3e-3", "--warmup-epochs", "1"]  # the ViT test's recipe (batch 64 there)
RECIPES: dict[str, list[str]] = {
    "v2_r18": V2,
    "v3_r18_paper": V3_R18,  # LARS lr 0.6 x 32/256, T 1.0
    "v3_r18_t0.2": [*V3_R18, "--temperature", "0.2"],
    "v3_r18_lr4.8": [*V3_R18, "--lr", "4.8"],
    "v3_r18_lr4.8_t0.2": [*V3_R18, "--lr", "4.8", "--temperature", "0.2"],
    "v3_r18_lr2.4_t0.5": [*V3_R18, "--lr", "2.4", "--temperature", "0.5"],
    "v3_vit8_paper": VIT8,  # AdamW lr 1.5e-4 x 32/256, T 0.2
    "v3_vit8_lr1.5e-3": [*VIT8, "--lr", "1.5e-3"],
    "v3_vit8_lr6e-3": [*VIT8, "--lr", "6e-3"],
    "v3_vit4_lr1.5e-3": [*VIT8, "--patch-size", "4", "--lr", "1.5e-3"],
    # second round: a one-epoch warm-up (50 steps instead of 300-400), to learn within fewer CPU steps
    "v2_r18_lr0.96": [*V2, "--lr", "0.96"],
    "v2_r18_lr1.92": [*V2, "--lr", "1.92"],
    "v3_r18_lr4.8_t0.2_w1": V3_R18_FAST,
    "v3_r18_lr9.6_t0.2_w1": [*V3_R18_FAST, "--lr", "9.6"],
    "v3_r18_lr4.8_t0.1_w1": [*V3_R18_FAST, "--temperature", "0.1"],
    "v3_vit8_lr3e-3_w1": VIT8_FAST,
    "v3_vit8_lr6e-3_w1": [*VIT8_FAST, "--lr", "6e-3"],
    "v3_vit8_lr1.2e-2_w1": [*VIT8_FAST, "--lr", "1.2e-2"],
    # third round: larger batches (cheaper per image on a CPU) and a second seed (how much the curves vary)
    "v2_r18_seed1": [*V2, "--seed", "1", "--stop-at-epoch", "16"],
    "v2_r18_bs64": [*V2, "--batch-size", "64", "--stop-at-epoch", "20"],
    "v2_r18_bs128": [*V2, "--queue-size", "768", "--bn-splits", "4", "--batch-size", "128", "--stop-at-epoch", "40"],
    "v3_r18_lr4.8_t0.2_w1_seed1": [*V3_R18_FAST, "--seed", "1", "--stop-at-epoch", "16"],
    "v3_r18_lr4.8_t0.2_w1_bs64": [*V3_R18_FAST, "--batch-size", "64", "--stop-at-epoch", "20"],
    "v3_r18_lr2.4_t0.2_w1_bs64": [*V3_R18_FAST, "--lr", "2.4", "--batch-size", "64", "--stop-at-epoch", "20"],
    "v3_r18_lr4.8_t0.2_w1_bs128": [*V3_R18_FAST, "--batch-size", "128", "--stop-at-epoch", "40"],
    "v3_vit8_lr3e-3_w1_seed1": [*VIT8_FAST, "--seed", "1", "--stop-at-epoch", "16"],
    "v3_vit8_lr3e-3_w1_bs64": [*VIT8_FAST, "--batch-size", "64", "--stop-at-epoch", "20"],
}


def read_curves(metrics: Path) -> dict:
    """``{"knn": [[step, acc], ...], "loss": [[step, loss], ...]}`` from a run's ``metrics.jsonl`` (empty if none)."""
    knn, loss = [], []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut off when the run was stopped
                continue
            if row.get("kind") == "epoch" and row.get("knn_acc") is not None:
                knn.append([row["step"], row["knn_acc"]])
            if row.get("kind") == "step":
                loss.append([row["step"], row["loss"]])
    return {"knn": knn, "loss": loss}


def run_recipes(names: list[str], data: Path, work: Path, device: str, workers: int, extra: list[str],
                parallel: int, time_limit: float) -> dict:
    """Run the recipes (at most ``parallel`` at once) until done or ``time_limit`` seconds; returns their curves."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if parallel > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # processes share the cores; one thread each avoids oversubscription
    pending, running, results = list(names), {}, {}
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            args = [*COMMON, *RECIPES[name], "--device", device, "--workers", str(workers), *extra]  # last one wins
            log = open(work / f"{name}.log", "w")
            cmd = [sys.executable, "-m", "app.cli", "train", str(data), "--out", str(work / name), *args]
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO),
                             time.perf_counter(), args)
        time.sleep(1.0)
        out_of_time = time.perf_counter() - start > time_limit
        for name, (proc, began, args) in list(running.items()):
            if proc.poll() is None and not out_of_time:
                continue
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
            del running[name]
            results[name] = {"args": args, "returncode": proc.returncode, "stopped_at_time_limit": out_of_time,
                             "seconds": time.perf_counter() - began, **read_curves(work / name / "metrics.jsonl")}
            print(f"{name}: rc {proc.returncode}, k-NN {[(s, round(a, 3)) for s, a in results[name]['knn']]}",
                  flush=True)
        if out_of_time:
            for name in pending:
                results[name] = {"args": RECIPES[name], "returncode": None, "stopped_at_time_limit": True,
                                 "seconds": 0.0, "knn": [], "loss": []}
            pending = []
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, res in sorted(results.items()):
        if res["knn"]:
            steps, accs = zip(*res["knn"])
            ax.plot(steps, [100 * a for a in accs], marker="o", markersize=3, label=name,
                    linestyle="-" if name.startswith("v3_r18") else "--" if name.startswith("v3_vit") else ":")
    ax.set_xlabel("training steps")
    ax.set_ylabel("k-NN top-1 (%), leave-one-out, 1,600 demo images")
    ax.set_title("MoCo recipes on the generated demo data (step 0 = random init)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="NAME",
                   help=f"recipes to run (default all: {', '.join(RECIPES)})")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=1, help="data-loading processes per run")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (several fit on one GPU)")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds; stop every run still going after this")
    p.add_argument("--extra", default="", help="more `moco train` options for every run, e.g. --extra=--no-amp")
    p.add_argument("--work", default=None, help="folder for the data and run directories (default: beside --out)")
    p.add_argument("--out", default="bench/results/learning_curves.json")
    args = p.parse_args(argv)

    from trainer.demo_data import write_demo_dataset

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    data = write_demo_dataset(work / "data", per_class=200, size=32, seed=0)
    results = run_recipes(args.recipes, data, work, args.device, args.workers, args.extra.split(), args.parallel,
                          args.time_limit)
    report = {"benchmark": "learning_curves", "host": platform.node(), "device": args.device,
              "common_args": COMMON, "extra_args": args.extra.split(), "recipes": results}
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
