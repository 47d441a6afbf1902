#!/usr/bin/env python3
"""Acceptance at real size: the README's flow end to end on a real collection, as a user runs it (outside CI).

Stages, each a real ``moco`` process (its own budget; any traceback, non-zero exit or overrun fails the run):

    train        moco train TRAIN --out RUN --time-budget B      (the k-NN monitor on: TRAIN is labeled)
    train again  the same on a new --out: must decode nothing (the image cache already holds every image)
    export       moco export RUN --out encoder.onnx
    eval         moco eval knn --train TRAIN --test TEST encoder.onnx
    index        moco index TRAIN --model encoder.onnx --out INDEX
    update       1% of the files changed (re-encoded copies) and the same moco index again
    serve        moco serve INDEX, then 200 searches and 200 classifications over HTTP

and the checks between them: the cache holds every image of TRAIN, the index holds exactly the readable files
of TRAIN (ids unchanged for unchanged files after the update), every HTTP answer is 200 with k results.
Figures go to ``bench/results/acceptance_<name>.json``.

The collection: Fashion-MNIST (60,000 + 10,000 28-px product photos, 10 classes) from Debian:

    apt-get install dataset-fashion-mnist
    python bench/real_datasets.py --only fashion_mnist --out /work/datasets
    # TRAIN = 60,000 train_* images, TEST = 10,000 test_* images, one folder per class:
    python bench/acceptance.py --from-fashion-mnist /work/datasets/fashion_mnist --work /work/scratch/acc

or any labeled pair: ``python bench/acceptance.py --train DIR --test DIR --work WORK``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


class StageFailed(Exception):
    pass


def run_stage(name: str, cmd: list[str], budget_s: float, log_dir: Path, env: dict) -> dict:
    """Run one ``moco`` command; fail on a non-zero exit, a traceback in its output, or past ``budget_s``."""
    log = log_dir / f"{name}.log"
    tic = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=budget_s * 2 + 60)
    seconds = time.monotonic() - tic
    text = log.read_text(errors="replace")
    print(f"{name}: rc {proc.returncode}, {seconds:.1f} s (budget {budget_s:.0f} s)", flush=True)
    if proc.returncode != 0 or "Traceback (most recent call last)" in text:
        raise StageFailed(f"{name} failed (rc {proc.returncode}); see {log}:\n{text[-3000:]}")
    if seconds > budget_s:
        raise StageFailed(f"{name} took {seconds:.0f} s, over its budget of {budget_s:.0f} s; see {log}")
    return {"seconds": round(seconds, 1), "budget_s": budget_s, "log": str(log), "output_tail": text[-1500:]}


def fashion_mnist_split(source: Path, work: Path) -> tuple[Path, Path]:
    """``train/<class>/`` (the 60,000 train_* files) and ``test/<class>/`` (the 10,000 test_*), hard links."""
    train, test = work / "data" / "train", work / "data" / "test"
    if not (work / "data" / ".done").exists():
        for folder in (train, test):
            shutil.rmtree(folder, ignore_errors=True)
        for label in sorted(p for p in source.iterdir() if p.is_dir()):
            for role, target in (("train_", train), ("test_", test)):
                (target / label.name).mkdir(parents=True, exist_ok=True)
                for f in label.glob(f"{role}*.png"):
                    os.link(f, target / label.name / f.name)
        (work / "data" / ".done").touch()
    return train, test


def count_images(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*.png"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def change_one_percent(train: Path, seed: int = 0) -> list[str]:
    """Replace 1% of the files by re-encoded copies (new bytes, same pixels); returns their relative paths."""
    from PIL import Image

    files = sorted(train.rglob("*.png"))
    chosen = random.Random(seed).sample(files, max(1, len(files) // 100))
    for path in chosen:
        with Image.open(path) as im:
            image = im.convert("RGB")
        path.unlink()  # a hard link into the source collection: break it rather than change the source
        image.save(path, format="PNG", compress_level=1)
    return [str(p.relative_to(train)) for p in chosen]


def index_records(index: Path) -> dict[str, int]:
    """path -> id of every live item of the index's live generation."""
    from moco_retrieval.indexer.index_dir import IndexDirectory

    with IndexDirectory.open(index) as d:
        ids = d.index.ids()
        return {rec["path"]: rec["id"] for rec in d.records(ids) if rec is not None}


