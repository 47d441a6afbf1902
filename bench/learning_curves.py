"""Learning curves: k-NN top-1 against wall-clock minutes of ``moco train --time-budget``, per recipe and data set.

Each (data set, recipe) pair is one real ``moco train`` run in its own process, one after another (a curve
against wall-clock time is only worth something measured alone: ``--lock`` takes an exclusive ``flock`` per
run so other work on the machine can wait its turn). The monitor's k-NN accuracy (leave-one-out on a labeled
folder, or ``train/`` as the memory bank and ``val/`` classified) is read back from ``metrics.jsonl`` with the
budget clock's ``elapsed_s``; the point at 0 minutes is the randomly initialised network. Writes a JSON of every
curve and a plot beside it (same name, ``.png``), one panel per data set.

Two baselines are measured per data set and seed, in this process, each plain and PCA-whitened as the monitor
whitens: the randomly initialised ResNet as the monitor sees it, and the same network with its BatchNorm
statistics fitted to the k-NN bank's images (``torch.optim.swa_utils.update_bn``, no weight changes). A freshly
built network normalises with mean 0 and variance 1; a few forward passes over the data lift some collections'
k-NN by several points (the Oxygen icons: 57 -> 69 %) -- a recipe that merely stays near its initialisation
while its BatchNorm statistics adapt looks as if it learned. On other collections fitting lowers it
(Fashion-MNIST at 28 px: 78.4 -> 74.5 %). Learning
means beating the higher of the two lines. A third line is the images themselves: L2 k-NN on the raw
pixels of the same evaluation crops, the best k of 1 / 5 / 20 (``KnnMonitor.pixel_accuracy``); an encoder
that does not beat it is not worth indexing with.

    python bench/learning_curves.py --datasets demo tuxpaint=/work/datasets/tuxpaint_split \\
        icons=/work/datasets/icons_split --recipes auto_v2 paper_v2 auto_v3 --budget 150s --seeds 0 1 \\
        --lock /tmp/moco-cpu.lock --out bench/results/learning_curves_cpu_budget.json

``--from-runs PATTERN`` plots runs that already ended (their folders: PATTERN with ``{name}`` and ``{seed}``)
instead of training, with the baselines measured on their monitor's own bank at their own image size (the
runs of one data set must share it), e.g. the 30-minute defaults::

    python bench/learning_curves.py --from-runs 'runs30/{name}_s{seed}' --datasets tuxpaint icons openclipart \\
        --seeds 0 1 2 --budget 30m --out bench/results/learning_curves_cpu_30m_default.json

``--candidate NAME="OPTIONS"`` adds a recipe of your own (``moco train`` options) to compare, e.g.
``--candidate lr_low="--moco-version 2 --lr 0.12" --recipes auto_v2 lr_low``.

A data set is ``demo`` (the generated demo images, 8 classes x 200 at 64 px, as ``moco demo`` makes them) or
``name=FOLDER``: a labeled folder (``FOLDER/<class>/...``), or one split into ``train/`` and ``val/`` (training
on ``train/`` only, the monitor classifying ``val/`` against ``train/``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402

ARCH, IMAGE_SIZE = "resnet18", 32
COMMON = ["--arch", ARCH, "--image-size", str(IMAGE_SIZE), "--log-every", "10", "--save-every", "1000"]
RECIPES: dict[str, list[str]] = {
    "auto_v2": ["--moco-version", "2"],  # the default: MoCo v2, --recipe auto
    "auto_v2_fp32": ["--moco-version", "2", "--no-amp"],  # the same in float32, to compare bf16 with
    "paper_v2": ["--moco-version", "2", "--recipe", "paper", "--stem", "imagenet"],  # the papers' values
    "auto_v3": ["--moco-version", "3"],
    "paper_v3": ["--moco-version", "3", "--recipe", "paper", "--stem", "imagenet"],
    "auto_v3_vit": ["--moco-version", "3", "--arch", "vit_tiny", "--patch-size", "8"],
}


def read_curve(metrics: Path) -> dict:
    """``{"knn": [[minutes, acc], ...], "knn_whitened": [...], "steps": [[minutes, step], ...]}`` from a run's
    ``metrics.jsonl`` (``knn_whitened``: the monitor's k-NN of the features PCA-whitened as the export does)."""
    knn, whitened, steps = [], [], []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut off when the run was stopped
                continue
            minutes = (row.get("elapsed_s") or 0.0) / 60
            if row.get("kind") == "epoch" and row.get("knn_acc") is not None:
                knn.append([round(minutes, 4), row["knn_acc"]])
            if row.get("kind") == "epoch" and row.get("knn_acc_whitened") is not None:
                whitened.append([round(minutes, 4), row["knn_acc_whitened"]])
            if row.get("kind") == "step":
                steps.append([round(minutes, 4), row["step"]])
    return {"knn": knn, "knn_whitened": whitened, "steps": steps}


def dataset_folders(spec: str, work: Path) -> tuple[str, Path, Path]:
    """``(name, training folder, k-NN folder)`` of a ``--datasets`` entry."""
    if spec == "demo":
        from moco_retrieval.trainer.demo_data import write_demo_dataset

        folder = write_demo_dataset(work / "demo-data", per_class=200, size=64, seed=0)
        return "demo", folder, folder
    name, _, folder = spec.partition("=")
    folder = Path(folder)
    if not folder.is_dir():
        raise SystemExit(f"--datasets {spec}: {folder} is not a folder")
    train = folder / "train" if (folder / "train").is_dir() and (folder / "val").is_dir() else folder
    return name, train, folder


@contextlib.contextmanager
def exclusive(lock: str | None):
    """Hold ``lock``'s exclusive ``flock`` (nothing when None): other measured work waits its turn."""
    if not lock:
        yield
        return
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def random_baselines(
    knn: Path, seeds: list[int], cache_root: str | None, max_images: int = 5000, image_size: int = IMAGE_SIZE
) -> dict:
    """k-NN top-1 of randomly initialised backbones, per seed: ``{"random": [...], "random_whitened": [...],
    "random_bn": [...], "random_bn_whitened": [...]}``, the network as built (each BN the identity) plain and
    PCA-whitened as the monitor whitens a trained backbone's, then after fitting the BatchNorm statistics to the
    k-NN bank's evaluation crops (weights unchanged) plain and whitened, and of the raw pixels; the monitor's k-NN
    at ``image_size`` px over at most ``max_images`` images per split."""
    import torch
    from torch.optim.swa_utils import update_bn

    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.monitor import KnnMonitor

    cpu = torch.device("cpu")
    monitor = KnnMonitor(knn, image_size, max_images=max_images, cache_root=cache_root)
    raw, raw_whitened, fitted, fitted_whitened = [], [], [], []
    for seed in seeds:
        torch.manual_seed(seed)
        backbone, _ = build_resnet(ARCH, "imagenet")
        score = monitor.scores(backbone, cpu)
        raw.append(score.plain)
        raw_whitened.append(score.whitened)
        with torch.no_grad():  # a batch of one has no batch statistics
            update_bn((x for x in monitor.inputs(monitor.splits[0], cpu) if len(x) > 1), backbone)
        score = monitor.scores(backbone, cpu)
        fitted.append(score.plain)
        fitted_whitened.append(score.whitened)
    pixels = monitor.pixel_accuracy()
    return {
        "seeds": seeds,
        "random": raw,
        "random_whitened": raw_whitened,
        "random_bn": fitted,
        "random_bn_whitened": fitted_whitened,
        "pixels": max(pixels.values()),
        "pixels_by_k": pixels,
    }


def run_one(
    name: str,
    recipe: str,
    seed: int,
    train: Path,
    knn: Path,
    work: Path,
    budget: str,
    extra: list[str],
    lock: str | None,
) -> dict:
    out = work / f"{name}-{recipe}-s{seed}"
    args = [*COMMON, *RECIPES[recipe], "--seed", str(seed), "--time-budget", budget, "--knn-dir", str(knn), *extra]
    cmd = [sys.executable, "-m", "moco_retrieval", "train", str(train), "--out", str(out), *args]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tic = time.perf_counter()
    with open(work / f"{name}-{recipe}-s{seed}.log", "w") as log, exclusive(lock):
        returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    wall = time.perf_counter() - tic
    result = {"seed": seed, "args": args, "returncode": returncode, "wall_seconds": wall, **run_report(out)[1]}
    print(
        f"{name} {recipe} seed {seed}: rc {returncode}, k-NN {[(m, round(a, 3)) for m, a in result['knn']]}", flush=True
    )
    return result


def run_report(run_dir: Path) -> tuple[dict, dict]:
    """``(config, report)`` of a run folder: its ``config.json`` (``{}`` when missing) and what a curve's entry
    holds of it, the values the recipe derived and the curves (:func:`read_curve`)."""
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    derived = {k: v["value"] for k, v in config.get("derived", {}).items()}
    return config, {"derived": derived, **read_curve(run_dir / "metrics.jsonl")}


def finished_run(run_dir: Path, seed: int, budget: str) -> tuple[dict, Path, Path, int]:
    """A run that already ended (``--from-runs``), as :func:`run_one` reports one, with its training folder, its
    monitor's k-NN bank (``--knn-dir``, else the training folder itself, as ``moco train`` picks it) and the
    image size it trained at (its monitor's; the baselines are measured at it). Its ``--seed`` and
    ``--time-budget`` must be ``seed`` and ``budget``: the plot says so."""
    if not (run_dir / "config.json").is_file():
        raise SystemExit(f"--from-runs: {run_dir} is not a `moco train` run folder (no config.json)")
    config, report = run_report(run_dir)
    result = {"seed": seed, "run_dir": str(run_dir), "returncode": None, **report}
    if not result["knn"]:
        raise SystemExit(f"--from-runs: {run_dir} has no k-NN evaluations in metrics.jsonl")
    for option, value, wanted in (
        ("--seed", config.get("seed"), seed),
        ("--time-budget", config.get("time_budget"), budget),
        # the baselines are this module's network: a run of another one would be compared with them
        ("--arch", config.get("arch"), ARCH),
        ("--stem", config.get("stem"), "imagenet"),
    ):
        if value != wanted:
            raise SystemExit(f"--from-runs: {run_dir} ran with {option} {value}, not {wanted}")
    train = Path(config["data_dir"])
    return result, train, Path(config.get("knn_dir") or train), int(config["image_size"])


def summarize(runs: list[dict]) -> dict:
    """Mean and spread over seeds of the first and last k-NN points of one recipe's runs (and of the last
    whitened point)."""
    import statistics

    ends = [r["knn"][-1][1] for r in runs if r["knn"]]
    starts = [r["knn"][0][1] for r in runs if r["knn"]]
    steps = [r["steps"][-1][1] for r in runs if r["steps"]]
    spread = statistics.stdev(ends) if len(ends) > 1 else 0.0
    whitened = [r["knn_whitened"][-1][1] for r in runs if r.get("knn_whitened")]
    return {
        "final_whitened_mean": statistics.fmean(whitened) if whitened else None,
        "final_whitened_sd": statistics.stdev(whitened) if len(whitened) > 1 else 0.0,
        "final_mean": statistics.fmean(ends) if ends else None,
        "final_sd": spread,
        "initial_mean": statistics.fmean(starts) if starts else None,
        "steps_mean": statistics.fmean(steps) if steps else None,
        "seeds": len(ends),
    }


def plot_curve(ax, points: list, **style) -> None:
    """Draw a k-NN curve ``[(minutes, top-1 in [0, 1]), ...]`` on ``ax`` in percent, with matplotlib ``style``."""
    minutes, accs = zip(*points)
    ax.plot(minutes, [100 * a for a in accs], **style)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["datasets"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.6), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    recipes = list(dict.fromkeys(r for name in names for r in report["datasets"][name]["runs"]))
    colour = {r: palette[i % len(palette)] for i, r in enumerate(recipes)}  # one colour per recipe in every panel
    for ax, name in zip(axes[0], names):
        entry = report["datasets"][name]
        for recipe, runs in entry["runs"].items():
            summary = entry["summary"].get(recipe) or {}
            spread = f" ± {100 * summary['final_sd']:.1f}" if summary.get("seeds", 0) > 1 else ""
            label = (
                recipe
                if summary.get("final_mean") is None
                else (f"{recipe}: {100 * summary['final_mean']:.1f}{spread} %")
            )
            for j, res in enumerate(runs):
                if res["knn"]:
                    plot_curve(
                        ax,
                        res["knn"],
                        marker="o",
                        markersize=3,
                        color=colour[recipe],
                        linestyle="--" if recipe.startswith("paper") else "-",
                        alpha=0.9 if j == 0 else 0.5,
                        label=label if j == 0 else None,
                    )
                if res.get("knn_whitened"):  # the same evaluations, whitened as the export does
                    mean = summary.get("final_whitened_mean")
                    text = f"{recipe}, whitened: {100 * mean:.1f} %" if mean is not None else f"{recipe}, whitened"
                    plot_curve(
                        ax,
                        res["knn_whitened"],
                        marker="s",
                        markersize=2,
                        color=colour[recipe],
                        linestyle=":",
                        alpha=0.9 if j == 0 else 0.5,
                        label=text if j == 0 else None,
                    )
        base = entry.get("baselines") or {}
        for key, style, text in (
            ("random", ":", "random init"),
            ("random_whitened", (0, (3, 1, 1, 1)), "random init, whitened"),
            ("random_bn", "-.", "random init, BN fitted"),
            ("random_bn_whitened", (0, (1, 3)), "random init, BN fitted, whitened"),
            ("pixels", "--", "raw pixels, L2, best k of 1/5/20"),
        ):
            if base.get(key):
                values = base[key] if isinstance(base[key], list) else [base[key]]
                values = [v for v in values if v is not None]  # a bank too small to whiten
                if not values:
                    continue
                mean = 100 * sum(values) / len(values)
                ax.axhline(mean, color="grey", linestyle=style, linewidth=1.2, label=f"{text}: {mean:.1f} %")
        ax.set_title(
            f"{name} ({entry['images']} training images, baselines at {entry.get('image_size', IMAGE_SIZE)} px)"
        )
        ax.set_xlabel(f"minutes of training (--time-budget {report['budget']}, {report['cpu_count']} CPU cores)")
        ax.set_ylabel("k-NN top-1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    seeds = report.get("seeds", [0])
    title = (
        f"MoCo learning curves, ResNet-18 at {IMAGE_SIZE} px unless a recipe sets --image-size (--from-runs: the "
        f"runs' size), seeds {seeds}: final k-NN mean ± sd over seeds"
    )
    fig.suptitle(textwrap.fill(title, width=55 * len(names)), fontsize=10)  # about 55 characters a panel
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["demo"], metavar="demo|NAME=FOLDER")
    p.add_argument(
        "--candidate",
        action="append",
        default=[],
        metavar='NAME="OPTIONS"',
        help="define a recipe of your own: `moco train` options, run when NAME is in --recipes",
    )
    p.add_argument(
        "--recipes",
        nargs="+",
        default=["auto_v2", "paper_v2"],
        metavar="NAME",
        help=f"recipes to run (from: {', '.join(RECIPES)}, or a --candidate)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="a run per recipe and seed (--seed)")
    p.add_argument("--budget", default="150s", help="--time-budget of every run (that of the --from-runs runs)")
    p.add_argument("--extra", default="", help="more `moco train` options for every run, e.g. --extra=--device=cuda")
    p.add_argument("--no-baselines", action="store_true", help="skip the random-init baselines (ResNets only)")
    p.add_argument("--lock", default=None, help="take this file's exclusive flock around each run")
    p.add_argument("--work", default=None, help="folder for the data and run directories (default: beside --out)")
    p.add_argument(
        "--from-runs",
        metavar="PATTERN",
        default=None,
        help="plot runs that already ended instead of training: their folders, PATTERN with {name} (a --datasets "
        "name) and {seed} (e.g. 'runs/{name}_s{seed}'); the baselines are measured on each run's own k-NN bank",
    )
    p.add_argument("--runs-label", default="default", help="the --from-runs runs' name on the plot")
    p.add_argument("--out", default="bench/results/learning_curves_budget.json")
    args = p.parse_args(argv)
    if args.from_runs:
        args.recipes = [args.runs_label]
        RECIPES[args.runs_label] = []
    for spec in args.candidate:
        name, sep, options = spec.partition("=")
        if not sep or not name:
            p.error(f'--candidate {spec!r}: expected NAME="OPTIONS"')
        RECIPES[name] = shlex.split(options)
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}: choose from {list(RECIPES)} or define them with --candidate")

    from moco_retrieval.contracts.images import walk_image_files

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "learning_curves",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "machine": machine(),
        "budget": args.budget,
        "seeds": args.seeds,
        "common_args": COMMON,
        "extra_args": args.extra.split(),
        "recipes": {r: RECIPES[r] for r in args.recipes},
        "command": " ".join(sys.argv),
        "datasets": {},
    }
    for spec in args.datasets:
        if args.from_runs:  # each run's own folders: the --seeds that have one
            name = spec.partition("=")[0]
            folders = {seed: Path(args.from_runs.format(name=name, seed=seed)) for seed in args.seeds}
            ended = [finished_run(folder, seed, args.budget) for seed, folder in folders.items() if folder.exists()]
            if not ended:
                raise SystemExit(f"--from-runs: no run folder for {name} ({', '.join(map(str, folders.values()))})")
            _, train, knn, image_size = ended[0]
            if any((t, k, size) != (train, knn, image_size) for _, t, k, size in ended):
                raise SystemExit(f"--from-runs: the runs of {name} trained or evaluated on different folders or sizes")
            print(f"{name}: the runs of seeds {[r['seed'] for r, *_ in ended]} at {image_size} px", flush=True)
        else:
            name, train, knn = dataset_folders(spec, work)
            image_size = IMAGE_SIZE  # COMMON's
        entry = report["datasets"][name] = {
            "image_size": image_size,
            "train": str(train),
            "knn": str(knn),
            "runs": {},
            "summary": {},
            "images": len(walk_image_files(train)),
        }
        if not args.no_baselines:
            with exclusive(args.lock):
                entry["baselines"] = random_baselines(
                    knn, args.seeds, os.environ.get("MOCO_CACHE_DIR"), image_size=image_size
                )
            print(f"{name} baselines: {entry['baselines']}", flush=True)
        if args.from_runs:
            entry["runs"][args.runs_label] = [result for result, *_ in ended]
            entry["summary"][args.runs_label] = summarize(entry["runs"][args.runs_label])
            continue
        for recipe in args.recipes:
            runs = entry["runs"][recipe] = []
            for seed in args.seeds:
                runs.append(run_one(name, recipe, seed, train, knn, work, args.budget, args.extra.split(), args.lock))
                entry["summary"][recipe] = summarize(runs)
                out.write_text(json.dumps(report, indent=1) + "\n")  # partial results survive an interruption
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
