"""Measure a trained encoder the way the MoCo papers do: weighted k-NN and a linear probe, top-1 accuracy.

Both protocols read two labeled folders (``<folder>/<class>/<image>``): the training folder is the k-NN
memory bank or the probe's training set, the test folder is classified. Features come from an *embedder*,
anything with ``image_size``, ``embedding_dim`` and ``embed_images(paths) -> [N, D] float32`` L2-normalised
rows. :class:`CheckpointEmbedder` wraps a run directory or checkpoint; the exported ONNX encoder
(``indexer.encoder.OnnxEncoder``) has the same interface, and ``moco eval`` picks it for ``.onnx`` files, so
a user can evaluate exactly the model they will serve. This module never imports the indexer itself.

Features are computed once per folder and kept in memory; the linear probe then trains on those cached
features (frozen backbone, eval-mode BN, no augmentation) for as many epochs as it likes.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from moco_retrieval.contracts.atomic import output_errors, write_json_atomic
from moco_retrieval.contracts.encoder_format import RESIZE_POLICY, preprocess_image
from moco_retrieval.contracts.errors import DataError
from moco_retrieval.contracts.images import decode_image
from moco_retrieval.contracts.knn import EVAL_KS, KNN_TEMPERATURE
from moco_retrieval.trainer.eval_transform import eval_transform
from moco_retrieval.trainer.imagefolder import scan_image_folder
from moco_retrieval.trainer.knn import PIXEL_KS, knn_predict, pixel_knn_accuracy

LOG = logging.getLogger(__name__)

EVAL_FORMAT = "moco-retrieval/eval"
EVAL_VERSION = 1


# ---- data ------------------------------------------------------------------------------------------------
@dataclass
class LabeledImages:
    """Absolute image paths of one labeled folder and their class indices into a shared class list."""

    folder: Path
    paths: list[str]
    labels: np.ndarray  # [N] int64


def load_labeled_pair(train_dir: str | Path, test_dir: str | Path) -> tuple[LabeledImages, LabeledImages, list[str]]:
    """Scan a training and a test folder into one label space (the sorted union of their class names).

    Raises:
        DataError: a folder is missing, empty, or not split into at least two class subfolders.
    """
    scanned = {}
    for role, folder in (("--train", train_dir), ("--test", test_dir)):
        images = scan_image_folder(folder)
        if len(images.classes) < 2 or any(label is None for label in images.labels):
            raise DataError(
                f"{role} folder {folder} needs its images in at least two class subfolders (<folder>/<class>/<image>)"
            )
        scanned[role] = images
    classes = sorted(set(scanned["--train"].classes) | set(scanned["--test"].classes))
    index = {name: i for i, name in enumerate(classes)}
    out = []
    for images in scanned.values():
        paths = [str(Path(images.root) / rel) for rel in images.paths]
        out.append(LabeledImages(Path(images.root), paths, np.array([index[x] for x in images.labels], dtype=np.int64)))
    missing = sorted(set(scanned["--test"].classes) - set(scanned["--train"].classes))
    if missing:
        LOG.warning("test classes absent from the training folder (always misclassified): %s", ", ".join(missing))
    return out[0], out[1], classes


class _Images(Dataset):
    """Image files through ``transform``; an unreadable one raises, or with ``skip_unreadable`` gives None."""

    def __init__(self, paths: list, transform, skip_unreadable: bool = False):
        self.paths, self.transform, self.skip_unreadable = paths, transform, skip_unreadable

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor | None:
        try:
            return self.transform(decode_image(self.paths[i]))
        except DataError as exc:
            if self.skip_unreadable:
                return None
            raise DataError(f"cannot decode {exc}; remove or replace the file") from exc


def _stack_readable(batch: list) -> torch.Tensor | None:
    readable = [x for x in batch if x is not None]
    return torch.stack(readable) if readable else None


@torch.no_grad()
def embed_files(
    backbone: nn.Module,
    paths: list,
    image_size: int,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    workers: int = 0,
    skip_unreadable: bool = False,
) -> torch.Tensor:
    """L2-normalised features of image files through the evaluation transform: ``[N, D]`` float32 on the CPU,
    in ``paths`` order (``backbone`` in eval mode on ``device``).

    Args:
        skip_unreadable: leave out files that do not decode (N is then the readable count) instead of raising.

    Raises:
        DataError: a file does not decode (without ``skip_unreadable``), naming it.
    """
    loader = DataLoader(
        _Images(paths, eval_transform(image_size), skip_unreadable),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_stack_readable,
    )
    feats = [F.normalize(backbone(x.to(device)).float(), dim=1).cpu() for x in loader if x is not None]
    return torch.cat(feats) if feats else torch.zeros(0, 0)


# ---- embedders ---------------------------------------------------------------------------------------------
class CheckpointEmbedder:
    """Features of a backbone from a run directory, a checkpoint, or any weights file ``--init`` reads
    (torchvision, timm, MoCo v1/v2/v3: :mod:`trainer.pretrained`), in eval mode with eval preprocessing.

    Args:
        path: run directory (its ``checkpoint_last.pt``), checkpoint or weights file.
        device: torch device, or ``auto``.
        batch_size, workers: feature-extraction loader settings.
        arch: checked against the file's architecture when given.
        image_size: input size (default: a run's own, a ViT's own, 224 for a ResNet of other code).
        mirror_average: average each image's features with its mirror's, as ``moco export`` does by default
            (default :data:`trainer.mirror_average.MIRROR_AVERAGE`).
    """

    kind = "checkpoint"

    def __init__(
        self,
        path: str | Path,
        device: str = "auto",
        batch_size: int = 256,
        workers: int = 0,
        arch: str | None = None,
        image_size: int | None = None,
        mirror_average: bool | None = None,
    ):
        # the export's loader: the same checks and the same backbone as `moco export` (heavy imports, so lazy)
        from moco_retrieval.trainer.device import resolve_device
        from moco_retrieval.trainer.export import embedding_dim
        from moco_retrieval.trainer.mirror_average import readout
        from moco_retrieval.trainer.pretrained import backbone_from_source

        built = backbone_from_source(path, arch, image_size)
        self.source = built.pretrained
        self.path = self.source.path
        self.image_size = built.image_size
        self.trained_image_size = built.sized.trained
        backbone, self.mirror_average = readout(built.backbone, mirror_average)
        self.embedding_dim = embedding_dim(backbone, self.image_size)  # one zero image, on the CPU
        self.device = resolve_device(device)
        self.backbone = backbone.to(self.device).eval()
        self.epoch = self.source.epoch
        self.batch_size, self.workers = batch_size, workers

    def describe(self) -> dict:
        """What was evaluated, for the results JSON."""
        src = self.source
        doc = {
            "model_kind": self.kind,
            "checkpoint": str(self.path),
            "arch": src.arch,
            "moco_version": src.moco_version,
            "epoch": self.epoch,
            "run_id": src.run_id,
            "image_size": self.image_size,
            "trained_image_size": self.trained_image_size,
            "embedding_dim": self.embedding_dim,
            "mirror_average": int(self.mirror_average),
            "resize": RESIZE_POLICY,
        }
        if src.layout != "moco-retrieval":
            doc.update(model_kind="weights", layout=src.layout, sha256=src.sha256)
        return doc

    @torch.no_grad()
    def embed_images(self, paths: list[str]) -> np.ndarray:
        """L2-normalised backbone features of image files: ``[N, D]`` float32, in ``paths`` order."""
        if not paths:
            return np.zeros((0, self.embedding_dim), dtype=np.float32)
        return embed_files(self.backbone, paths, self.image_size, self.device, self.batch_size, self.workers).numpy()


def describe_embedder(embedder) -> dict:
    """The embedder's own description, or its common attributes (an ONNX encoder and its metadata)."""
    if hasattr(embedder, "describe"):
        return embedder.describe()
    meta = getattr(embedder, "metadata", {})
    return {
        "model_kind": "onnx" if str(getattr(embedder, "path", "")).endswith(".onnx") else type(embedder).__name__,
        "path": str(getattr(embedder, "path", "")),
        "sha256": getattr(embedder, "sha256", None),
        **{k: meta[k] for k in ("arch", "moco_version", "run_id", "resize") if k in meta},
        "image_size": int(embedder.image_size),
        "embedding_dim": int(embedder.embedding_dim),
    }