def serve_and_query(index: Path, queries: list[Path], log_dir: Path, env: dict, requests: int = 200) -> dict:
    import httpx

    port = free_port()
    log = open(log_dir / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moco_retrieval", "serve", str(index), "--port", str(port), "--no-ui"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise StageFailed(f"moco serve did not start; see {log_dir / 'serve.log'}")
            time.sleep(0.2)

        def ask(i: int) -> tuple[str, int, float, int]:
            route = "/api/search" if i % 2 == 0 else "/api/classify"
            data = queries[i % len(queries)].read_bytes()
            tic = time.perf_counter()
            r = httpx.post(url + route, files={"image": ("q.png", data, "image/png")}, params={"k": 10}, timeout=60)
            n = (
                len(r.json().get("results" if route == "/api/search" else "neighbors", []))
                if r.status_code == 200
                else 0
            )
            return route, r.status_code, time.perf_counter() - tic, n

        tic = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(2 * requests)))
        wall = time.monotonic() - tic
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    bad = [a for a in answers if a[1] != 200 or a[3] != 10]
    text = (log_dir / "serve.log").read_text(errors="replace")
    if bad or "Traceback (most recent call last)" in text:
        raise StageFailed(f"serve: {len(bad)} bad answers (first {bad[:3]}); see {log_dir / 'serve.log'}")
    latencies = sorted(a[2] for a in answers)
    return {
        "requests": len(answers),
        "seconds": round(wall, 1),
        "req_per_s": round(len(answers) / wall, 1),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-fashion-mnist", type=Path, help="bench/real_datasets.py's fashion_mnist folder")
    p.add_argument("--train", type=Path, help="labeled training folder (instead of --from-fashion-mnist)")
    p.add_argument("--test", type=Path, help="labeled test folder")
    p.add_argument("--work", type=Path, required=True, help="scratch folder (runs, cache, index; reused)")
    p.add_argument("--time-budget", default="5m", help="moco train's budget (default 5m)")
    p.add_argument("--train-args", default="", help="more moco train options, e.g. '--arch resnet18 --image-size 32'")
    p.add_argument("--name", default="fmnist60k", help="results file: bench/results/acceptance_<name>.json")
    args = p.parse_args()

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.from_fashion_mnist:
        train, test = fashion_mnist_split(args.from_fashion_mnist, work)
    elif args.train and args.test:  # linked into the work folder: the update step changes files
        train, test = work / "data" / "train", args.test.resolve()
        if not train.is_dir():
            shutil.copytree(args.train.resolve(), train, copy_function=os.link)
    else:
        p.error("give --from-fashion-mnist or both --train and --test")
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    env = dict(os.environ, MOCO_CACHE_DIR=str(work / "cache"), PYTHONUNBUFFERED="1")
    moco = [sys.executable, "-m", "moco_retrieval"]
    from moco_retrieval.trainer.config import parse_duration

    budget = parse_duration(args.time_budget)
    n_train = count_images(train)
    result = {
        "benchmark": "acceptance",
        "train_dir": str(train),
        "test_dir": str(test),
        "train_images": n_train,
        "test_images": count_images(test),
        "time_budget": args.time_budget,
        "train_args": args.train_args,
        "host": {"cpus": os.cpu_count()},
        "stages": {},
        "ok": False,
    }
    stages = result["stages"]
    out = OUT / f"acceptance_{args.name}.json"
    try:
        for run in ("run1", "run2"):
            shutil.rmtree(work / run, ignore_errors=True)
        extra = args.train_args.split()
        stages["train"] = run_stage(
            "train",
            moco + ["train", str(train), "--out", str(work / "run1"), "--time-budget", args.time_budget, *extra],
            budget + 600,
            logs,
            env,
        )  # + the first decode of the whole folder
        stages["train_again"] = run_stage(
            "train_again",
            moco + ["train", str(train), "--out", str(work / "run2"), "--time-budget", "60s", *extra],
            60 + 300,
            logs,
            env,
        )
        log2 = (logs / "train_again.log").read_text(errors="replace")
        cache_lines = [line for line in log2.splitlines() if "image_cache" in line and " decoded" in line]
        stages["train_again"]["cache_log"] = cache_lines
        if not cache_lines or not all(re.search(r"\b0 decoded\b", line) for line in cache_lines):
            raise StageFailed(f"the second run decoded images again: {cache_lines}")
        onnx = work / "encoder.onnx"
        stages["export"] = run_stage(
            "export", moco + ["export", str(work / "run1"), "--out", str(onnx)], 300, logs, env
        )
        stages["eval"] = run_stage(
            "eval",
            moco
            + [
                "eval",
                "knn",
                "--train",
                str(train),
                "--test",
                str(test),
                str(onnx),
                "--out",
                str(work / "eval_knn.json"),
                "--pixels",
            ],
            900,
            logs,
            env,
        )
        evaluated = json.loads((work / "eval_knn.json").read_text())
        stages["eval"]["results"] = evaluated["results"]
        stages["eval"]["over_pixels"] = evaluated.get("over_pixels")
        index = work / "index"
        shutil.rmtree(index, ignore_errors=True)
        stages["index"] = run_stage(
            "index",
            moco + ["index", str(train), "--model", str(onnx), "--out", str(index), "--no-progress"],
            600,
            logs,
            env,
        )
        before = index_records(index)
        if len(before) != n_train:
            raise StageFailed(f"the index holds {len(before)} items, the folder {n_train} images")
        changed = change_one_percent(train)
        stages["update"] = run_stage(
            "update",
            moco + ["index", str(train), "--model", str(onnx), "--out", str(index), "--no-progress"],
            300,
            logs,
            env,
        )
        after = index_records(index)
        kept = [path for path in before if path not in set(changed)]
        if len(after) != n_train or any(after[path] != before[path] for path in kept):
            raise StageFailed("after the update the index does not match the folder (count or unchanged ids)")
        stages["update"]["changed_files"] = len(changed)
        queries = sorted(test.rglob("*.png"))[:200]
        stages["serve"] = serve_and_query(index, queries, logs, env)
        result["ok"] = True
    except StageFailed as exc:
        result["error"] = str(exc)
        print(f"FAILED: {exc}", file=sys.stderr)
    finally:
        OUT.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
