"""The one place that opens an encoder: an ``encoder.onnx`` written by ``moco export`` on ONNX Runtime, plus
the exact preprocessing its metadata declares, so the indexer and the server embed an image identically.

The file's contract (DESIGN.md): input ``images``, uint8 ``[N, H, W, 3]`` RGB at the model's size, dynamic N;
the graph casts, normalizes and transposes; output ``embeddings``, float32 ``[N, D]``, L2-normalized.
``metadata_props`` say what the file is (``format`` = :data:`ONNX_FORMAT`, ``format_version``) and how to feed
it (``image_size``, ``resize``, ``mean``/``std``), plus its provenance (``arch``, ``moco_version``, ``run_id``).

Preprocessing reproduces ``trainer.augment.eval_transform`` on a PIL image without torch: resize the shorter
side to ``image_size`` (the longer to ``int(size * long / short)``) with PIL bilinear (antialiased), then
center-crop a square with torchvision's offset rounding ``int(round((h - size) / 2))``. The uint8 pixels go
into the graph, which does the /255 and mean/std normalization itself.

Imports numpy, Pillow, onnx and onnxruntime only (never torch).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.errors import ArtifactError, ConfigError, DataError
from trainer.imagefolder import MAX_IMAGE_PIXELS

LOG = logging.getLogger(__name__)

ONNX_FORMAT = "moco-retrieval/encoder"
ONNX_FORMAT_VERSION = 1
INPUT_NAME = "images"
OUTPUT_NAME = "embeddings"
RESIZE_POLICIES = ("shorter_side_center_crop",)
DEVICES = ("auto", "cpu", "cuda")  # and cuda:N for the N-th GPU

# metadata_props are strings; these keys are decoded to numbers / lists, every other key stays a string.
INT_KEYS = ("format_version", "image_size", "embedding_dim", "moco_version", "opset", "checkpoint_epoch",
            "checkpoint_step")
JSON_KEYS = ("mean", "std")
REQUIRED_KEYS = ("format", "format_version", "image_size", "embedding_dim", "arch", "moco_version", "resize",
                 "mean", "std")


# -- metadata ------------------------------------------------------------------------------------------------
def decode_metadata(props: dict[str, str]) -> dict:
    """Decode raw ``metadata_props`` strings: ints for :data:`INT_KEYS`, lists for :data:`JSON_KEYS`.

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


def encode_metadata(meta: dict) -> dict[str, str]:
    """The inverse of :func:`decode_metadata`: every value as the string stored in ``metadata_props``."""
    return {key: json.dumps(list(value)) if key in JSON_KEYS else str(value) for key, value in meta.items()}


def _check_ours(props: dict[str, str], where: str) -> dict:
    """Decode and validate the metadata of ``where``; ArtifactError unless it is an encoder we can use."""
    if props.get("format") != ONNX_FORMAT:
        raise ArtifactError(f"{where} is not a moco-retrieval encoder (create one with `moco export RUN_DIR`)")
    missing = [key for key in REQUIRED_KEYS if key not in props]
    if missing:
        raise ArtifactError(f"{where} lacks encoder metadata {', '.join(missing)}; export it again with `moco export`")
    try:
        meta = decode_metadata(props)
    except ValueError as exc:
        raise ArtifactError(f"{where} has malformed encoder metadata ({exc}); export it again") from exc
    if meta["format_version"] > ONNX_FORMAT_VERSION:
        raise ArtifactError(f"{where} has encoder format {meta['format_version']}, newer than this moco-retrieval "
                            f"reads ({ONNX_FORMAT_VERSION}); upgrade moco-retrieval")
    if meta["resize"] not in RESIZE_POLICIES:
        raise ArtifactError(f"{where} declares resize policy {meta['resize']!r}, unknown here; upgrade moco-retrieval")
    if meta["image_size"] < 1 or meta["embedding_dim"] < 1 or len(meta["mean"]) != 3 or len(meta["std"]) != 3:
        raise ArtifactError(f"{where} has inconsistent encoder metadata; export it again with `moco export`")
    return meta


