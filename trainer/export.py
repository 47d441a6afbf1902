"""ONNX export of a trained encoder: the query backbone (projection and prediction heads removed, never the
momentum encoder) wrapped so the file takes raw pixels and returns unit-length embeddings.

The file's contract is :mod:`contracts.encoder_format` (read back by ``indexer.encoder``): uint8
``[N, H, W, 3]`` RGB in, L2-normalized float32 ``[N, D]`` out, and ``metadata_props`` carrying everything a
client needs (format and version, image size, resize policy, mean/std, embedding dim, arch, MoCo version,
run id).

Every export is checked before it is published: ONNX Runtime against PyTorch on real images from the run's
data (generated shapes when the data is gone), batch sizes 1 and 7. The file is written to a temporary name
in the output folder and renamed only after the check passes, so a failed export leaves nothing behind.

We use torch's TorchScript-based exporter (``dynamo=False``): it needs no extra dependency, traces ResNets
and timm ViTs alike with a dynamic batch axis, and is what timm's own ``onnx_export`` uses.
"""

from __future__ import annotations

import copy
import functools
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moco_retrieval.contracts.atomic import atomic_path, output_errors
from moco_retrieval.contracts.encoder_format import (
    DECLARED_BOUNDS,
    ENCODER_FORMAT,
    ENCODER_FORMAT_VERSION,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INPUT_NAME,
    OUTPUT_NAME,
    RESIZE_POLICY,
    encode_metadata,
    model_label,
)
from moco_retrieval.contracts.errors import (
    ArtifactError,
    ConfigError,
    DataError,
    ExportError,
    OutputError,
)
from moco_retrieval.contracts.images import check_image, decode_image, iter_image_files
from moco_retrieval.trainer.bn_statistics import refit_for_export
from moco_retrieval.trainer.config import VITS
from moco_retrieval.trainer.embedding_size import EmbeddingSize, embedding_size
from moco_retrieval.trainer.mirror_average import readout
from moco_retrieval.trainer.small_map_conv import use_plain_convs
from moco_retrieval.trainer.whitening import fit_for_export, sample_images

if TYPE_CHECKING:
    from moco_retrieval.trainer.config import TrainConfig

LOG = logging.getLogger(__name__)

DEFAULT_OPSET = 17  # LayerNormalization is a single op from 17 on (ViT); ONNX Runtime >= 1.14 runs it
MIN_OPSET, MAX_OPSET = 14, 20  # 14: scaled-dot-product attention decomposes; 20: newest we have verified
VERIFY_BATCH_SIZES = (1, 7)


@dataclass(frozen=True)
class ParityTolerance:
    """How close ONNX Runtime must be to PyTorch: ``max_abs`` over all entries (None: not checked) and the
    smallest per-row cosine similarity."""

    max_abs: float | None
    min_cosine: float


FP32_TOLERANCE = ParityTolerance(max_abs=1e-4, min_cosine=0.9999)
FP16_TOLERANCE = ParityTolerance(max_abs=None, min_cosine=0.999)


@dataclass
class ParityCheck:
    """One verification figure: ONNX Runtime vs PyTorch on ``batch_size`` images."""

    batch_size: int
    max_abs: float
    min_cosine: float
    passed: bool

    def describe(self, tolerance: ParityTolerance) -> str:
        limit = f"<= {tolerance.max_abs:g}" if tolerance.max_abs is not None else "not checked"
        return (
            f"batch {self.batch_size}: max |onnx - torch| {self.max_abs:.2e} ({limit}), "
            f"min cosine {self.min_cosine:.6f} (>= {tolerance.min_cosine:g}) "
            f"{'ok' if self.passed else 'MISMATCH'}"
        )


@dataclass
class ExportResult:
    """What :func:`export_encoder` wrote and how it was checked."""

    path: Path
    metadata: dict[str, str]
    checks: list[ParityCheck] = field(default_factory=list)
    tolerance: ParityTolerance = FP32_TOLERANCE
    image_source: str = ""  # where the verification images came from
    seconds: float = 0.0


