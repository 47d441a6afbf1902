"""The one place that opens an encoder: an ``encoder.onnx`` written by ``moco export`` on ONNX Runtime, plus
the exact preprocessing its metadata declares, so the indexer and the server embed an image identically.

The file's contract (names, metadata, resize policy) is :mod:`contracts.encoder_format`; images are decoded
with :func:`contracts.images.decode_image`, as in training. The uint8 pixels go into the graph, which does
the /255 and mean/std normalization itself.

Imports numpy, Pillow, onnx and onnxruntime only (never torch).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from moco_retrieval.contracts.encoder_format import (
    INPUT_NAME,
    OUTPUT_NAME,
    check_embeddings,
    preprocess_image,
    validate_metadata,
)
from moco_retrieval.contracts.errors import ArtifactError, ConfigError, DataError, MocoError
from moco_retrieval.contracts.images import decode_image

LOG = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")  # and cuda:N for the N-th GPU


def _read_metadata_props(source: Path | bytes, where: str) -> dict[str, str]:
    """The raw ``metadata_props`` of an ONNX file or its bytes, read by ONNX Runtime with every graph optimization
    off (about 0.05 s for a ResNet-18 file). Not through the ``onnx`` package: importing it costs 0.7-0.8 s of
    a command's start-up (its ``ml_dtypes`` extension), more than reading the file does."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(
            source if isinstance(source, bytes) else str(source), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime's InvalidProtobuf, Fail, InvalidGraph ...: no common base
        raise _unloadable(exc, where) from exc
    return dict(session.get_modelmeta().custom_metadata_map)


def _unloadable(exc: Exception, where: str) -> ArtifactError:
    """The one-line error for a file ONNX Runtime refused: not ONNX at all, or a graph it cannot run."""
    if "protobuf" in str(exc).lower():
        return ArtifactError(
            f"{where} is not a readable ONNX file ({type(exc).__name__}); pass an encoder.onnx from `moco export`"
        )
    return ArtifactError(
        f"{where} cannot be loaded by ONNX Runtime ({str(exc).splitlines()[0][:200]}); "
        "export it again with `moco export`"
    )


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ArtifactError(f"encoder not found: {path} (create one with `moco export RUN_DIR --out {path}`)")
    if not path.is_file():
        raise ArtifactError(f"encoder path is not a file: {path}")


def _check_graph_shapes(path: Path, input_shape: list, output_shape: list, image_size: int, embedding_dim: int) -> None:
    """Refuse a graph whose fixed dimensions disagree with the size and dimension its metadata declares (such a
    file answered every search with a 500). Symbolic dimensions (the batch) are not checked.

    Raises:
        ArtifactError: naming the declared and the graph's value.
    """
    want_in, want_out = ["N", image_size, image_size, 3], ["N", embedding_dim]
    for what, shape, want in (("input", input_shape, want_in), ("output", output_shape, want_out)):
        fixed = [(got, w) for got, w in zip(shape or [], want) if isinstance(got, int) and isinstance(w, int)]
        if (shape and len(shape) != len(want)) or any(got != w for got, w in fixed):
            raise ArtifactError(
                f"{path}'s graph {what} has shape {list(shape)} but its metadata declares "
                f"{want}; export it again with `moco export`"
            )


def read_encoder_metadata(path: str | os.PathLike) -> dict:
    """The decoded ``metadata_props`` of an encoder file (ints, floats and lists decoded).

    Raises:
        ArtifactError: missing, unreadable, not written by ``moco export``, or of a newer format.
    """
    path = Path(path)
    _check_file(path)
    return validate_metadata(_read_metadata_props(path, str(path)), str(path))


