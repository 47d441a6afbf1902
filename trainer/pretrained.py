"""Pretrained weights from a local file (``--init SOURCE``): recognise its key layout, infer its architecture,
and map it onto our backbone and heads. The one home of this contract: ``moco train --init``, ``moco export
--init`` and ``moco eval`` all read SOURCE through :func:`read_pretrained`.

Layouts recognised (nothing is ever downloaded):

- ``state_dict``: a torchvision or timm state dict, flat or under ``state_dict`` / ``model``, keys possibly
  prefixed by ``module.`` (DDP) or ``_orig_mod.`` (torch.compile). A ResNet has ``conv1.weight`` [64, 3, k, k]
  (k = 7: ImageNet stem, 3: small stem), ``bn1.*``, ``layerL.B.*`` and a classifier ``fc.*`` (ignored). A ViT
  has ``cls_token`` [1, 1, D], ``pos_embed`` [1, 1 + G*G, D], ``patch_embed.proj.weight`` [D, 3, P, P],
  ``blocks.I.*``, ``norm.*`` and a classifier ``head.*`` (ignored). Files ending in ``.safetensors`` are read
  with safetensors; every other file with ``torch.load(weights_only=True)``.
- ``moco_v2``: facebookresearch/moco (v1/v2): ``{"state_dict": {"module.encoder_q.<ResNet>", ...}}``. Its
  head ``fc.0`` [H, D] / ``fc.2`` [C, H] (v2's MLP) is our MoCo v2 projector ``encoder_q.head.0`` / ``.2``; v1's
  linear ``fc`` [C, D] has no counterpart and is ignored, as are ``encoder_k.*`` and the queue.
- ``moco_v3``: facebookresearch/moco-v3: ``{"state_dict": {"module.base_encoder.<ResNet or ViT>",
  "module.momentum_encoder.*", "module.predictor.*"}}``. The projector is ``base_encoder.fc.*`` (ResNet) or
  ``base_encoder.head.*`` (ViT) in MoCo v3's MLP layout (Linear, BN, ReLU, ..., affine-free BN), the same
  indices as our :func:`trainer.moco.build_mlp`; ``predictor.*`` is ours. ``momentum_encoder.*`` is ignored.
- ``moco-retrieval``: a run directory or checkpoint written by ``moco train``.

Both our encoders start from the backbone (the key encoder is a copy of the query encoder); heads are loaded
where the source has ones of the same shapes, and fresh otherwise. Every mismatch is one line naming what was
expected and what was found, with the first differing keys.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moco_retrieval.contracts.errors import ArtifactError, ConfigError
from moco_retrieval.trainer.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, LAST, safe_load, strip_wrappers
from moco_retrieval.trainer.config import NARROW_RESNETS, RESNETS, STEM_KERNEL, VITS
from moco_retrieval.trainer.embedding_size import EmbeddingSize, embedding_size

LOG = logging.getLogger(__name__)

# (bottleneck blocks?, blocks per stage) -> torchvision name; only RESNETS are built here
_RESNET_LAYOUTS = {
    (False, (2, 2, 2, 2)): "resnet18",
    (False, (3, 4, 6, 3)): "resnet34",
    (True, (3, 4, 6, 3)): "resnet50",
    (True, (3, 4, 23, 3)): "resnet101",
    (True, (3, 8, 36, 3)): "resnet152",
}
_VIT_WIDTHS = {192: "vit_tiny", 384: "vit_small", 768: "vit_base"}  # depth 12 each (trainer.backbones.VIT_SHAPES)
SHOWN_KEYS = 3  # differing keys named in a one-line error


@dataclass(frozen=True)
class Pretrained:
    """What a SOURCE file holds, in our naming.

    ``backbone``: the state dict of our backbone (torchvision ResNet without ``fc``, or timm ViT without
    ``head``). ``heads``: ``{"head": projector state, "predictor": predictor state}`` with the keys of our
    ``encoder_q.head`` / ``predictor`` modules, of MoCo version ``head_version`` (None: no heads).
    ``ignored``: source key groups not used, ``prefix -> tensor count``.
    """

    path: Path
    sha256: str
    layout: str  # state_dict, moco_v2, moco_v3, moco-retrieval
    arch: str
    backbone: dict
    heads: dict = field(default_factory=dict)
    head_version: int | None = None
    stem: str | None = None  # ResNets: imagenet or small from conv1's kernel; our runs' own (nopool too)
    patch_size: int | None = None  # ViTs: P of patch_embed.proj [D, 3, P, P]
    grid: int | None = None  # ViTs: G of pos_embed [1, 1 + G*G, D]
    image_size: int | None = None  # our own checkpoints: the size they were trained at
    moco_version: int = 0  # the MoCo version that trained the weights (0: not MoCo, e.g. supervised)
    run_id: str = ""
    epoch: int = 0
    step: int = 0
    ignored: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def native_image_size(self) -> int:
        """The size the weights were made for: a checkpoint's own, a ViT's grid x patch, else 224."""
        if self.image_size:
            return self.image_size
        if self.grid and self.patch_size:
            return self.grid * self.patch_size
        return 224


# -- reading ----------------------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_file(path: Path):
    """The file's content: tensors and plain values only (safetensors, or ``torch.load(weights_only=True)``).

    Raises:
        ArtifactError: missing, truncated or unreadable, or holding objects other than tensors and plain values.
    """
    if not path.is_file():
        raise ArtifactError(f"no checkpoint at {path} (nor any weights file)")
    if path.suffix.lower() == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:  # pragma: no cover - safetensors is a dependency
            raise ArtifactError(f"{path} is a safetensors file; pip install safetensors") from exc
        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:
            raise ArtifactError(
                f"cannot read {path} (truncated or not a safetensors file): {type(exc).__name__}: {exc}".splitlines()[0]
            ) from exc
    hint = "pass a state dict or checkpoint saved with torch.save (tensors and plain values only)"
    try:
        return safe_load(path, hint)
    except ArtifactError:
        raise
    except Exception as exc:  # torch raises many types for a truncated or foreign file
        raise ArtifactError(
            f"cannot read {path} (truncated or not a PyTorch weights file): {type(exc).__name__}: {exc}".splitlines()[0]
        ) from exc


def _tensors(obj) -> dict | None:
    """``obj`` when it is a non-empty dict of tensors (a state dict), else None."""
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    return None


def _split(state: dict, prefix: str) -> dict:
    """The entries under ``prefix`` (``"fc."``), the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _group(keys) -> dict:
    """``{"encoder_k.*": 122, "queue": 1}``: ignored keys by their first component."""
    groups: dict = {}
    for key in keys:
        head = key.split(".")[0]
        name = head + ".*" if "." in key else head
        groups[name] = groups.get(name, 0) + 1
    return groups