def _load_model_proto(source: Path | bytes, where: str):
    import onnx

    try:
        if isinstance(source, bytes):
            return onnx.load_from_string(source)
        return onnx.load(str(source), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-derived and OSError variants
        raise ArtifactError(f"{where} is not a readable ONNX file ({type(exc).__name__}); "
                            "pass an encoder.onnx from `moco export`") from exc


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ArtifactError(f"encoder not found: {path} (create one with `moco export RUN_DIR --out {path}`)")
    if not path.is_file():
        raise ArtifactError(f"encoder path is not a file: {path}")


def read_encoder_metadata(path: str | os.PathLike) -> dict:
    """The decoded ``metadata_props`` of an encoder file (ints, floats and lists decoded).

    Raises:
        ArtifactError: missing, unreadable, not written by ``moco export``, or of a newer format.
    """
    path = Path(path)
    _check_file(path)
    model = _load_model_proto(path, str(path))
    return _check_ours({p.key: p.value for p in model.metadata_props}, str(path))


# -- images ----------------------------------------------------------------------------------------------------
def load_image(source: str | os.PathLike | bytes) -> Image.Image:
    """Decode an image file or its bytes fully and convert it to RGB (grayscale, palette and alpha included).

    Raises:
        DataError: missing file, empty, corrupt or truncated data, not an image, or more than
            ``MAX_IMAGE_PIXELS`` pixels (decompression bomb; refused before decoding).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        name, data = "image data", bytes(source)
        if not data:
            raise DataError("image data is empty")
        opener = io.BytesIO(data)
    else:
        name, opener = str(source), source
        try:
            if os.path.getsize(source) == 0:
                raise DataError(f"{name}: empty file")
        except FileNotFoundError:
            raise DataError(f"image not found: {name}") from None
        except OSError as exc:
            raise DataError(f"cannot read {name}: {exc.strerror or exc}") from exc
    try:
        with Image.open(opener) as im:
            width, height = im.size
            if width * height > MAX_IMAGE_PIXELS:
                raise DataError(f"{name}: too large ({width}x{height} pixels, limit {MAX_IMAGE_PIXELS})")
            im.load()
            return im.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise DataError(f"{name}: too large ({exc})".splitlines()[0]) from exc
    except Image.UnidentifiedImageError as exc:  # its text holds the repr of our file object: say it plainly
        raise DataError(f"{name}: not a readable image (unknown or corrupt format)") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{name}: not a readable image ({type(exc).__name__}: {exc})".splitlines()[0]) from exc


def preprocess_image(image: Image.Image, image_size: int, resize: str = "shorter_side_center_crop") -> np.ndarray:
    """One image as the encoder's input row: uint8 ``[image_size, image_size, 3]`` RGB.

    Equals torchvision's ``Resize(image_size)`` + ``CenterCrop(image_size)`` on the PIL image (the evaluation
    transform the model was measured with), before its float conversion. A pure function: safe to call in
    worker processes without a session.

    Raises:
        ConfigError: unknown ``resize`` policy.
    """
    if resize not in RESIZE_POLICIES:
        raise ConfigError(f"unknown resize policy {resize!r}; expected one of {', '.join(RESIZE_POLICIES)}")
    if image.mode != "RGB":
        image = image.convert("RGB")
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = image_size, int(image_size * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) != (width, height):  # torchvision skips the resample when the size already matches
        image = image.resize((new_w, new_h), resample=Image.BILINEAR)
    top = int(round((new_h - image_size) / 2.0))  # Python's round (half to even), as torchvision does
    left = int(round((new_w - image_size) / 2.0))
    image = image.crop((left, top, left + image_size, top + image_size))
    return np.asarray(image, dtype=np.uint8)


# -- the session ---------------------------------------------------------------------------------------------
def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask when the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _session_options(threads: int, quiet: bool):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # 3 = errors only; 4 = fatal only, used when probing for a GPU that is allowed to be absent.
    options.log_severity_level = 4 if quiet else 3
    return options


def open_session(model: str | os.PathLike | bytes, device: str = "auto", threads: int | None = None):
    """An ONNX Runtime session on the GPU when one really works, else on the CPU.

    ``auto`` tries the CUDA execution provider when this onnxruntime build has it and keeps it only if the
    created session actually runs on it (the provider list alone says nothing about drivers or devices);
    otherwise a CPU session with ``threads`` intra-op threads (default: the usable cores).

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
            quiet = device == "auto"
            if quiet:  # hack: the provider loader logs through the global logger, not the session's
                ort.set_default_logger_severity(4)
            try:
                session = ort.InferenceSession(model_arg, _session_options(cpu_threads, quiet=quiet),
                                               providers=[("CUDAExecutionProvider", {"device_id": device_id}),
                                                          "CPUExecutionProvider"])
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
    session = ort.InferenceSession(model_arg, _session_options(cpu_threads, quiet=False),
                                   providers=["CPUExecutionProvider"])
    return session, "CPUExecutionProvider"