def embed(embedder, images: LabeledImages, chunk: int = 512) -> np.ndarray:
    """Features of every image of ``images``, ``chunk`` files at a time: ``[N, D]`` float32, checked for shape."""
    parts = []
    with tqdm(
        total=len(images.paths), desc=f"features {images.folder.name}", unit="img", leave=False, dynamic_ncols=True
    ) as bar:
        for start in range(0, len(images.paths), chunk):
            paths = images.paths[start : start + chunk]
            parts.append(np.asarray(embedder.embed_images(paths), dtype=np.float32))
            bar.update(len(paths))
    x = np.concatenate(parts)
    if x.ndim != 2 or x.shape[0] != len(images.paths):
        raise DataError(f"the model returned features of shape {x.shape} for {len(images.paths)} images")
    LOG.info("embedded %d images of %s: %d-d", x.shape[0], images.folder, x.shape[1])
    return x


# ---- protocols -------------------------------------------------------------------------------------------
def knn_top1(
    xb: np.ndarray,
    yb: np.ndarray,
    xq: np.ndarray,
    yq: np.ndarray,
    num_classes: int,
    ks: tuple[int, ...] = EVAL_KS,
    temperature: float = KNN_TEMPERATURE,
    leave_one_out: bool = False,
) -> list[dict]:
    """Weighted k-NN top-1 accuracy (cosine similarity, votes ``exp(s / T)``), one row per k.

    Args:
        xb, yb: memory bank, [N, D] L2-normalised and [N] class indices.
        xq, yq: queries, [M, D] L2-normalised and [M] class indices.
        num_classes: size of the label space.
        ks: neighbour counts; each is clipped to N (the row records both).
        leave_one_out: the queries are the memory bank itself (same rows, same order): each one's own row is
            left out of its vote, so a sample never finds itself.

    Returns:
        ``[{"metric": "knn_top1", "k": k, "k_used": k', "temperature": T, "top1": acc}, ...]``.
    """
    n, d = xb.shape
    if xq.shape[1] != d:
        raise DataError(f"query features are {xq.shape[1]}-d but the memory bank is {d}-d")
    xb_t, yb_t, xq_t = torch.from_numpy(xb), torch.from_numpy(yb), torch.from_numpy(xq)
    rows = []
    for k in ks:
        scores = knn_predict(xb_t, yb_t, xq_t, num_classes, k=k, temperature=temperature, exclude_self=leave_one_out)
        top1 = float((scores.argmax(1).numpy() == yq).mean())
        k_used = min(k, n - 1 if leave_one_out else n)
        rows.append({"metric": "knn_top1", "k": k, "k_used": k_used, "temperature": temperature, "top1": top1})
    return rows