class EncoderGraph(nn.Module):
    """The exported computation: uint8 ``[N, H, W, 3]`` RGB -> float32 ``[N, D]`` unit vectors.

    Mirrors ``eval_transform``'s tensor steps (``ToDtype(scale=True)`` then ``Normalize``) so the pixels a
    client sends are treated exactly as in evaluation. With ``half`` the backbone runs in float16 while the
    input scaling and the L2 normalization stay in float32.
    """

    def __init__(self, backbone: nn.Module, half: bool = False, whitening: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.half = half
        self.whitening = whitening  # trainer.whitening.PcaWhitening, applied in float32 even with ``half``
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # NHWC uint8 -> NCHW in [0, 1]
        x = (x - self.mean) / self.std
        if self.half:
            x = x.to(torch.float16)
        features = self.backbone(x).to(torch.float32)  # NxD
        if self.whitening is not None:
            features = self.whitening(features)  # NxD'
        return F.normalize(features, dim=1)


# -- checkpoint -> backbone ------------------------------------------------------------------------------------
def load_backbone(checkpoint: str | Path) -> tuple[nn.Module, "TrainConfig", dict]:
    """Rebuild a checkpoint's query backbone in eval mode on the CPU (the heads and momentum encoder dropped).

    Args:
        checkpoint: a checkpoint file or a run directory (its ``checkpoint_last.pt``).

    Returns:
        ``(backbone, config, checkpoint dict)``; ``backbone`` maps ``[N, 3, H, W]`` float to ``[N, D]``.

    Raises:
        ArtifactError: missing or unreadable file, not a moco-retrieval checkpoint, or weights that do not
            fit the configuration stored with them.
    """
    from moco_retrieval.trainer.checkpoint import load_checkpoint, strip_wrappers
    from moco_retrieval.trainer.config import TrainConfig
    from moco_retrieval.trainer.variants import build_model

    if Path(checkpoint).suffix.lower() == ".onnx":
        raise ArtifactError(
            f"{checkpoint} is an ONNX file, not a checkpoint; pass the run directory or a "
            "checkpoint_*.pt from `moco train`"
        )
    ckpt = load_checkpoint(checkpoint)
    where = ckpt.get("run_id") or str(checkpoint)
    if not isinstance(ckpt.get("config"), dict) or not isinstance(ckpt.get("model"), dict):
        raise ArtifactError(
            f"checkpoint {checkpoint} has no model configuration or weights; export a checkpoint "
            "written by `moco train`"
        )
    try:
        cfg = TrainConfig.from_dict(ckpt["config"])
        model = build_model(cfg, bn_splits=1)
    except ConfigError as exc:
        raise ArtifactError(
            f"cannot rebuild the model of checkpoint {checkpoint} ({exc}); it was written by a "
            "different moco-retrieval version"
        ) from exc
    try:
        model.load_state_dict(strip_wrappers(ckpt["model"]))
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ArtifactError(f"weights of checkpoint {checkpoint} do not fit its configuration ({first})") from exc
    backbone = model.backbone.float().eval()
    LOG.info(
        "loaded %s: MoCo v%d %s, epoch %s, run %s", checkpoint, cfg.moco_version, cfg.arch, ckpt.get("epoch"), where
    )
    return backbone, cfg, ckpt


@torch.no_grad()
def embedding_dim(backbone: nn.Module, image_size: int) -> int:
    """D of ``backbone`` at ``image_size``, by running one zero image."""
    return int(backbone(torch.zeros(1, 3, image_size, image_size)).shape[1])


# -- verification images ---------------------------------------------------------------------------------------
def _first_images(root: Path, count: int) -> list[Path]:
    """Up to ``count`` readable images under ``root`` in walk order, without scanning the whole tree."""
    found: list[Path] = []
    for entry in iter_image_files(root):
        if entry.skip_reason is None and check_image(root / entry.path) is None:
            found.append(root / entry.path)
            if len(found) == count:
                break
    return found


def verification_images(
    data_dir: str | None, image_size: int, count: int = max(VERIFY_BATCH_SIZES)
) -> tuple[np.ndarray, str]:
    """``count`` images as the encoder's input, uint8 ``[count, image_size, image_size, 3]``, and their source.

    Real images from ``data_dir`` through torchvision's evaluation resize and center crop when at least
    ``count`` are readable there; generated shapes otherwise.
    """
    from torchvision.transforms import v2 as T

    geometry = T.Compose([T.Resize(image_size, antialias=True), T.CenterCrop(image_size)])
    if data_dir and Path(data_dir).is_dir():
        paths = _first_images(Path(data_dir), count)
        if len(paths) == count:
            try:
                batch = np.stack([np.asarray(geometry(decode_image(p)), dtype=np.uint8) for p in paths])
                return batch, f"{count} images from {data_dir}"
            except DataError as exc:
                LOG.warning("cannot use images of %s for verification (%s); using generated ones", data_dir, exc)
    from moco_retrieval.trainer.demo_data import CLASSES, draw_shape

    rng = np.random.default_rng(0)
    batch = np.stack([np.asarray(draw_shape(CLASSES[i % len(CLASSES)], rng, image_size)) for i in range(count)])
    return batch.astype(np.uint8), f"{count} generated images (the run's data {data_dir} is not available)"


@torch.no_grad()
def reference_embeddings(backbone: nn.Module, images: np.ndarray, whitening: nn.Module | None = None) -> np.ndarray:
    """PyTorch float32 embeddings of uint8 ``[N, H, W, 3]`` images: torchvision's ``ToDtype(scale=True)`` and
    ``Normalize`` (the tail of ``eval_transform``), the backbone, the whitening if any, L2 normalization ->
    ``[N, D]``."""
    from torchvision.transforms import v2 as T

    to_input = T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    x = to_input(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())
    features = backbone(x)
    if whitening is not None:
        features = whitening(features)
    return F.normalize(features, dim=1).numpy()


def compare(onnx_out: np.ndarray, torch_out: np.ndarray, tolerance: ParityTolerance) -> ParityCheck:
    """Max absolute difference and smallest row cosine between two ``[N, D]`` embedding arrays."""
    a, b = onnx_out.astype(np.float64), torch_out.astype(np.float64)
    max_abs = float(np.abs(a - b).max())
    cosine = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    min_cosine = float(cosine.min())
    ok = min_cosine >= tolerance.min_cosine and (tolerance.max_abs is None or max_abs <= tolerance.max_abs)
    return ParityCheck(batch_size=a.shape[0], max_abs=max_abs, min_cosine=min_cosine, passed=bool(ok))


def verify_onnx(
    path: Path,
    backbone: nn.Module,
    images: np.ndarray,
    tolerance: ParityTolerance,
    whitening: nn.Module | None = None,
) -> list[ParityCheck]:
    """Run the file on ONNX Runtime (CPU) at batch sizes 1 and ``len(images)`` against ``backbone`` in PyTorch.

    Args:
        path: the ONNX file to check.
        backbone: the float32 PyTorch backbone it was exported from (eval mode).
        images: uint8 ``[N, H, W, 3]``.
        whitening: the whitening baked into the file, if any.

    Returns:
        one :class:`ParityCheck` per batch size.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's Fail / InvalidGraph / NotImplemented
        raise ExportError(f"ONNX Runtime cannot load the exported graph: {exc}".splitlines()[0]) from exc
    reference = reference_embeddings(backbone, images, whitening)
    checks = []
    for n in sorted({1, len(images)}):
        (out,) = session.run([OUTPUT_NAME], {INPUT_NAME: images[:n]})
        if out.dtype != np.float32 or out.shape != reference[:n].shape:
            raise ExportError(
                f"exported graph returns {out.dtype} {list(out.shape)}, expected float32 {list(reference[:n].shape)}"
            )
        checks.append(compare(out, reference[:n], tolerance))
    return checks


# -- export ----------------------------------------------------------------------------------------------------
def _check_output(out: Path) -> None:
    """Fail early, before any work, when ``out`` cannot be written."""
    if out.is_dir():
        raise OutputError(f"--out {out} is a folder; give a file name such as {out / 'encoder.onnx'}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"cannot write {out}: {parent} is a file, not a folder; choose another --out")
            break
    with output_errors(out, "choose another --out"):
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.probe.").close()  # deleted on close


def _metadata(
    arch: str,
    moco_version: int,
    run_id: str,
    epoch: int,
    step: int,
    sized: EmbeddingSize,
    dim: int,
    fp16: bool,
    opset: int,
    whitening: str,
    mirror_average: bool,
    bn_statistics: str,
    init: dict | None = None,
) -> dict[str, str]:
    """The encoder file's ``metadata_props`` (:mod:`contracts.encoder_format`); ``sized``: the size it embeds at
    and the size it trained at; ``whitening``: what :func:`trainer.whitening.fit_for_export` did, in one line;
    ``bn_statistics``: what :func:`trainer.bn_statistics.refit_for_export` did, in one line; ``init``: the
    source of a ``moco export --init`` (``init_source``, ``init_sha256``, ``init_layout``)."""
    image_size = sized.size
    values = {
        "format": ENCODER_FORMAT,
        "format_version": ENCODER_FORMAT_VERSION,
        "image_size": image_size,
        "trained_image_size": sized.trained,
        "embedding_dim": dim,
        "arch": arch,
        "moco_version": moco_version,
        "resize": RESIZE_POLICY,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "input": f"{INPUT_NAME}: uint8 [N, {image_size}, {image_size}, 3] RGB",
        "output": f"{OUTPUT_NAME}: float32 [N, {dim}] L2-normalized",
        "precision": "fp16" if fp16 else "fp32",
        "whitening": whitening,
        "mirror_average": int(mirror_average),
        "bn_statistics": bn_statistics,
        "run_id": run_id,
        "checkpoint_epoch": epoch,
        "checkpoint_step": step,
        "opset": opset,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(init or {}),
    }
    return encode_metadata(values)


def build_onnx(
    backbone: nn.Module,
    image_size: int,
    metadata: dict[str, str],
    fp16: bool,
    opset: int,
    whitening: nn.Module | None = None,
):
    """Trace :class:`EncoderGraph` around ``backbone`` (and ``whitening``) into an ``onnx.ModelProto`` carrying
    ``metadata``.

    Raises:
        ExportError: the exporter or the ONNX checker failed.
    """
    import io

    import onnx

    # the file holds the standard network, its convolutions as Conv nodes that every runtime and execution
    # provider optimises, not the training's products for small maps (trainer.small_map_conv), whose tap
    # matrices the graph would rebuild from the kernels at every call
    traced = use_plain_convs(copy.deepcopy(backbone))
    graph = EncoderGraph(traced.half() if fp16 else traced, half=fp16, whitening=whitening).eval()
    example = torch.zeros(2, image_size, image_size, 3, dtype=torch.uint8)  # 2, so nothing specialises on N=1
    buffer = io.BytesIO()
    try:
        # The TorchScript exporter warns that it is deprecated and that traced shapes are constants; both
        # are known and covered by the dynamic-batch verification.
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                graph,
                (example,),
                buffer,
                dynamo=False,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                opset_version=opset,
                do_constant_folding=True,
            )
        model = onnx.load_from_string(buffer.getvalue())
        # The exporter leaves D symbolic after the L2 norm; state the contract's fixed [batch, D].
        out_shape = model.graph.output[0].type.tensor_type.shape
        out_shape.dim[0].dim_param = "batch"
        out_shape.dim[1].dim_value = int(metadata["embedding_dim"])
        onnx.helper.set_model_props(model, metadata)
        model.producer_name = "moco-retrieval"
        model.doc_string = f"{model_label(metadata)} encoder: {metadata['input']} -> {metadata['output']}"
        onnx.checker.check_model(model)
    except Exception as exc:  # the exporter raises many types (RuntimeError, OnnxExporterError, checker errors)
        raise ExportError(
            f"ONNX export of {metadata['arch']} failed at opset {opset}: {type(exc).__name__}: {exc}".splitlines()[0]
            + "; try another --opset"
        ) from exc
    return model


def export_encoder(
    checkpoint: str | Path,
    out: str | Path,
    fp16: bool = False,
    opset: int | None = None,
    verify: bool = True,
    tolerance: ParityTolerance | None = None,
    whiten: str | int = "auto",
    data_dir: str | None = None,
    image_size: int | None = None,
    mirror_average: bool | None = None,
    refit_bn: str = "auto",
) -> ExportResult:
    """Export a checkpoint's query backbone to ``out`` as an encoder ONNX file, verified against PyTorch.

    Args:
        checkpoint: checkpoint file or run directory.
        out: the ``.onnx`` file to write (replaced atomically if it exists).
        fp16: store the backbone in float16 (half the size; input and output stay uint8 / float32).
        opset: ONNX opset version, ``MIN_OPSET``-``MAX_OPSET`` (None: ``DEFAULT_OPSET``).
        verify: compare ONNX Runtime with PyTorch before publishing the file.
        tolerance: parity limits; default :data:`FP32_TOLERANCE` or :data:`FP16_TOLERANCE`.
        whiten: ``auto`` (PCA whitening fitted on the data folder's images, :mod:`trainer.whitening`), ``off``,
            or the number of whitened dimensions to keep.
        data_dir: the images to fit the whitening on and verify with (default: the run's own data folder).
        image_size: the side the encoder embeds at (default: :func:`trainer.embedding_size.embedding_size`'s
            choice: twice the training size for a ResNet whose last map is 1x1 there, else the training size).
        mirror_average: embed each image as the mean of its and its mirror's features (default
            :data:`trainer.mirror_average.MIRROR_AVERAGE`; twice the encoder's work).
        refit_bn: ``auto`` (re-estimate the BatchNorm statistics on the whitening's sample of ``data_dir`` at
            the embedding size, :mod:`trainer.bn_statistics`) or ``off`` (keep the training's).

    Returns:
        :class:`ExportResult` with the checks' figures.

    Raises:
        ConfigError: opset out of range, a bad ``whiten``, ``refit_bn`` or ``image_size``. OutputError: ``out``
            not writable.
        ArtifactError: checkpoint missing, unreadable or foreign.
        DataError: ``whiten`` is a number and the data folder cannot provide enough images.
        ExportError: export failed or the check found a mismatch (no file is left at ``out``).
    """
    tic = time.perf_counter()
    opset = _check_opset(opset)
    out = Path(out)
    _check_output(out)
    image_size = _check_image_size(image_size)  # before the checkpoint is read
    backbone, cfg, ckpt = load_backbone(checkpoint)
    if image_size is not None and cfg.arch in VITS and image_size != cfg.image_size:
        raise ConfigError(
            f"--image-size {image_size}: a ViT embeds at the size it trained at ({cfg.image_size} px); to change "
            f"it, export with --init {checkpoint} --image-size {image_size} (its position embeddings are resized)"
        )
    sized = embedding_size(backbone, cfg.image_size, image_size)
    LOG.info("embedding at %d px: %s", sized.size, sized.why)
    data_dir = data_dir or cfg.data_dir
    workers = min(cfg.workers, 2)
    listing = functools.cache(functools.partial(sample_images, data_dir))  # the folder walked once, when needed
    # the BN statistics before the whitening: it must see the refitted network
    bn_statistics = refit_for_export(backbone, sized.size, data_dir, refit_bn, workers=workers, listing=listing)
    backbone, mirror_average = readout(backbone, mirror_average)
    whitening, whitened = fit_for_export(backbone, sized.size, data_dir, whiten, workers=workers, listing=listing)
    dim = whitening.out_dim if whitening is not None else embedding_dim(backbone, sized.size)
    metadata = _metadata(
        cfg.arch,
        cfg.moco_version,
        ckpt.get("run_id") or cfg.run_id or "",
        int(ckpt.get("epoch", 0)),
        int(ckpt.get("step", 0)),
        sized,
        dim,
        fp16,
        opset,
        whitened,
        mirror_average,
        bn_statistics,
    )
    return _publish(backbone, whitening, sized.size, metadata, out, fp16, opset, verify, tolerance, data_dir, tic)


def export_pretrained(
    source: str | Path,
    out: str | Path,
    arch: str | None = None,
    image_size: int | None = None,
    fp16: bool = False,
    opset: int | None = None,
    verify: bool = True,
    tolerance: ParityTolerance | None = None,
    data_dir: str | None = None,
    whiten: str | int = "auto",
    mirror_average: bool | None = None,
) -> ExportResult:
    """Export the backbone of a weights file (``moco export --init SOURCE``: torchvision, timm, MoCo v1/v2/v3
    or a moco-retrieval run, :mod:`trainer.pretrained`) without training, verified like every export. Its
    metadata records the source's file name (``init_source``), sha256 (``init_sha256``) and layout. Its BatchNorm
    statistics stay the weights file's (no :mod:`trainer.bn_statistics` re-estimation: unmeasured for such weights).

    Args:
        source: the weights file (or run directory).
        arch: checked against the file's architecture when given.
        image_size: the encoder's input size (default: the weights' own, 224 for ResNets of other code, or for
            a ResNet whose last map is 1x1 there twice that: :mod:`trainer.embedding_size`).
        data_dir: a folder of images to fit the whitening on and verify with (default: none, so no whitening
            under ``auto``, and generated images for the verification).
        others: as :func:`export_encoder`.

    Raises:
        as :func:`export_encoder`, and ConfigError when ``arch`` or ``image_size`` contradicts the file.
    """
    from moco_retrieval.trainer.pretrained import backbone_from_source

    tic = time.perf_counter()
    opset = _check_opset(opset)
    out = Path(out)
    _check_output(out)
    built = backbone_from_source(source, arch, _check_image_size(image_size))
    pre = built.pretrained
    backbone, mirror_average = readout(built.backbone.eval(), mirror_average)
    whitening, whitened = fit_for_export(backbone, built.image_size, data_dir, whiten)
    dim = whitening.out_dim if whitening is not None else embedding_dim(backbone, built.image_size)
    metadata = _metadata(
        pre.arch,
        pre.moco_version,
        pre.run_id,
        pre.epoch,
        pre.step,
        built.sized,
        dim,
        fp16,
        opset,
        whitened,
        mirror_average,
        "the weights file's (--init)",
        init={"init_source": pre.name, "init_sha256": pre.sha256, "init_layout": pre.layout},
    )
    return _publish(backbone, whitening, built.image_size, metadata, out, fp16, opset, verify, tolerance, data_dir, tic)


def _check_image_size(image_size: int | None) -> int | None:
    low, high = DECLARED_BOUNDS["image_size"]
    if image_size is not None and not low <= image_size <= high:
        raise ConfigError(f"--image-size must be between {low} and {high} pixels, got {image_size}")
    return image_size


def _check_opset(opset: int | None) -> int:
    opset = DEFAULT_OPSET if opset is None else opset
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ConfigError(f"--opset must be between {MIN_OPSET} and {MAX_OPSET}, got {opset}")
    return opset


def _publish(
    backbone: nn.Module,
    whitening: nn.Module | None,
    image_size: int,
    metadata: dict[str, str],
    out: Path,
    fp16: bool,
    opset: int,
    verify: bool,
    tolerance: ParityTolerance | None,
    data_dir: str | None,
    tic: float,
) -> ExportResult:
    """Trace, check against PyTorch and publish ``out`` atomically (nothing is left there when a check fails)."""
    tolerance = tolerance or (FP16_TOLERANCE if fp16 else FP32_TOLERANCE)
    LOG.info(
        "exporting %s (%s-d) to ONNX opset %d, %s",
        metadata["arch"],
        metadata["embedding_dim"],
        opset,
        metadata["precision"],
    )
    model = build_onnx(backbone, image_size, metadata, fp16, opset, whitening)

    import onnx

    result = ExportResult(path=out, metadata=metadata, tolerance=tolerance)
    with atomic_path(out, hint="choose another --out") as tmp:  # published only once the check passed
        try:
            with output_errors(out, "free some space or choose another --out"):  # a full disk: one line
                onnx.save(model, str(tmp))
        except ValueError as exc:
            raise OutputError(f"cannot write {out}: {exc}") from exc
        if verify:
            images, result.image_source = verification_images(data_dir, image_size)
            LOG.info("checking ONNX Runtime against PyTorch on %s", result.image_source)
            result.checks = verify_onnx(tmp, backbone, images, tolerance, whitening)
            for check in result.checks:
                LOG.debug("parity %s", check.describe(tolerance))
            if not all(c.passed for c in result.checks):
                figures = "; ".join(c.describe(tolerance) for c in result.checks)
                raise ExportError(f"ONNX Runtime does not match PyTorch ({figures}); nothing written to {out}")
    result.seconds = time.perf_counter() - tic
    LOG.debug("wrote %s (%.1f MB) in %.1f s", out, out.stat().st_size / 1e6, result.seconds)
    return result