# -- the session ---------------------------------------------------------------------------------------------
def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask when the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _session_options(threads: int, quiet: bool, spin: bool = True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # 3 = errors only; 4 = fatal only, used when probing for a GPU that is allowed to be absent.
    options.log_severity_level = 4 if quiet else 3
    # Spinning: intra-op threads busy-wait for the next piece of work instead of sleeping. Right for a run
    # that keeps the encoder busy (indexing); a server between requests burns the cores its HTTP work needs.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return options


@functools.cache
def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of the ``nvidia-*`` pip packages before a CUDA session is made: in a
    process that never imports torch (``moco index``, ``moco serve``) nothing else puts them on the loader's
    path (``onnxruntime.preload_dlls``, the documented remedy). What it prints about missing libraries goes
    to the debug log; the session's own check then says whether the provider works."""
    import onnxruntime as ort

    if not hasattr(ort, "preload_dlls") or (sys.platform == "linux" and not os.path.exists("/dev/nvidiactl")):
        return  # no NVIDIA driver: nothing to load the libraries for
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            ort.preload_dlls()
    except Exception as exc:  # a loader error is not ours to raise: the CPU is the fallback
        LOG.debug("onnxruntime.preload_dlls failed: %s", exc)
    if printed.getvalue().strip():
        LOG.debug("onnxruntime.preload_dlls: %s", " ".join(printed.getvalue().split()))


def open_session(model: str | os.PathLike | bytes, device: str = "auto", threads: int | None = None, spin: bool = True):
    """An ONNX Runtime session on the GPU when one really works, else on the CPU.

    ``auto`` tries the CUDA execution provider when this onnxruntime build has it and keeps it only if the
    created session actually runs on it (the provider list alone says nothing about drivers or devices);
    otherwise a CPU session with ``threads`` intra-op threads (default: the usable cores), which busy-wait
    between pieces of work when ``spin`` (fast for back-to-back batches, wasteful when work comes and goes).

    Returns:
        ``(session, provider)`` with provider ``"CUDAExecutionProvider"`` or ``"CPUExecutionProvider"``.

    Raises:
        ConfigError: unknown ``device``, or ``cuda``/``cuda:N`` requested where no GPU session can be created.
    """
    import onnxruntime as ort

    device_id = 0
    if device.startswith("cuda:") and device[5:].isdigit():
        device, device_id = "cuda", int(device[5:])
    if device not in DEVICES:
        raise ConfigError(f"unknown --device {device!r}; use auto, cpu, cuda or cuda:N")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {threads}")
    model_arg = model if isinstance(model, bytes) else str(model)
    cpu_threads = threads or available_cores()
    if device in ("auto", "cuda"):
        reason = "this onnxruntime build has no CUDA execution provider"
        if "CUDAExecutionProvider" in ort.get_available_providers():
            _preload_cuda_libraries()
            quiet = device == "auto"
            if quiet:  # hack: the provider loader logs through the global logger, not the session's
                ort.set_default_logger_severity(4)
            try:
                session = ort.InferenceSession(
                    model_arg,
                    _session_options(cpu_threads, quiet, spin),
                    providers=[("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"],
                )
                if session.get_providers()[0] == "CUDAExecutionProvider":
                    return session, "CUDAExecutionProvider"
                reason = "the CUDA execution provider could not start (no usable GPU, driver or CUDA libraries)"
            except Exception as exc:  # onnxruntime raises its own Fail/RuntimeException types
                reason = f"the CUDA execution provider failed: {exc}".splitlines()[0]
            finally:
                if quiet:
                    ort.set_default_logger_severity(2)  # onnxruntime's default: warnings and above
        if device == "cuda":
            raise ConfigError(f"--device cuda: {reason}; use --device cpu or auto")
        LOG.debug("encoder on CPU: %s", reason)
    session = ort.InferenceSession(
        model_arg, _session_options(cpu_threads, False, spin), providers=["CPUExecutionProvider"]
    )
    return session, "CPUExecutionProvider"


class OnnxEncoder:
    """An ``encoder.onnx`` ready to embed images: ``uint8 [N, H, W, 3] -> float32 [N, D]`` (L2-normalized).

    Attributes:
        path: the file; sha256: hex digest of its bytes (indexes record it to detect a model change).
        metadata: decoded ``metadata_props``; image_size: H = W; embedding_dim: D.
        provider: ``"CUDAExecutionProvider"`` or ``"CPUExecutionProvider"``.
    """

    def __init__(self, path: str | os.PathLike, device: str = "auto", threads: int | None = None, spin: bool = True):
        """Open ``path`` on ``device`` (auto, cpu, cuda or cuda:N) with ``threads`` CPU threads (default: cores),
        spin-waiting between runs when ``spin`` (see :func:`open_session`).

        Raises:
            ArtifactError: missing file, not ONNX, or not an encoder written by ``moco export``.
            ConfigError: ``cuda`` requested but not usable, or a bad ``device``/``threads``.
        """
        self.path = Path(path)
        _check_file(self.path)
        data = self.path.read_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        try:  # the metadata comes from this session: a second, metadata-only one cost 0.05 s of every start
            self.session, self.provider = open_session(data, device, threads, spin)
        except ConfigError:  # --device cuda refused: say so, unless the file itself is what failed
            validate_metadata(_read_metadata_props(data, str(self.path)), str(self.path))
            raise
        except MocoError:
            raise
        except Exception as exc:  # onnxruntime's InvalidProtobuf, Fail, InvalidGraph ...: no common base
            raise _unloadable(exc, str(self.path)) from exc
        props = dict(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = validate_metadata(props, str(self.path))
        self.image_size = self.metadata["image_size"]
        self.embedding_dim = self.metadata["embedding_dim"]
        self.resize = self.metadata["resize"]
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if [i.name for i in inputs] != [INPUT_NAME] or OUTPUT_NAME not in [o.name for o in outputs]:
            raise ArtifactError(
                f"{self.path} does not have the encoder's '{INPUT_NAME}' -> '{OUTPUT_NAME}' "
                "signature; export it again with `moco export`"
            )
        _check_graph_shapes(
            self.path,
            inputs[0].shape,
            next(o for o in outputs if o.name == OUTPUT_NAME).shape,
            self.image_size,
            self.embedding_dim,
        )
        LOG.info(
            "encoder %s: %s, %d px, %d-d, on %s",
            self.path.name,
            self.metadata["arch"],
            self.image_size,
            self.embedding_dim,
            self.provider,
        )

    def __repr__(self) -> str:
        return (
            f"OnnxEncoder({str(self.path)!r}, arch={self.metadata['arch']}, image_size={self.image_size}, "
            f"embedding_dim={self.embedding_dim}, provider={self.provider})"
        )

    def preprocess(self, image: Image.Image | str | os.PathLike | bytes) -> np.ndarray:
        """One image (PIL, path or bytes) as uint8 ``[H, W, 3]`` per this model's metadata."""
        if not isinstance(image, Image.Image):
            image = decode_image(image, target_size=self.image_size)
        return preprocess_image(image, self.image_size, self.resize)

    def embed(self, batch: np.ndarray) -> np.ndarray:
        """Embed a preprocessed batch.

        Args:
            batch: uint8 ``[N, H, W, 3]`` RGB with ``H = W = image_size`` (N may be 0).

        Returns:
            float32 ``[N, D]``, rows L2-normalized.

        Raises:
            DataError: not a numpy array, not uint8, or not ``[N, image_size, image_size, 3]``.
        """
        size = self.image_size
        if not isinstance(batch, np.ndarray):
            raise DataError(
                f"encoder input must be a numpy uint8 array [N, {size}, {size}, 3], got {type(batch).__name__}"
            )
        if batch.dtype != np.uint8:
            raise DataError(
                f"encoder input must be uint8 pixels [N, {size}, {size}, 3], got dtype {batch.dtype}; "
                "use preprocess() or preprocess_image() to make it"
            )
        if batch.ndim != 4 or batch.shape[1:] != (size, size, 3):
            raise DataError(
                f"encoder input must have shape [N, {size}, {size}, 3], got {list(batch.shape)}; "
                "use preprocess() or preprocess_image() to make it"
            )
        if batch.shape[0] == 0:
            return np.zeros((0, self.embedding_dim), dtype=np.float32)
        (xb,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(batch)})
        return check_embeddings(np.asarray(xb, dtype=np.float32), len(batch), self.embedding_dim, str(self.path))

    def embed_images(self, images: list) -> np.ndarray:
        """Embed PIL images, paths or encoded bytes: ``len(images)`` items -> float32 ``[N, D]``.

        Raises:
            DataError: an item that does not decode (the message names it).
        """
        size = self.image_size
        batch = (
            np.stack([self.preprocess(image) for image in images])
            if images
            else np.zeros((0, size, size, 3), dtype=np.uint8)
        )
        return self.embed(batch)