class OnnxEncoder:
    """An ``encoder.onnx`` ready to embed images: ``uint8 [N, H, W, 3] -> float32 [N, D]`` (L2-normalized).

    Attributes:
        path: the file; sha256: hex digest of its bytes (indexes record it to detect a model change).
        metadata: decoded ``metadata_props``; image_size: H = W; embedding_dim: D.
        provider: ``"CUDAExecutionProvider"`` or ``"CPUExecutionProvider"``.
    """

    def __init__(self, path: str | os.PathLike, device: str = "auto", threads: int | None = None):
        """Open ``path`` on ``device`` (auto, cpu, cuda or cuda:N) with ``threads`` CPU threads (default: cores).

        Raises:
            ArtifactError: missing file, not ONNX, or not an encoder written by ``moco export``.
            ConfigError: ``cuda`` requested but not usable, or a bad ``device``/``threads``.
        """
        self.path = Path(path)
        _check_file(self.path)
        data = self.path.read_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        model = _load_model_proto(data, str(self.path))
        self.metadata = _check_ours({p.key: p.value for p in model.metadata_props}, str(self.path))
        self.image_size = self.metadata["image_size"]
        self.embedding_dim = self.metadata["embedding_dim"]
        self.resize = self.metadata["resize"]
        self.session, self.provider = open_session(data, device, threads)
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if [i.name for i in inputs] != [INPUT_NAME] or OUTPUT_NAME not in [o.name for o in outputs]:
            raise ArtifactError(f"{self.path} does not have the encoder's '{INPUT_NAME}' -> '{OUTPUT_NAME}' "
                                "signature; export it again with `moco export`")
        LOG.info("encoder %s: %s, %d px, %d-d, on %s", self.path.name, self.metadata["arch"], self.image_size,
                 self.embedding_dim, self.provider)

    def __repr__(self) -> str:
        return (f"OnnxEncoder({str(self.path)!r}, arch={self.metadata['arch']}, image_size={self.image_size}, "
                f"embedding_dim={self.embedding_dim}, provider={self.provider})")

    def preprocess(self, image: Image.Image | str | os.PathLike | bytes) -> np.ndarray:
        """One image (PIL, path or bytes) as uint8 ``[H, W, 3]`` per this model's metadata."""
        if not isinstance(image, Image.Image):
            image = load_image(image)
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
            raise DataError(f"encoder input must be a numpy uint8 array [N, {size}, {size}, 3], "
                            f"got {type(batch).__name__}")
        if batch.dtype != np.uint8:
            raise DataError(f"encoder input must be uint8 pixels [N, {size}, {size}, 3], got dtype {batch.dtype}; "
                            "use preprocess() or preprocess_image() to make it")
        if batch.ndim != 4 or batch.shape[1:] != (size, size, 3):
            raise DataError(f"encoder input must have shape [N, {size}, {size}, 3], got {list(batch.shape)}; "
                            "use preprocess() or preprocess_image() to make it")
        if batch.shape[0] == 0:
            return np.zeros((0, self.embedding_dim), dtype=np.float32)
        (xb,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(batch)})
        return np.asarray(xb, dtype=np.float32)

    def embed_images(self, images: list) -> np.ndarray:
        """Embed PIL images, paths or encoded bytes: ``len(images)`` items -> float32 ``[N, D]``.

        Raises:
            DataError: an item that does not decode (the message names it).
        """
        size = self.image_size
        batch = np.stack([self.preprocess(image) for image in images]) if images else np.zeros(
            (0, size, size, 3), dtype=np.uint8)
        return self.embed(batch)
