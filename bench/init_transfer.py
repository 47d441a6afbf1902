"""Does ``--init`` pay? k-NN top-1 on target collections at equal wall clock: (a) from scratch, (b) ``--init`` from
a checkpoint pretrained on another collection then continued training, (c) that checkpoint exported as it is.

1. Pretrain once on ``--source`` (``moco train --time-budget --pretrain-budget``, seed 0): the initial checkpoint.
2. Per target collection and seed, one real ``moco train`` process each, one after another (``--lock`` takes an
   exclusive ``flock`` around every measured step, as ``bench/learning_curves.py`` does):
   (a) ``moco train TARGET --time-budget B`` from random weights;
   (b) ``moco train TARGET --init INITIAL --time-budget B`` (the ``--init`` recipe of ``auto``);
   (c) ``moco export INITIAL`` then ``moco eval knn`` on the target with that ONNX file (no training);
   and each ``--variant NAME="OPTIONS"``: (b) with those ``moco train`` options on top, e.g. the from-scratch
   recipe's lr and key momentum, to measure what the ``--init`` recipe's values buy.
   The curves are the monitor's k-NN (leave-one-out on a labeled folder, or ``val/`` against ``train/``) by the
   budget clock's minutes; (c) and the random-init baseline are horizontal lines.
3. JSON of every curve and summary to ``--out`` (default ``bench/results/init_transfer.json``) and a plot beside
   it (same name, ``.png``), one panel per target, random init marked. ``b_beats_a`` per target says whether (b)'s
   mean final k-NN is above (a)'s.

Collections come from ``bench/real_datasets.py`` (e.g. openclipart, fashion_mnist, icons, tuxpaint; build them
first). On 2 CPU cores, e.g.:

    python bench/init_transfer.py --source openclipart=/work/datasets/openclipart_split \\
        --targets icons=/work/datasets/icons_split tuxpaint=/work/datasets/tuxpaint_split \\
        --pretrain-budget 12m --budget 4m --seeds 0 1 2 --lock /tmp/moco-cpu.lock

and the same with ``--seeds 0 1 --variant 'scratch_lr=--lr 0.06 --momentum 0.99'`` for the --init recipe's worth
(``bench/results/init_transfer_cpu.json`` and ``init_transfer_variants_cpu.json``, made with the recipe of
the day: a tenth of the lr and key momentum 0.999 in (b)).

On a GPU, the same at 224 px with ResNet-50: ``--arch resnet50 --image-size 224 --extra=--device=cuda``.
``--smoke`` runs the whole pipeline on generated images for a few seconds per run (a check that it works;
its figures mean nothing) and writes to a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.learning_curves import dataset_folders, exclusive, plot_curve, read_curve  # noqa: E402

ARMS = {"a": "from scratch", "b": "--init, continued", "c": "--init as is (exported)"}


def _moco(args: list[str], log: Path, lock: str | None) -> tuple[int, float]:
    """Run ``python -m moco_retrieval ARGS`` in its own process, output to ``log``: (return code, seconds)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tic = time.perf_counter()
    with open(log, "w") as out, exclusive(lock):
        code = subprocess.run(
            [sys.executable, "-m", "moco_retrieval", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        ).returncode
    return code, time.perf_counter() - tic


def train_run(
    train: Path,
    knn: Path,
    out: Path,
    budget: str,
    seed: int,
    common: list[str],
    init: Path | None,
    lock: str | None,
    extra: list[str] = (),
) -> dict:
    """One budgeted ``moco train`` (from scratch, or from ``init``) and its k-NN curve."""
    args = [
        "train",
        str(train),
        "--out",
        str(out),
        *common,
        "--seed",
        str(seed),
        "--time-budget",
        budget,
        "--knn-dir",
        str(knn),
    ]
    if init is not None:
        args += ["--init", str(init)]
    args += list(extra)
    code, seconds = _moco(args, out.with_suffix(".log"), lock)
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    result = {
        "seed": seed,
        "args": args[1:],
        "returncode": code,
        "wall_seconds": seconds,
        "derived": {k: v["value"] for k, v in config.get("derived", {}).items()},
        "init_report": config.get("init_report") or None,
        **read_curve(out / "metrics.jsonl"),
    }
    print(f"  {out.name}: rc {code}, k-NN {[(m, round(a, 3)) for m, a in result['knn']]}", flush=True)
    if (out / "checkpoint_last.pt").exists():
        result["final"] = knn_of(out / "checkpoint_last.pt", knn, out.parent, out.name, lock)
    return result


def knn_of(checkpoint: Path, knn: Path, work: Path, tag: str, lock: str | None) -> dict:
    """A checkpoint exported to ONNX (``moco export``) and measured by ``moco eval knn`` on the target (k = 20):
    (c) for the initial checkpoint, and the final figure of every (a) and (b) run, so all three arms are
    measured the same way (the monitor's last point can be missing when a budget ends at an epoch's end)."""
    encoder = work / f"{tag}.onnx"
    if not encoder.exists():
        code, _ = _moco(["export", str(checkpoint), "--out", str(encoder)], work / f"{tag}-export.log", lock)
        if code:
            return {"returncode": code, "top1": None}
    split = (knn / "train").is_dir() and (knn / "val").is_dir()
    train, test = (knn / "train", knn / "val") if split else (knn, knn)
    out = work / f"{tag}-{knn.name}-knn.json"
    code, _ = _moco(
        ["eval", "knn", "--train", str(train), "--test", str(test), str(encoder), "--k", "20", "--out", str(out)],
        work / f"{tag}-{knn.name}-knn.log",
        lock,
    )
    top1 = json.loads(out.read_text())["results"][0]["top1"] if code == 0 else None
    print(f"  {tag} on {knn.name}: rc {code}, k-NN {top1}", flush=True)
    return {"returncode": code, "top1": top1, "protocol": "val vs train" if split else "leave-one-out"}


def random_init(knn: Path, arch: str, image_size: int, seeds: list[int]) -> list[float]:
    """k-NN top-1 of randomly initialised backbones as the monitor sees them, one per seed (ResNets)."""
    import torch

    from moco_retrieval.trainer.backbones import build_resnet
    from moco_retrieval.trainer.monitor import KnnMonitor

    if not arch.startswith("resnet"):
        return []
    monitor = KnnMonitor(knn, image_size)
    accs = []
    for seed in seeds:
        torch.manual_seed(seed)
        accs.append(monitor.evaluate(build_resnet(arch, "imagenet")[0], torch.device("cpu")))
    return accs


def _final(runs: list[dict]) -> dict:
    """Mean and spread over seeds of each run's final k-NN (``moco eval knn`` of its last checkpoint)."""
    ends = [r["final"]["top1"] for r in runs if (r.get("final") or {}).get("top1") is not None]
    return {
        "final_mean": statistics.fmean(ends) if ends else None,
        "final_sd": statistics.stdev(ends) if len(ends) > 1 else 0.0,
        "seeds": len(ends),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["targets"])
    fig, axes = plt.subplots(1, len(names), figsize=(max(8.0, 5.5 * len(names)), 4.6), squeeze=False)
    colours = {"a": "tab:blue", "b": "tab:orange", "c": "tab:green"}
    spare = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    colours.update({v: next(spare, "black") for v in report.get("variants", {})})
    for ax, name in zip(axes[0], names):
        entry = report["targets"][name]
        for arm in entry["runs"]:
            summary = entry["summary"][arm]
            label = arm_name(arm, report) + (
                ""
                if summary["final_mean"] is None
                else f": {100 * summary['final_mean']:.1f} ± {100 * summary['final_sd']:.1f} %"
            )
            for j, run in enumerate(entry["runs"][arm]):
                if run["knn"]:
                    plot_curve(
                        ax,
                        run["knn"],
                        marker="o",
                        markersize=3,
                        color=colours[arm],
                        alpha=0.9 if j == 0 else 0.5,
                        label=label if j == 0 else None,
                    )
                if (run.get("final") or {}).get("top1") is not None and run["knn"]:
                    ax.plot(
                        [run["knn"][-1][0]], [100 * run["final"]["top1"]], marker="*", markersize=9, color=colours[arm]
                    )  # the final checkpoint through moco eval knn
        if entry["as_is"].get("top1") is not None:
            ax.axhline(
                100 * entry["as_is"]["top1"],
                color=colours["c"],
                linestyle="--",
                label=f"{ARMS['c']}: {100 * entry['as_is']['top1']:.1f} %",
            )
        if entry["random_init"]:
            mean = 100 * statistics.fmean(entry["random_init"])
            ax.axhline(mean, color="grey", linestyle=":", label=f"random init: {mean:.1f} %")
        ax.set_title(f"{name}" + (" ((b) beats (a))" if entry["b_beats_a"] else ""))
        ax.set_xlabel(f"minutes of training (--time-budget {report['budget']})")
        ax.set_ylabel("k-NN top-1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"--init from {report['source']} ({report['pretrain_budget']} of pretraining), {report['arch']} at "
        f"{report['image_size']} px, seeds {report['seeds']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def arm_name(arm: str, report: dict) -> str:
    """An arm's label: (a), (b), (c), or a variant's name with its options."""
    return ARMS.get(arm) or f"--init, {arm}: {report['variants'][arm]}"


def _smoke_data(root: Path) -> tuple[str, list[str]]:
    from moco_retrieval.trainer.demo_data import write_demo_dataset

    source = write_demo_dataset(root / "source", per_class=12, size=32, seed=0)
    target = write_demo_dataset(root / "target", per_class=12, size=32, seed=1)
    return f"demo_source={source}", [f"demo_target={target}"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", metavar="NAME=FOLDER", help="the collection to pretrain on")
    p.add_argument("--targets", nargs="+", default=[], metavar="NAME=FOLDER", help="collections to compare on")
    p.add_argument("--pretrain-budget", default="12m", help="--time-budget of the pretraining run")
    p.add_argument("--budget", default="4m", help="--time-budget of every (a) and (b) run: the equal wall clock")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--moco-version", type=int, default=2)
    p.add_argument("--extra", default="", help="more `moco train` options for every run, e.g. --extra=--device=cuda")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="OPTIONS"',
        help="one more --init arm: (b) with these moco train options on top (repeatable)",
    )
    p.add_argument("--lock", default=None, help="take this file's exclusive flock around each measured step")
    p.add_argument("--work", default=None, help="folder for run directories (default: a temporary one)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/init_transfer.json)")
    p.add_argument("--smoke", action="store_true", help="generated images, seconds per run, one seed: a check")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="init-transfer-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.source, args.targets = _smoke_data(work / "data")
        args.pretrain_budget, args.budget, args.seeds = "20s", "15s", [0]
        args.variant = args.variant or ["lr_x10=--lr 0.06"]
        args.out = args.out or str(work / "init_transfer_smoke.json")
    if not args.source or not args.targets:
        p.error("give --source and --targets (or --smoke)")
    out = Path(args.out or REPO / "bench" / "results" / "init_transfer.json")
    common = [
        "--arch",
        args.arch,
        "--image-size",
        str(args.image_size),
        "--moco-version",
        str(args.moco_version),
        "--log-every",
        "10",
        "--save-every",
        "1000",
        *shlex.split(args.extra),
    ]

    variants = dict(v.split("=", 1) for v in args.variant)
    if any(name in ARMS or not name.isidentifier() for name in variants):
        p.error(f"a --variant needs a NAME=OPTIONS with a name other than {sorted(ARMS)}")
    source_name, source_train, source_knn = dataset_folders(args.source, work)
    print(f"pretraining on {source_name} for {args.pretrain_budget}", flush=True)
    pretrain = train_run(
        source_train, source_knn, work / f"pretrain-{source_name}", args.pretrain_budget, 0, common, None, args.lock
    )
    initial = work / f"pretrain-{source_name}" / "checkpoint_last.pt"
    if not initial.exists():
        raise SystemExit(f"pretraining left no checkpoint (see {work / f'pretrain-{source_name}.log'})")

    report = {
        "source": source_name,
        "pretrain_budget": args.pretrain_budget,
        "budget": args.budget,
        "seeds": args.seeds,
        "arch": args.arch,
        "image_size": args.image_size,
        "moco_version": args.moco_version,
        "extra": args.extra,
        "variants": variants,
        "smoke": args.smoke,
        "cpu_count": os.cpu_count(),
        "machine": platform.node(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "pretrain": pretrain,
        "targets": {},
    }
    for spec in args.targets:
        name, train, knn = dataset_folders(spec, work)
        print(f"target {name}", flush=True)
        init_arms = {"b": "", **variants}  # (b) and each variant: --init, with their own options on top
        runs = {"a": [], **{arm: [] for arm in init_arms}}
        for seed in args.seeds:
            runs["a"].append(
                train_run(train, knn, work / f"{name}-a-s{seed}", args.budget, seed, common, None, args.lock)
            )
            for arm, options in init_arms.items():
                out_dir = work / f"{name}-{arm}-s{seed}"
                runs[arm].append(
                    train_run(train, knn, out_dir, args.budget, seed, common, initial, args.lock, shlex.split(options))
                )
        summary = {arm: _final(runs[arm]) for arm in runs}
        a, b = summary["a"]["final_mean"], summary["b"]["final_mean"]
        report["targets"][name] = {
            "images": sum(1 for f in train.rglob("*") if f.is_file()),
            "runs": runs,
            "summary": summary,
            "as_is": knn_of(initial, knn, work, "initial", args.lock),
            "random_init": random_init(knn, args.arch, args.image_size, args.seeds),
            "b_beats_a": a is not None and b is not None and b > a,
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    for name, entry in report["targets"].items():
        s = entry["summary"]
        print(
            f"  {name}: (a) {s['a']['final_mean']}, (b) {s['b']['final_mean']}, (c) {entry['as_is'].get('top1')}, "
            f"random {entry['random_init']}: (b) beats (a): {entry['b_beats_a']}"
            + "".join(f", {v} {s[v]['final_mean']}" for v in variants)
        )
    return report


if __name__ == "__main__":
    main()