def load_pixels(images: LabeledImages, image_size: int) -> np.ndarray:
    """The model's input crops of every image, as the encoder sees them before normalisation: uint8
    ``[N, image_size, image_size, 3]`` (:func:`contracts.encoder_format.preprocess_image`).

    Raises:
        DataError: an image cannot be decoded (which one, in one line).
    """
    out = np.empty((len(images.paths), image_size, image_size, 3), dtype=np.uint8)
    for i, path in enumerate(tqdm(images.paths, desc=f"pixels {images.folder.name}", unit="img", leave=False)):
        try:
            out[i] = preprocess_image(decode_image(path, target_size=image_size), image_size, RESIZE_POLICY)
        except DataError as exc:
            raise DataError(f"cannot decode {exc}; remove or replace the file") from exc
    return out


def trained_image_size(embedder) -> int:
    """The size ``embedder``'s network trained at (a checkpoint's, or an encoder file's ``trained_image_size``),
    which its export may embed above (:mod:`trainer.embedding_size`): the raw-pixel baseline's size."""
    meta = getattr(embedder, "metadata", None) or {}
    return int(getattr(embedder, "trained_image_size", None) or meta.get("trained_image_size") or embedder.image_size)


def pixel_baseline(
    train: LabeledImages, test: LabeledImages, image_size: int, leave_one_out: bool, ks: tuple[int, ...] = PIXEL_KS
) -> list[dict]:
    """Plain L2 k-NN (majority vote) on the raw pixels of the model's input crops: what the model's features must
    beat to be worth computing (issue 20). One row per k, like :func:`knn_top1`'s."""
    xb = torch.from_numpy(load_pixels(train, image_size))
    yb = torch.from_numpy(train.labels)
    if leave_one_out:
        accuracy = pixel_knn_accuracy(xb, yb, ks=ks)
    else:
        xq = torch.from_numpy(load_pixels(test, image_size))
        accuracy = pixel_knn_accuracy(xb, yb, xq, torch.from_numpy(test.labels), ks=ks)
    n = len(train.paths) - (1 if leave_one_out else 0)
    return [
        {"metric": "pixel_knn_top1", "k": k, "k_used": min(k, n), "distance": "l2", "top1": accuracy[k]} for k in ks
    ]


