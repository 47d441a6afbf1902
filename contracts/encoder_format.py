"""The encoder file's contract: what ``moco export`` writes and ``moco index`` / ``moco serve`` / ``moco eval``
read. Pure Python + numpy + Pillow (no torch, no onnx).

An encoder is one ONNX file. Input :data:`INPUT_NAME`, uint8 ``[N, H, W, 3]`` RGB at the model's size, dynamic
N; the graph casts, scales by 1/255, normalizes with :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD` and
transposes to NCHW itself. Output :data:`OUTPUT_NAME`, float32 ``[N, D]``, L2-normalized rows.

``metadata_props`` are strings. :data:`REQUIRED_KEYS` say what the file is (``format`` =
:data:`ENCODER_FORMAT`, ``format_version``) and how to feed it (``image_size``, ``resize``, ``mean``/``std``,
``embedding_dim``); provenance keys (``run_id``, ``checkpoint_epoch``, ``trained_image_size``: the size the
network trained at where it embeds at another, :mod:`trainer.embedding_size` ...) may follow. An encoder exported
straight from weights (``moco export --init``) also names them: ``init_source`` (the file's name),
``init_sha256`` and ``init_layout``; its ``moco_version`` is 0 when MoCo did not train them (torchvision, timm).
``whitening`` says whether the graph PCA-whitens its features before the final normalization and on how many
images that was fitted (``pca 128 of 512 dims, 10000 images``; ``none (...)`` with why); older files lack it.
``mirror_average`` is 1 where the graph embeds each image as the mean of its and its left-right mirror's
features (:mod:`trainer.mirror_average`), 0 where not; files before 2026-12-06 lack it (and do not).
``bn_statistics`` says where the graph's BatchNorm statistics come from (``refit on 10000 images at 56 px``:
re-estimated at export, :mod:`trainer.bn_statistics`; ``training's (...)`` with why); files before 2026-12-07
lack it (and hold the training's).
:func:`encode_metadata` and :func:`decode_metadata` are each other's inverse; :func:`validate_metadata` is the
one check a reader runs.

The resize policy :data:`RESIZE_POLICY` (``shorter_side_center_crop``) is implemented by
:func:`preprocess_image`: resize the shorter side to ``image_size`` (the longer to ``int(size * long / short)``)
with PIL bilinear (antialiased), then center-crop a square with torchvision's offset rounding
``int(round((h - size) / 2))``. It equals torchvision's ``Resize(size)`` + ``CenterCrop(size)``, the trainer's
evaluation transform, so a model is served exactly as it was measured.
"""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError
from moco_retrieval.contracts.images import check_size

ENCODER_FORMAT = "moco-retrieval/encoder"
ENCODER_FORMAT_VERSION = 1
INPUT_NAME = "images"
OUTPUT_NAME = "embeddings"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE_POLICY = "shorter_side_center_crop"
RESIZE_POLICIES = (RESIZE_POLICY,)

# metadata_props are strings; these keys are decoded to numbers / lists, every other key stays a string.
INT_KEYS = (
    "format_version",
    "image_size",
    "trained_image_size",
    "embedding_dim",
    "moco_version",
    "opset",
    "checkpoint_epoch",
    "checkpoint_step",
    "mirror_average",
)
JSON_KEYS = ("mean", "std")
REQUIRED_KEYS = (
    "format",
    "format_version",
    "image_size",
    "embedding_dim",
    "arch",
    "moco_version",
    "resize",
    "mean",
    "std",
)


# what an index's manifest and `/api/info` say about the model (init_*: the weights file of an encoder made by
# `moco export --init`, present only there)
SUMMARY_KEYS = (
    "arch",
    "moco_version",
    "image_size",
    "embedding_dim",
    "resize",
    "precision",
    "whitening",
    "mirror_average",
    "bn_statistics",
    "run_id",
    "format_version",
    "init_source",
    "init_sha256",
)


def model_summary(meta: dict) -> dict:
    """The keys of an encoder's metadata that describe the model to a person (``SUMMARY_KEYS``, those present)."""
    return {k: meta[k] for k in SUMMARY_KEYS if k in meta}


DECLARED_BOUNDS = {"image_size": (8, 2048), "embedding_dim": (1, 65536)}  # what an encoder may declare


def encode_metadata(meta: dict) -> dict[str, str]:
    """Every value as the string stored in ``metadata_props`` (lists as JSON)."""
    return {key: json.dumps(list(value)) if key in JSON_KEYS else str(value) for key, value in meta.items()}


def decode_metadata(props: dict[str, str]) -> dict:
    """Decode raw ``metadata_props`` strings: ints for :data:`INT_KEYS`, float lists for :data:`JSON_KEYS`.

    Raises:
        ValueError: a typed key holds a value that does not parse.
    """
    meta: dict = {}
    for key, value in props.items():
        if key in INT_KEYS:
            meta[key] = int(value)
        elif key in JSON_KEYS:
            meta[key] = [float(v) for v in json.loads(value)]
        else:
            meta[key] = value
    return meta