def _first(keys, n: int = SHOWN_KEYS) -> str:
    keys = list(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def infer_arch(state: dict, where: str) -> tuple[str, dict]:
    """The architecture of a backbone state dict, from its keys and shapes, and what else it tells.

    Args:
        state: backbone keys (torchvision/timm ResNet or timm ViT naming, classifier removed or not).
        where: the file, for messages.

    Returns:
        ``(arch, facts)``: ``facts`` has ``stem`` (ResNets) or ``patch_size`` and ``grid`` (ViTs).

    Raises:
        ArtifactError: neither a ResNet nor a ViT, or one this project does not build.
    """
    if "conv1.weight" in state and any(k.startswith("layer1.") for k in state):
        stages = tuple(len({k.split(".")[1] for k in state if k.startswith(f"layer{i}.")}) for i in range(1, 5))
        found = _RESNET_LAYOUTS.get(("layer1.0.conv3.weight" in state, stages))
        if found is None:
            raise ArtifactError(
                f"{where}: a ResNet with blocks {list(stages)} per stage, not one of {', '.join(RESNETS)}"
            )
        if found not in RESNETS:
            raise ArtifactError(f"{where} holds a {found}; moco-retrieval builds {', '.join(RESNETS)}")
        width = int(state["conv1.weight"].shape[0])
        if width != 64:  # a narrower trunk of the same layout
            narrow = [name for name, shape in NARROW_RESNETS.items() if shape == (found, width)]
            if not narrow:
                raise ArtifactError(
                    f"{where}: a {found} with {width} channels in its first layer, not 64; "
                    f"moco-retrieval builds {', '.join(RESNETS)}"
                )
            found = narrow[0]
        kernel = int(state["conv1.weight"].shape[-1])
        return found, {"stem": "imagenet" if kernel == 7 else "small" if kernel == 3 else f"{kernel}x{kernel}"}
    if "cls_token" in state and "patch_embed.proj.weight" in state and "pos_embed" in state:
        width = int(state["cls_token"].shape[-1])
        depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
        found = _VIT_WIDTHS.get(width)
        if found is None or depth != 12:
            raise ArtifactError(
                f"{where}: a ViT of width {width} and depth {depth}, not one of "
                f"{', '.join(VITS)} (widths 192/384/768, depth 12)"
            )
        patch = int(state["patch_embed.proj.weight"].shape[-1])
        tokens = int(state["pos_embed"].shape[1]) - 1
        grid = math.isqrt(tokens)
        if grid * grid != tokens:
            raise ArtifactError(
                f"{where}: a position embedding of {tokens + 1} tokens is not a class token plus a square grid"
            )
        return found, {"patch_size": patch, "grid": grid}
    raise ArtifactError(
        f"{where}: cannot tell the architecture (neither a ResNet nor a ViT); first keys: {_first(state)}"
    )


def _own(obj: dict, path: Path, digest: str) -> Pretrained:
    """A ``moco train`` checkpoint: backbone, projector and predictor under ``encoder_q`` / ``predictor``."""
    from moco_retrieval.trainer.config import TrainConfig

    if obj.get("format_version", 0) > CHECKPOINT_VERSION:
        raise ArtifactError(f"{path} was written by a newer moco-retrieval (format {obj['format_version']})")
    try:
        cfg = TrainConfig.from_dict(obj["config"])
        state = strip_wrappers(obj["model"])
    except (ConfigError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"{path}: cannot read its configuration ({exc})") from exc
    backbone = _split(state, "encoder_q.backbone.")
    heads = {"head": _split(state, "encoder_q.head.")}
    if any(k.startswith("predictor.") for k in state):
        heads["predictor"] = _split(state, "predictor.")
    used = ("encoder_q.", "predictor.")
    grid = cfg.image_size // cfg.resolved_patch_size if cfg.arch in VITS else None
    return Pretrained(
        path=path,
        sha256=digest,
        layout="moco-retrieval",
        arch=cfg.arch,
        backbone=backbone,
        heads=heads,
        head_version=cfg.moco_version,
        stem=cfg.resolved_stem if cfg.arch in RESNETS else None,
        patch_size=cfg.resolved_patch_size if cfg.arch in VITS else None,
        grid=grid,
        image_size=cfg.image_size,
        moco_version=cfg.moco_version,
        run_id=obj.get("run_id", ""),
        epoch=int(obj.get("epoch", 0)),
        step=int(obj.get("step", 0)),
        ignored=_group(k for k in state if not k.startswith(used)),
    )


def read_pretrained(source: str | Path) -> Pretrained:
    """Read SOURCE (a weights file, or a run directory of ``moco train``) and map it to our naming.

    Returns:
        :class:`Pretrained`.

    Raises:
        ArtifactError: missing, truncated, unsafe or unrecognised file (one line).
    """
    path = Path(source)
    if path.is_dir():
        path = path / LAST
    obj = _read_file(path)
    digest = sha256_file(path)
    if isinstance(obj, dict) and obj.get("format") == CHECKPOINT_FORMAT:
        return _own(obj, path, digest)
    state = _tensors(obj)
    if state is None and isinstance(obj, dict):
        for wrapper in ("state_dict", "model", "module"):
            state = _tensors(obj.get(wrapper))
            if state is not None:
                break
    if state is None:
        raise ArtifactError(
            f"{path} holds no state dict (a dict of tensors, or one under 'state_dict' / "
            "'model'); pass torchvision, timm, MoCo or moco-retrieval weights"
        )
    state = strip_wrappers(state)
    heads: dict = {}
    head_version = None
    if any(k.startswith("encoder_q.") for k in state):  # facebookresearch/moco v1/v2
        layout, moco_version = "moco_v2", 2
        encoder = _split(state, "encoder_q.")
        head = _split(encoder, "fc.")
        if set(head) == {"0.weight", "0.bias", "2.weight", "2.bias"}:  # v2's MLP head
            heads, head_version = {"head": head}, 2
        backbone = {k: v for k, v in encoder.items() if not k.startswith("fc.")}
        ignored = [k for k in state if not k.startswith("encoder_q.")]
        ignored += [f"encoder_q.fc.{k}" for k in head] if not heads else []
    elif any(k.startswith("base_encoder.") for k in state):  # facebookresearch/moco-v3
        layout, moco_version = "moco_v3", 3
        encoder = _split(state, "base_encoder.")
        head_prefix = "head." if "cls_token" in encoder else "fc."
        heads = {"head": _split(encoder, head_prefix)}
        predictor = _split(state, "predictor.")
        if predictor:
            heads["predictor"] = predictor
        head_version = 3
        backbone = {k: v for k, v in encoder.items() if not k.startswith(head_prefix)}
        ignored = [k for k in state if not k.startswith(("base_encoder.", "predictor."))]
    else:
        layout, moco_version = "state_dict", 0
        classifier = "head." if "cls_token" in state else "fc."
        backbone = {k: v for k, v in state.items() if not k.startswith(classifier)}
        ignored = [k for k in state if k.startswith(classifier)]
    arch, facts = infer_arch(backbone, str(path))
    if arch == "vit_small" and layout == "state_dict":  # the weights cannot say how many heads split them
        LOG.warning(
            "%s: our vit_small has MoCo v3's 12 attention heads; timm's and DeiT's ViT-S have 6, and "
            "their weights load but compute other features",
            path,
        )
    return Pretrained(
        path=path,
        sha256=digest,
        layout=layout,
        arch=arch,
        backbone=backbone,
        heads=heads,
        head_version=head_version,
        moco_version=moco_version,
        ignored=_group(ignored),
        **facts,
    )


# -- checking against what the user asked for --------------------------------------------------------------------
def _shapes(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items()}


def differences(expected: dict, found: dict) -> list[str]:
    """The differing entries of two ``key -> shape`` maps, missing first, then unexpected, then shapes:
    ``["missing layer4.1.bn2.weight", "unexpected fc.weight", "layer1.0.conv1.weight [64, 64, 3, 3] (ours
    [64, 64, 1, 1])"]``. BN's ``num_batches_tracked`` may be missing (older files)."""
    missing = [f"missing {k}" for k in expected if k not in found and not k.endswith("num_batches_tracked")]
    unexpected = [f"unexpected {k}" for k in found if k not in expected]
    shapes = [
        f"{k} {list(found[k])} (ours {list(expected[k])})"
        for k in expected
        if k in found and tuple(found[k]) != tuple(expected[k])
    ]
    return missing + unexpected + shapes


def _expected_backbone(arch: str, stem: str | None, image_size: int, patch_size: int | None) -> nn.Module:
    from moco_retrieval.trainer.backbones import build_resnet, build_vit

    if arch in RESNETS:
        return build_resnet(arch, stem or "imagenet", 1)[0]
    return build_vit(arch, image_size, patch_size or 16)[0]


def check_arch(pre: Pretrained, arch: str | None, flag: str = "--arch") -> str:
    """The architecture to build: the file's; ``arch`` (the user's) must be the same when given.

    Raises:
        ConfigError: ``arch`` differs from the file's, with the first keys that differ.
    """
    if arch in (None, "auto") or arch == pre.arch:
        return pre.arch
    if arch not in RESNETS + VITS:
        raise ConfigError(f"unknown {flag} {arch!r}; choose one of {', '.join(RESNETS + VITS)}")
    ours = _shapes(_expected_backbone(arch, pre.stem, pre.native_image_size, pre.patch_size).state_dict())
    diff = differences(ours, _shapes(pre.backbone))
    raise ConfigError(
        f"{flag} {arch} does not fit {pre.name}: expected {arch}, found {pre.arch} "
        f"({pre.layout} layout; first differences: {_first(diff)}); drop {flag} or pass {flag} "
        f"{pre.arch}"
    )


def fit_backbone(pre: Pretrained, backbone: nn.Module, image_size: int) -> tuple[dict, list[str]]:
    """The source's backbone state made to fit ``backbone`` (ours, built for ``image_size``), and notes.

    A ViT's position embedding of another grid (another image size at the same patch size) is resampled
    bicubically to ours (timm's ``resample_abs_pos_embed``), and the note says so.

    Raises:
        ConfigError: a ViT patch size that differs. ArtifactError: missing keys, unexpected keys or shapes
            that differ (the first of each named).
    """
    state = dict(pre.backbone)
    ours = backbone.state_dict()
    notes: list[str] = []
    if pre.arch in VITS:
        patch = int(ours["patch_embed.proj.weight"].shape[-1])
        if pre.patch_size != patch:
            raise ConfigError(
                f"--patch-size {patch} does not fit {pre.name}: expected patch {patch}, found "
                f"{pre.patch_size} (patch_embed.proj.weight {list(state['patch_embed.proj.weight'].shape)})"
                f"; pass --patch-size {pre.patch_size}"
            )
        grid = math.isqrt(int(ours["pos_embed"].shape[1]) - 1)
        if pre.grid != grid and "pos_embed" in state:
            from timm.layers import resample_abs_pos_embed

            state["pos_embed"] = resample_abs_pos_embed(
                state["pos_embed"].float(), [grid, grid], num_prefix_tokens=1
            ).to(state["pos_embed"].dtype)
            notes.append(
                f"position embedding interpolated from a {pre.grid}x{pre.grid} to a {grid}x{grid} grid "
                f"(image size {pre.grid * patch} -> {image_size} px at patch {patch})"
            )
    diff = differences(_shapes(ours), _shapes(state))
    if diff:
        raise ArtifactError(
            f"{pre.name} does not fit our {pre.arch}: expected {pre.arch}, found "
            f"{pre.arch}-like {pre.layout} weights that differ: {_first(diff)}"
        )
    for key, value in ours.items():  # older files lack BN's counter
        state.setdefault(key, value)
    return state, notes


# -- loading -----------------------------------------------------------------------------------------------------
def load_backbone_weights(pre: Pretrained, backbone: nn.Module, image_size: int) -> list[str]:
    """Load the source's backbone into ``backbone`` (ours) in place; returns the notes of :func:`fit_backbone`."""
    state, notes = fit_backbone(pre, backbone, image_size)
    backbone.load_state_dict(state)
    return notes


def load_into_model(pre: Pretrained, model: nn.Module, image_size: int) -> dict:
    """Start a MoCo model (``trainer.moco.MoCo``) from the source: the backbone into the query encoder, the
    heads where the source has ones of our shapes, then the key encoder as a copy of the query encoder.

    Returns:
        the report for the log and ``config.json``: ``source``, ``sha256``, ``layout``, ``arch``, ``loaded``,
        ``fresh``, ``ignored`` (lists of one-line strings) and ``notes``.
    """
    notes = load_backbone_weights(pre, model.encoder_q.backbone, image_size)
    loaded = [f"backbone ({len(pre.backbone)} tensors)"]
    fresh, ignored = [], [f"{k} ({n} tensors)" if n > 1 else k for k, n in pre.ignored.items()]
    names = {"head": "projection head", "predictor": "prediction head"}
    for part in ("head", "predictor"):
        module = model.encoder_q.head if part == "head" else getattr(model, "predictor", None)
        source = pre.heads.get(part)
        if module is None:
            if source:
                ignored.append(f"{names[part]} (our MoCo v2 has none)")
            continue
        if not source:
            fresh.append(f"{names[part]} (the file has none)")
            continue
        diff = differences(_shapes(module.state_dict()), _shapes(source))
        if diff:
            fresh.append(f"{names[part]} (the file's MoCo v{pre.head_version} head differs: {_first(diff, 2)})")
            ignored.append(f"{names[part]} of the file")
            continue
        module.load_state_dict({**module.state_dict(), **source})
        loaded.append(f"{names[part]} (MoCo v{pre.head_version})")
    model.encoder_k.load_state_dict(model.encoder_q.state_dict())
    report = {
        "source": str(pre.path),
        "sha256": pre.sha256,
        "layout": pre.layout,
        "arch": pre.arch,
        "loaded": loaded,
        "fresh": fresh,
        "ignored": ignored,
        "notes": notes,
    }
    log_report(report)
    return report


def log_report(report: dict) -> None:
    LOG.info(
        "--init %s (%s layout, %s, sha256 %s...): loaded %s; fresh %s; ignored %s",
        report["source"],
        report["layout"],
        report["arch"],
        report["sha256"][:12],
        ", ".join(report["loaded"]),
        ", ".join(report["fresh"]) or "nothing",
        ", ".join(report["ignored"]) or "nothing",
    )
    for note in report["notes"]:
        LOG.info("--init: %s", note)


def head_shape(pre: Pretrained, moco_version: int) -> dict:
    """``{"dim": C, "mlp_hidden": H}`` of the source's projector when it is of ``moco_version``, else ``{}``:
    the v2 MLP's ``0.weight`` [H, D] / ``2.weight`` [C, H]; v3's ``0.weight`` [H, D] ... last Linear [C, H]."""
    head = pre.heads.get("head")
    if not head or pre.head_version != moco_version or "0.weight" not in head:
        return {}
    linears = sorted((int(k.split(".")[0]), v) for k, v in head.items() if k.endswith(".weight") and v.ndim == 2)
    return {"dim": int(linears[-1][1].shape[0]), "mlp_hidden": int(head["0.weight"].shape[0])}


def configure(cfg, pre: Pretrained):
    """The training config with what the source decides: its architecture (``--arch auto``, else checked), its
    ResNet stem or ViT patch size (when left at auto, else checked), and the projector's shape when the user
    left ``--dim`` / ``--mlp-hidden`` unset and the source's heads are of the same MoCo version.

    Raises:
        ConfigError: an option that contradicts the file.
    """
    from moco_retrieval.trainer.recipes import set_derived

    arch = check_arch(pre, cfg.arch)
    if arch in VITS and cfg.moco_version != 3:
        raise ConfigError(f"--init {pre.name} holds a {arch}; ViTs train with MoCo v3: add --moco-version 3")
    why = f"the --init file ({pre.layout} layout) holds a {arch}"
    if cfg.arch != arch:
        cfg = set_derived(cfg, "arch", arch, why)
    if arch in VITS:
        if cfg.patch_size and cfg.patch_size != pre.patch_size:
            raise ConfigError(
                f"--patch-size {cfg.patch_size} does not fit --init {pre.name}: expected patch "
                f"{cfg.patch_size}, found {pre.patch_size}; pass --patch-size {pre.patch_size}"
            )
        if not cfg.patch_size:
            cfg = set_derived(cfg, "patch_size", pre.patch_size, "the --init file's patch size")
        if cfg.image_size is None:  # a ViT's position embedding is made for one size: keep it
            cfg = set_derived(cfg, "image_size", pre.native_image_size, "the size the --init file's ViT was made for")
        if cfg.image_size % pre.patch_size:
            raise ConfigError(
                f"--image-size {cfg.image_size} is not a multiple of the --init file's patch size {pre.patch_size}"
            )
    else:
        if pre.stem not in STEM_KERNEL:
            raise ArtifactError(f"--init {pre.name}: a {pre.stem} first convolution fits no stem")
        if cfg.stem != "auto" and STEM_KERNEL.get(cfg.stem) != STEM_KERNEL[pre.stem]:
            raise ConfigError(
                f"--stem {cfg.stem} does not fit --init {pre.name}: expected {cfg.stem}, found the "
                f"{pre.stem} stem (conv1.weight {list(pre.backbone['conv1.weight'].shape)})"
            )
        if cfg.stem == "auto":
            cfg = set_derived(cfg, "stem", pre.stem, "the --init file's first layer")
    for name, value in head_shape(pre, cfg.moco_version).items():
        if getattr(cfg, name) is None:
            cfg = set_derived(cfg, name, value, "the shape of the --init file's projection head, so it loads")
    return cfg


@dataclass(frozen=True)
class SourceBackbone:
    """A backbone built straight from SOURCE (``moco export --init``, ``moco eval``): eval mode, on the CPU."""

    backbone: nn.Module
    pretrained: Pretrained
    sized: EmbeddingSize  # the size it embeds at, and the weights' own
    notes: list

    @property
    def image_size(self) -> int:
        return self.sized.size


def backbone_from_source(
    source: str | Path, arch: str | None = None, image_size: int | None = None, flag: str = "--arch"
) -> SourceBackbone:
    """Our backbone with SOURCE's weights, for ``image_size`` (default: the weights' own size, see
    :attr:`Pretrained.native_image_size`, or for a ResNet the size :func:`trainer.embedding_size.embedding_size`
    chooses there: twice it where the last map is 1x1); ``arch``, when given, must be the file's.

    Raises:
        ArtifactError, ConfigError: as :func:`read_pretrained`, :func:`check_arch` and :func:`fit_backbone`.
    """
    from moco_retrieval.trainer.backbones import build_resnet, build_vit

    pre = read_pretrained(source)
    arch = check_arch(pre, arch, flag)
    size = image_size or pre.native_image_size
    if arch in VITS:
        if size % pre.patch_size:
            raise ConfigError(f"--image-size {size} is not a multiple of the --init file's patch size {pre.patch_size}")
        backbone = build_vit(arch, size, pre.patch_size)[0]
    else:
        if pre.stem not in STEM_KERNEL:
            raise ArtifactError(f"{pre.name}: a {pre.stem} first convolution fits no stem")
        backbone = build_resnet(arch, pre.stem, 1)[0]
    notes = load_backbone_weights(pre, backbone, size)
    for note in notes:
        LOG.info("--init: %s", note)
    LOG.info("built %s from %s (%s layout, sha256 %s...)", arch, pre.path, pre.layout, pre.sha256[:12])
    backbone = backbone.float().eval()
    if arch in VITS:
        native = pre.native_image_size
        why = "the training size" if size == native else f"--image-size {size} (position embeddings from {native})"
        sized = EmbeddingSize(size, native, why)
    else:  # a ResNet's weights fit any size
        sized = embedding_size(backbone, pre.native_image_size, image_size)
    return SourceBackbone(backbone, pre, sized, notes)