def pixel_margin(results: list[dict]) -> dict | None:
    """The model's best k-NN top-1 against the raw pixels' best, in points, or None without both."""
    model = [r["top1"] for r in results if r["metric"] == "knn_top1"]
    pixels = [r["top1"] for r in results if r["metric"] == "pixel_knn_top1"]
    if not model or not pixels:
        return None
    return {"model_best": max(model), "pixels_best": max(pixels), "points": round(100 * (max(model) - max(pixels)), 2)}


@dataclass
class LinearProbeConfig:
    """The linear probe's training: SGD with momentum and a cosine schedule on standardised frozen features."""

    epochs: int = 100  # passes over the cached training features
    batch_size: int = 256  # features per step
    lr: float = 0.1  # peak learning rate (cosine-decayed to 0)
    weight_decay: float = 0.0  # L2 on the classifier weights
    seed: int = 0  # initialisation and shuffling


def linear_probe(
    xb: np.ndarray,
    yb: np.ndarray,
    xq: np.ndarray,
    yq: np.ndarray,
    num_classes: int,
    cfg: LinearProbeConfig = LinearProbeConfig(),
) -> dict:
    """Train a linear classifier on frozen features, return its top-1 accuracy on the test features.

    The features are standardised with the training set's mean and standard deviation (BN without affine
    parameters, as in MAE's probe), so one learning rate suits any backbone.

    Args:
        xb, yb: training features [N, D] and class indices [N].
        xq, yq: test features [M, D] and class indices [M].
        num_classes: size of the label space.

    Returns:
        ``{"metric": "linear_top1", "top1": test acc, "train_top1": train acc, **cfg}``.
    """
    n, d = xb.shape
    if xq.shape[1] != d:
        raise DataError(f"test features are {xq.shape[1]}-d but the training features are {d}-d")
    gen = torch.Generator().manual_seed(cfg.seed)
    x, y = torch.from_numpy(xb), torch.from_numpy(yb)
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    x = (x - mean) / std
    classifier = nn.Linear(d, num_classes)
    with torch.no_grad():
        classifier.weight.normal_(0, 0.01, generator=gen)
        classifier.bias.zero_()
    optimizer = torch.optim.SGD(classifier.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-n // cfg.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * steps_per_epoch)
    for _ in tqdm(range(cfg.epochs), desc="linear probe", leave=False, dynamic_ncols=True):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            loss = F.cross_entropy(classifier(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    with torch.no_grad():
        train_top1 = float((classifier(x).argmax(1) == y).float().mean())
        pred = classifier((torch.from_numpy(xq) - mean) / std).argmax(1).numpy()
    return {"metric": "linear_top1", "top1": float((pred == yq).mean()), "train_top1": train_top1, **asdict(cfg)}


# ---- end to end ------------------------------------------------------------------------------------------
def evaluate(
    protocol: str,
    embedder,
    train_dir: str | Path,
    test_dir: str | Path,
    ks: tuple[int, ...] = EVAL_KS,
    temperature: float = KNN_TEMPERATURE,
    probe: LinearProbeConfig | None = None,
    pixels: bool = False,
) -> dict:
    """Run ``protocol`` (``knn`` or ``linear``) on ``embedder`` and return the results document (see
    :func:`write_results`); with ``pixels``, k-NN also on the raw pixels (:func:`pixel_baseline`)."""
    if protocol not in ("knn", "linear"):
        raise ValueError(f"unknown protocol {protocol!r}")
    train, test, classes = load_labeled_pair(train_dir, test_dir)
    same = os.path.realpath(train.folder) == os.path.realpath(test.folder)  # a test set the model "has seen"
    xb = embed(embedder, train)
    xq = xb if same else embed(embedder, test)
    if protocol == "knn":
        if same:
            LOG.warning(
                "--train and --test are the same folder: k-NN is measured leave-one-out (each image voted "
                "on by the others)"
            )
        results = knn_top1(xb, train.labels, xq, test.labels, len(classes), ks, temperature, leave_one_out=same)
        if pixels:
            results += pixel_baseline(train, test, trained_image_size(embedder), leave_one_out=same)
    else:
        if same:
            LOG.warning(
                "--train and --test are the same folder: the linear probe's figure is its training "
                "accuracy, not a test accuracy; pass a held-out --test folder"
            )
        results = [linear_probe(xb, train.labels, xq, test.labels, len(classes), probe or LinearProbeConfig())]
    doc = {
        "format": EVAL_FORMAT,
        "format_version": EVAL_VERSION,
        "protocol": protocol,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": describe_embedder(embedder),
        "train_dir": str(train.folder),
        "test_dir": str(test.folder),
        "train_images": len(train.paths),
        "test_images": len(test.paths),
        "classes": classes,
        "results": results,
        "same_folder": same,
        "leave_one_out": same and protocol == "knn",
    }
    margin = pixel_margin(results)
    if margin is not None:
        doc["over_pixels"] = margin
    return doc


def write_results(doc: dict, path: str | Path) -> Path:
    """Write the results document as JSON, atomically. Raises OutputError."""
    path = Path(path)
    hint = "pass --out with a writable path"
    with output_errors(path, hint):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc, hint)
    return path


def format_table(doc: dict) -> str:
    """The results as a small text table (one row per measured accuracy)."""
    rows = []
    for r in doc["results"]:
        if r["metric"] == "knn_top1":
            k = f"k={r['k']}" + (f" (clipped to {r['k_used']})" if r["k_used"] != r["k"] else "")
            rows.append((f"k-NN top-1, {k}, T={r['temperature']:g}", f"{100 * r['top1']:.2f}%"))
        elif r["metric"] == "pixel_knn_top1":
            k = f"k={r['k']}" + (f" (clipped to {r['k_used']})" if r["k_used"] != r["k"] else "")
            rows.append((f"raw pixels, L2 k-NN top-1, {k}", f"{100 * r['top1']:.2f}%"))
        else:
            rows.append((f"linear probe top-1 ({r['epochs']} epochs)", f"{100 * r['top1']:.2f}%"))
            rows.append(("linear probe train top-1", f"{100 * r['train_top1']:.2f}%"))
    width = max(len(name) for name, _ in rows)
    model = doc["model"]
    lines = [
        f"model: {model.get('checkpoint', model.get('path', ''))} ({model['model_kind']}, "
        f"{model['embedding_dim']}-d features at {model['image_size']} px)",
        f"train: {doc['train_dir']} ({doc['train_images']} images), test: {doc['test_dir']} "
        f"({doc['test_images']} images), {len(doc['classes'])} classes",
        f"{'metric':<{width}}  top-1",
    ]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    margin = doc.get("over_pixels")
    if margin is not None:
        verdict = "above" if margin["points"] > 0 else "not above"
        lines.append(
            f"the model's best k-NN is {margin['points']:+.2f} points against raw pixels' best: {verdict} the "
            "baseline" + ("" if margin["points"] > 0 else "; train longer, or start from weights that see (--init)")
        )
    return "\n".join(lines)