def validate_metadata(props: dict[str, str], where: str) -> dict:
    """Decode and check the ``metadata_props`` of the file ``where``.

    Returns:
        The decoded metadata.

    Raises:
        ArtifactError: not a moco-retrieval encoder, keys missing or malformed, a newer format, an unknown
            resize policy.
    """
    if props.get("format") != ENCODER_FORMAT:
        raise ArtifactError(f"{where} is not a moco-retrieval encoder (create one with `moco export RUN_DIR`)")
    missing = [key for key in REQUIRED_KEYS if key not in props]
    if missing:
        raise ArtifactError(f"{where} lacks encoder metadata {', '.join(missing)}; export it again with `moco export`")
    try:
        meta = decode_metadata(props)
    except ValueError as exc:
        raise ArtifactError(f"{where} has malformed encoder metadata ({exc}); export it again") from exc
    if meta["format_version"] > ENCODER_FORMAT_VERSION:
        raise ArtifactError(
            f"{where} has encoder format {meta['format_version']}, newer than this moco-retrieval "
            f"reads ({ENCODER_FORMAT_VERSION}); upgrade moco-retrieval"
        )
    if meta["resize"] not in RESIZE_POLICIES:
        raise ArtifactError(f"{where} declares resize policy {meta['resize']!r}, unknown here; upgrade moco-retrieval")
    if len(meta["mean"]) != 3 or len(meta["std"]) != 3:
        raise ArtifactError(f"{where} has inconsistent encoder metadata; export it again with `moco export`")
    for key, (low, high) in DECLARED_BOUNDS.items():
        if not low <= meta[key] <= high:  # an image_size of 60,000 made every decode allocate 10.8 GB
            raise ArtifactError(
                f"{where} declares {key} {meta[key]}, outside {low}-{high}; export it again with `moco export`"
            )
    return meta


def model_label(meta: dict) -> str:
    """``"MoCo v2 resnet18"``, or ``"resnet18 (weights from r18.pth)"`` for weights MoCo did not train."""
    version = int(meta.get("moco_version") or 0)
    if version:
        return f"MoCo v{version} {meta.get('arch')}"
    source = meta.get("init_source")
    return f"{meta.get('arch')}" + (f" (weights from {source})" if source else "")


NORM_TOLERANCE = 1e-2  # an encoder's output rows must have L2 norm 1 within this (fp16 graphs included)


def check_embeddings(x, n: int, embedding_dim: int, where: str):
    """Refuse what an encoder returned unless it is float ``[n, embedding_dim]``, finite, rows L2-normalized.

    An encoder that outputs NaN, unnormalized or 1-D vectors built an index with exit 0 and served garbage.

    Raises:
        ArtifactError: naming ``where`` and what is wrong.
    """
    shape = tuple(getattr(x, "shape", ()))
    if shape != (n, embedding_dim):
        raise ArtifactError(
            f"{where} returned embeddings of shape {list(shape)}, not the declared [{n}, "
            f"{embedding_dim}]; export it again with `moco export`"
        )
    if not np.isfinite(x).all():
        raise ArtifactError(f"{where} returned non-finite embeddings (NaN or inf); export it again with `moco export`")
    norms = np.linalg.norm(x, axis=1)
    if n and np.abs(norms - 1).max() > NORM_TOLERANCE:
        raise ArtifactError(
            f"{where} returned embeddings that are not L2-normalized (norms {norms.min():.3g}-"
            f"{norms.max():.3g}); export it again with `moco export`"
        )
    return x


def resized_size(width: int, height: int, image_size: int) -> tuple[int, int]:
    """``(w, h)`` after resizing the shorter side to ``image_size`` (torchvision's ``Resize(int)`` rule)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = image_size, int(image_size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def preprocess_image(image: Image.Image, image_size: int, resize: str = RESIZE_POLICY) -> np.ndarray:
    """One RGB image as the encoder's input row: uint8 ``[image_size, image_size, 3]`` (see the module docstring).

    A pure function: safe to call in worker processes without a session. Its intermediate (the resized image
    before the crop) is at most ``MAX_ASPECT_RATIO`` squares of ``image_size``: more elongated images are refused.

    Raises:
        ConfigError: unknown ``resize`` policy.
        DataError: an image more elongated than ``contracts.images.MAX_ASPECT_RATIO``, or without pixels.
    """
    if resize not in RESIZE_POLICIES:
        raise ConfigError(f"unknown resize policy {resize!r}; expected one of {', '.join(RESIZE_POLICIES)}")
    problem = check_size(*image.size, max_pixels=image.width * image.height)  # the resize is bounded by the aspect
    if problem is not None:
        raise DataError(f"cannot resize: {problem}")
    if image.mode != "RGB":
        image = image.convert("RGB")
    new_w, new_h = resized_size(*image.size, image_size)
    if (new_w, new_h) != image.size:  # torchvision skips the resample when the size already matches
        image = image.resize((new_w, new_h), resample=Image.BILINEAR)
    top = int(round((new_h - image_size) / 2.0))  # Python's round (half to even), as torchvision does
    left = int(round((new_w - image_size) / 2.0))
    image = image.crop((left, top, left + image_size, top + image_size))
    return np.asarray(image, dtype=np.uint8)
