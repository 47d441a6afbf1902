"""``--init SOURCE``: weights in every official key layout (torchvision, timm safetensors, facebookresearch/moco
v1/v2, moco-v3 ResNet and ViT, our own runs), built here from locally constructed modules with known weights,
give our backbone the same features as the module they came from, in PyTorch and through the ONNX export;
every mismatch is one line; a crafted pickle is refused without running; train, export, index and eval read
them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import timm
import torch
import torchvision
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from moco_retrieval.app.cli import main
from moco_retrieval.contracts.errors import ArtifactError, ConfigError
from moco_retrieval.indexer.encoder import read_encoder_metadata
from moco_retrieval.trainer.export import FP32_TOLERANCE, compare, export_pretrained, reference_embeddings
from moco_retrieval.trainer.mirror_average import readout
from moco_retrieval.trainer.pretrained import (
    backbone_from_source,
    configure,
    infer_arch,
    load_into_model,
    read_pretrained,
    sha256_file,
)
from moco_retrieval.trainer.recipe_table import NOT_MEASURED
from moco_retrieval.trainer.recipes import resolve_for_images
from moco_retrieval.trainer.variants import build_model
from tests.conftest import tiny_train_config


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared
    yield
    torch.set_num_threads(previous)


# -- sources in each official layout, from modules with known weights -------------------------------------------
def _non_trivial(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random BN statistics (eval-mode BN is then not the identity) and non-zero biases; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.running_mean is not None:
                layer.running_mean.uniform_(-0.2, 0.2, generator=gen)
                layer.running_var.uniform_(0.5, 2.0, generator=gen)
                if layer.affine:
                    layer.bias.uniform_(-0.1, 0.1, generator=gen)
    return module.eval()


def _resnet18(seed: int = 0, num_classes: int = 1000) -> nn.Module:
    torch.manual_seed(seed)
    return _non_trivial(torchvision.models.resnet18(num_classes=num_classes), seed)


def _features(net: nn.Module) -> nn.Module:
    """``net`` without its classifier / head: the reference for our backbone."""
    import copy

    ref = copy.deepcopy(net)
    if hasattr(ref, "fc"):
        ref.fc = nn.Identity()
    else:
        ref.head = nn.Identity()
    return ref.eval()


def _mlp(num_layers: int, input_dim: int, mlp_dim: int, output_dim: int, last_bn: bool = True) -> nn.Sequential:
    """facebookresearch/moco-v3's ``MoCo._build_mlp``, written out here as the reference layout."""
    layers = []
    for i in range(num_layers):
        dim1 = input_dim if i == 0 else mlp_dim
        dim2 = output_dim if i == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(dim1, dim2, bias=False))
        if i < num_layers - 1:
            layers += [nn.BatchNorm1d(dim2), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(dim2, affine=False))
    return nn.Sequential(*layers)


def _with_prefix(prefix: str, state: dict, shift: float = 0.0) -> dict:
    return {prefix + k: (v + shift if v.is_floating_point() else v) for k, v in state.items()}


def moco_v2_file(path: Path, mlp: bool = True, seed: int = 0) -> nn.Module:
    """A facebookresearch/moco checkpoint (v2 with the MLP head, v1 without) of a ResNet-18; returns the query
    encoder (with its head) it holds."""
    net = _resnet18(seed, num_classes=32)  # base_encoder(num_classes=dim)
    if mlp:  # builder.py: fc = Sequential(Linear(dim_mlp, dim_mlp), ReLU(), fc)
        net.fc = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), net.fc)
    state = _with_prefix("module.encoder_q.", net.state_dict())
    state.update(_with_prefix("module.encoder_k.", net.state_dict(), shift=0.5))  # a key encoder that differs
    state["module.queue"] = torch.randn(32, 64)
    state["module.queue_ptr"] = torch.zeros(1, dtype=torch.long)
    torch.save({"epoch": 200, "arch": "resnet18", "state_dict": state, "optimizer": {"state": {}}}, path)
    return net.eval()


def moco_v3_resnet_file(path: Path, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A facebookresearch/moco-v3 ResNet checkpoint (a ResNet-18 in the ResNet-50 layout, dim 16, mlp 64);
    returns ``(base encoder with its projector, predictor)``."""
    torch.manual_seed(seed)
    net = torchvision.models.resnet18(zero_init_residual=True)
    net.fc = _mlp(2, 512, 64, 16)
    predictor = _non_trivial(_mlp(2, 16, 64, 16, last_bn=False), seed + 1)
    _non_trivial(net, seed)
    state = _with_prefix("module.base_encoder.", net.state_dict())
    state.update(_with_prefix("module.momentum_encoder.", net.state_dict(), shift=0.5))
    state.update(_with_prefix("module.predictor.", predictor.state_dict()))
    torch.save({"epoch": 100, "arch": "resnet18", "state_dict": state, "optimizer": {}, "scaler": {}}, path)
    return net, predictor


def _vit_tiny(img_size: int = 32, patch_size: int = 8, seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    vit = VisionTransformer(
        img_size=img_size, patch_size=patch_size, embed_dim=192, depth=12, num_heads=3, num_classes=0
    )
    with torch.no_grad():
        vit.pos_embed.normal_(0, 0.02)
        vit.cls_token.normal_(0, 0.02)
    return vit.eval()


def moco_v3_vit_file(path: Path, seed: int = 0) -> nn.Module:
    """A moco-v3 ViT checkpoint (a ViT-Tiny shape, 32 px, patch 8, in the ViT-S/B layout); returns the backbone."""
    vit = _vit_tiny(seed=seed)
    vit.head = _mlp(3, 192, 64, 16)
    predictor = _mlp(2, 16, 64, 16)
    state = _with_prefix("module.base_encoder.", vit.state_dict())
    state.update(_with_prefix("module.momentum_encoder.", vit.state_dict(), shift=0.5))
    state.update(_with_prefix("module.predictor.", predictor.state_dict()))
    torch.save({"epoch": 300, "arch": "vit_small", "state_dict": state}, path)
    return _features(vit)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """``name -> (file, reference feature module)`` in every layout."""
    root = tmp_path_factory.mktemp("sources")
    torch.set_num_threads(1)
    out = {}
    tv = _resnet18(seed=1)
    torch.save(tv.state_dict(), root / "resnet18-torchvision.pth")
    out["torchvision"] = (root / "resnet18-torchvision.pth", _features(tv))
    out["moco_v2"] = (root / "moco_v2.pth.tar", _features(moco_v2_file(root / "moco_v2.pth.tar")))
    out["moco_v1"] = (root / "moco_v1.pth.tar", _features(moco_v2_file(root / "moco_v1.pth.tar", mlp=False)))
    net, _ = moco_v3_resnet_file(root / "r-18-moco-v3.pth.tar")
    out["moco_v3_resnet"] = (root / "r-18-moco-v3.pth.tar", _features(net))
    out["moco_v3_vit"] = (root / "vit-moco-v3.pth.tar", moco_v3_vit_file(root / "vit-moco-v3.pth.tar"))
    from safetensors.torch import save_file

    torch.manual_seed(2)
    timm_resnet = _non_trivial(timm.create_model("resnet18", pretrained=False), 2)
    save_file(timm_resnet.state_dict(), str(root / "resnet18-timm.safetensors"))
    timm_resnet.reset_classifier(0)
    out["timm_resnet"] = (root / "resnet18-timm.safetensors", timm_resnet.eval())
    timm_vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8).eval()
    save_file(timm_vit.state_dict(), str(root / "vit-tiny-timm.safetensors"))
    timm_vit.reset_classifier(0)
    out["timm_vit"] = (root / "vit-tiny-timm.safetensors", timm_vit.eval())
    return out


EXPECTED = {
    "torchvision": ("state_dict", "resnet18"),
    "moco_v2": ("moco_v2", "resnet18"),
    "moco_v1": ("moco_v2", "resnet18"),
    "moco_v3_resnet": ("moco_v3", "resnet18"),
    "moco_v3_vit": ("moco_v3", "vit_tiny"),
    "timm_resnet": ("state_dict", "resnet18"),
    "timm_vit": ("state_dict", "vit_tiny"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_backbone_from_source__same_features_as_the_source_module(name, sources):
    path, reference = sources[name]
    built = backbone_from_source(path, image_size=32)
    assert (built.pretrained.layout, built.pretrained.arch) == EXPECTED[name]
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = built.backbone(x), reference(x)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours - theirs).abs().max()


def test_read_pretrained__says_what_it_ignores(sources):
    v2 = read_pretrained(sources["moco_v2"][0])
    assert v2.head_version == 2 and set(v2.heads["head"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {"encoder_k.*", "queue", "queue_ptr"} <= set(v2.ignored)
    v1 = read_pretrained(sources["moco_v1"][0])
    assert not v1.heads and "encoder_q.*" in v1.ignored  # v1's linear fc has no counterpart
    v3 = read_pretrained(sources["moco_v3_vit"][0])
    assert (v3.patch_size, v3.grid, v3.native_image_size) == (8, 4, 32) and "momentum_encoder.*" in v3.ignored
    assert read_pretrained(sources["torchvision"][0]).ignored == {"fc.*": 2}


def test_infer_arch__vit_small_layout_and_unbuilt_resnets():
    from moco_retrieval.trainer.backbones import build_vit

    assert infer_arch(build_vit("vit_small", 32, 8)[0].state_dict(), "x")[0] == "vit_small"
    fake = {"conv1.weight": torch.zeros(64, 3, 7, 7)}
    for stage, blocks in enumerate((3, 4, 23, 3), start=1):
        fake.update({f"layer{stage}.{b}.conv3.weight": torch.zeros(1) for b in range(blocks)})
    with pytest.raises(ArtifactError, match="holds a resnet101; moco-retrieval builds"):
        infer_arch(fake, "r101.pth")


def test_infer_arch__the_narrow_resnet18_by_its_first_layers_channels():
    from moco_retrieval.trainer.backbones import build_resnet

    state = build_resnet("resnet18_narrow", "small")[0].state_dict()
    assert infer_arch(state, "x") == ("resnet18_narrow", {"stem": "small"})
    state["conv1.weight"] = torch.zeros(32, 3, 3, 3)
    with pytest.raises(ArtifactError, match="a resnet18 with 32 channels in its first layer, not 64"):
        infer_arch(state, "half.pth")


def test_our_narrow_run__is_a_source_for_training_and_export(tmp_path):
    from tests._checkpoints import query_backbone, write_checkpoint

    run = write_checkpoint(None, tmp_path / "src", arch="resnet18_narrow", stem="small")
    cfg = configure(_train_cfg(tmp_path, run), read_pretrained(run))
    assert (cfg.arch, cfg.stem) == ("resnet18_narrow", "small")
    built = backbone_from_source(run, image_size=32)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, query = built.backbone.eval()(x), query_backbone(run)(x)
    assert ours.shape == (2, 128) and torch.allclose(ours, query, atol=1e-5)


# -- into a MoCo model: heads where they fit, both encoders from the backbone ------------------------------------
def _train_cfg(tmp_path: Path, source: Path, **overrides):
    values = dict(arch="auto", init=str(source), stem="auto")
    values.update(overrides)
    return tiny_train_config(tmp_path / "data", tmp_path / "run", **values)


def _model_from(cfg, pre):
    cfg = resolve_for_images(configure(cfg, pre), 96)
    model = build_model(cfg)
    report = load_into_model(pre, model, cfg.image_size)
    return cfg, model.eval(), report


def test_load_into_model__moco_v2_heads_load_and_key_encoder_starts_equal(sources, tmp_path):
    path, _ = sources["moco_v2"]
    pre = read_pretrained(path)
    cfg, model, report = _model_from(_train_cfg(tmp_path, path), pre)
    assert (cfg.arch, cfg.stem, cfg.dim, cfg.mlp_hidden) == ("resnet18", "imagenet", 32, 512)
    assert report["loaded"][1].startswith("projection head") and not report["fresh"]
    query = torch.load(path, weights_only=True)["state_dict"]
    net = _resnet18(0, num_classes=32)
    net.fc = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), net.fc)
    net.load_state_dict({k[len("module.encoder_q.") :]: v for k, v in query.items() if ".encoder_q." in k})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.encoder_q(x), net.eval()(x), atol=1e-5)
        assert torch.allclose(model.encoder_k(x), model.encoder_q(x))  # not the file's (different) key encoder


def test_load_into_model__moco_v3_projector_and_predictor_load(sources, tmp_path):
    path, _ = sources["moco_v3_resnet"]
    cfg, model, report = _model_from(_train_cfg(tmp_path, path, moco_version=3), read_pretrained(path))
    assert (cfg.dim, cfg.mlp_hidden) == (16, 64)
    assert [part.split(" (")[0] for part in report["loaded"]] == ["backbone", "projection head", "prediction head"]
    net, predictor = moco_v3_resnet_file(tmp_path / "again.pth.tar")  # the same seed: the same weights
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.predictor(model.encoder_q(x)), predictor(net(x)), atol=1e-5)


def test_load_into_model__moco_v3_vit_heads_load_and_the_position_embedding_is_interpolated(sources, tmp_path):
    path, reference = sources["moco_v3_vit"]
    cfg, model, report = _model_from(_train_cfg(tmp_path, path, moco_version=3), read_pretrained(path))
    assert (cfg.arch, cfg.patch_size, cfg.dim, cfg.mlp_hidden) == ("vit_tiny", 8, 16, 64)
    assert [part.split(" (")[0] for part in report["loaded"]] == ["backbone", "projection head", "prediction head"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.encoder_k.backbone(x), reference(x), atol=1e-5)
    _, model, report = _model_from(_train_cfg(tmp_path, path, moco_version=3, image_size=64), read_pretrained(path))
    assert report["notes"] == [
        "position embedding interpolated from a 4x4 to a 8x8 grid (image size 32 -> 64 px at patch 8)"
    ]


def test_load_into_model__v1_head_and_mismatched_heads_stay_fresh(sources, tmp_path):
    path, _ = sources["moco_v1"]
    _, _, report = _model_from(_train_cfg(tmp_path, path), read_pretrained(path))
    assert report["fresh"] == ["projection head (the file has none)"]
    path, _ = sources["moco_v3_resnet"]  # v3 heads, trained as v2: fresh, the file's ignored
    _, _, report = _model_from(_train_cfg(tmp_path, path), read_pretrained(path))
    assert report["fresh"][0].startswith("projection head (the file's MoCo v3 head differs")
    assert "prediction head (our MoCo v2 has none)" in report["ignored"]


# -- one-line errors ----------------------------------------------------------------------------------------------
def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def test_errors__wrong_arch_names_expected_found_and_first_keys(sources, tmp_path):
    path, _ = sources["torchvision"]
    with pytest.raises(ConfigError) as exc:
        backbone_from_source(path, arch="resnet34")
    text = _one_line(exc)
    assert "expected resnet34, found resnet18" in text and "missing layer1.2." in text
    with pytest.raises(ConfigError) as exc:
        configure(_train_cfg(tmp_path, path, arch="resnet50"), read_pretrained(path))
    assert "expected resnet50, found resnet18" in _one_line(exc) and "--arch resnet18" in str(exc.value)
    with pytest.raises(ConfigError, match="--stem small does not fit"):
        configure(_train_cfg(tmp_path, path, stem="small"), read_pretrained(path))
    # the max-pool holds no weights: an ImageNet-stem file fits --stem nopool
    assert configure(_train_cfg(tmp_path, path, stem="nopool"), read_pretrained(path)).stem == "nopool"
    vit, _ = sources["moco_v3_vit"]
    with pytest.raises(ConfigError, match="add --moco-version 3"):
        configure(_train_cfg(tmp_path, vit), read_pretrained(vit))


def test_our_nopool_run__is_a_source_for_training_and_export_with_its_stem(tmp_path):
    from tests._checkpoints import key_backbone, write_checkpoint

    run = write_checkpoint(None, tmp_path / "src", arch="resnet18", stem="nopool")
    assert configure(_train_cfg(tmp_path, run), read_pretrained(run)).stem == "nopool"  # its own, not imagenet
    with pytest.raises(ConfigError, match="--stem small does not fit"):
        configure(_train_cfg(tmp_path, run, stem="small"), read_pretrained(run))
    built = backbone_from_source(run, image_size=32)
    assert isinstance(built.backbone.maxpool, nn.Identity)  # no max-pool came back
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert built.backbone.eval()(x).shape == key_backbone(run)(x).shape == (2, 512)


def test_errors__missing_keys_and_shape_differences(sources, tmp_path):
    state = torch.load(sources["torchvision"][0], weights_only=True)
    missing = dict(state)
    del missing["layer4.1.bn2.weight"]
    torch.save(missing, tmp_path / "missing.pth")
    with pytest.raises(ArtifactError) as exc:
        backbone_from_source(tmp_path / "missing.pth")
    assert "missing layer4.1.bn2.weight" in _one_line(exc) and "expected resnet18" in str(exc.value)
    shaped = dict(state, **{"layer1.0.conv1.weight": torch.zeros(64, 64, 1, 1)})
    torch.save(shaped, tmp_path / "shape.pth")
    with pytest.raises(ArtifactError) as exc:
        backbone_from_source(tmp_path / "shape.pth")
    assert "layer1.0.conv1.weight [64, 64, 1, 1] (ours [64, 64, 3, 3])" in _one_line(exc)
    torch.save({"epoch": 3, "arch": "resnet18"}, tmp_path / "nothing.pth")
    with pytest.raises(ArtifactError, match="holds no state dict"):
        read_pretrained(tmp_path / "nothing.pth")


def test_errors__vit_patch_size_refused_image_size_interpolated(sources, tmp_path, caplog):
    path, _ = sources["moco_v3_vit"]
    pre = read_pretrained(path)
    with pytest.raises(ConfigError) as exc:
        configure(_train_cfg(tmp_path, path, moco_version=3, patch_size=4), pre)
    assert "expected patch 4, found 8" in _one_line(exc)
    with pytest.raises(ConfigError, match="not a multiple of the --init file's patch size 8"):
        backbone_from_source(path, image_size=36)
    caplog.set_level("INFO", logger="moco_retrieval.trainer.pretrained")
    built = backbone_from_source(path, image_size=64)
    assert built.notes == [
        "position embedding interpolated from a 4x4 to a 8x8 grid (image size 32 -> 64 px at patch 8)"
    ]
    assert "interpolated" in caplog.text
    with torch.no_grad():
        assert built.backbone(torch.randn(1, 3, 64, 64)).shape == (1, 192)


def test_errors__truncated_files(sources, tmp_path):
    for name in ("torchvision", "timm_resnet"):
        data = sources[name][0].read_bytes()
        cut = tmp_path / f"cut-{sources[name][0].name}"
        cut.write_bytes(data[: len(data) // 2])
        with pytest.raises(ArtifactError) as exc:
            read_pretrained(cut)
        assert "truncated" in _one_line(exc)
    with pytest.raises(ArtifactError, match="no checkpoint at"):
        read_pretrained(tmp_path / "absent.pth")


class _RunsCode:
    """Unpickling this calls ``os.system`` (what a crafted checkpoint does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_errors__crafted_pickle_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pth"
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "payload": _RunsCode(marker)}, evil)
    with pytest.raises(ArtifactError) as exc:
        read_pretrained(evil)
    assert "refusing to load it (loading could run code)" in _one_line(exc)
    assert not marker.exists()
    assert main(["export", "--init", str(evil), "--out", str(tmp_path / "e.onnx")]) == 4
    assert not marker.exists() and not (tmp_path / "e.onnx").exists()


# -- the recipe with --init -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("moco_version, on_gpu", [(2, False), (2, True), (3, False)])
def test_recipe__init_keeps_the_measured_cpu_v2_values_and_elsewhere_lowers_lr_raises_momentum(
    moco_version, on_gpu, tmp_path
):
    def resolved(**extra):
        cfg = tiny_train_config(
            tmp_path, tmp_path, moco_version=moco_version, batch_size=32, queue_size=None, epochs=20, **extra
        )
        return resolve_for_images(cfg, 1600, on_gpu=on_gpu)

    scratch, init = resolved(), resolved(init="weights.pth")
    if moco_version == 2 and not on_gpu:  # measured: the from-scratch lr and key momentum did better
        assert (init.lr, init.momentum, init.warmup_epochs) == (scratch.lr, scratch.momentum, scratch.warmup_epochs)
        assert "init_transfer_variants_cpu.json" in init.derived["lr"]["why"]
        return
    assert init.lr == pytest.approx(0.1 * scratch.lr, rel=1e-3)
    assert init.warmup_epochs <= scratch.warmup_epochs and (moco_version == 2 or init.warmup_epochs < 1)
    assert init.momentum > scratch.momentum
    for name in ("lr", "momentum", "warmup_epochs"):
        assert NOT_MEASURED in init.derived[name]["why"] and NOT_MEASURED not in scratch.derived[name]["why"]


# -- the commands ----------------------------------------------------------------------------------------------
def test_train__starts_from_init_records_it_and_resumes_the_identical_command(sources, shapes_dir, tmp_path):
    from moco_retrieval.trainer.train import run, setup, train

    path, reference = sources["torchvision"]
    cfg = tiny_train_config(shapes_dir, tmp_path / "run", epochs=1, arch="auto", init=str(path))
    trainee, progress = setup(cfg, torch.device("cpu"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for encoder in (trainee.model.encoder_q, trainee.model.encoder_k):
            assert torch.allclose(encoder.backbone.eval()(x), reference(x), atol=1e-5)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["arch"] == "resnet18" and saved["init"] == str(path)
    assert saved["derived"]["arch"]["requested"] == "auto"
    report = saved["init_report"]
    assert report["sha256"] == sha256_file(path) and report["layout"] == "state_dict"
    assert report["loaded"][0].startswith("backbone") and report["ignored"] == ["fc.* (2 tensors)"]
    assert report["fresh"] == ["projection head (the file has none)"]
    assert saved["derived"]["lr"]["why"].startswith("--init, MoCo v2 on a CPU")  # the --init rule was applied
    run(trainee, progress)
    again = train(cfg)  # the identical command: resumes (the run is complete), the file is not read again
    assert again.steps == progress.step and again.stopped_by == "epochs"
    with pytest.raises(ConfigError, match="init="):
        train(cfg.replace(init=str(sources["moco_v2"][0])))


def test_export_index_search__from_a_torchvision_state_dict(sources, shapes_dir, tmp_path, capsys):
    path, reference = sources["torchvision"]
    onnx_path = tmp_path / "encoder.onnx"
    assert (
        main(["export", "--init", str(path), "--arch", "resnet18", "--image-size", "32", "--out", str(onnx_path)]) == 0
    )
    meta = read_encoder_metadata(onnx_path)
    assert meta["init_source"] == path.name and meta["init_sha256"] == sha256_file(path)
    assert (meta["arch"], meta["moco_version"], meta["image_size"]) == ("resnet18", 0, 32)
    images = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    (out,) = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(
        ["embeddings"], {"images": images}
    )
    assert meta["mirror_average"] == 1  # the default readout: each image with its mirror
    with torch.no_grad():
        assert compare(out, reference_embeddings(readout(reference, True)[0], images), FP32_TOLERANCE).passed
    index = tmp_path / "index"
    assert main(["index", str(shapes_dir), "--model", str(onnx_path), "--out", str(index)]) == 0
    query = sorted(shapes_dir.rglob("*.png"))[5]
    capsys.readouterr()
    assert main(["search", str(index), str(query), "-k", "3", "--json", "--device", "cpu"]) == 0
    hits = json.loads(capsys.readouterr().out)
    hits = hits["results"] if isinstance(hits, dict) else hits
    assert Path(hits[0]["path"]).name == query.name and hits[0]["score"] == pytest.approx(1.0, abs=1e-4)
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    engine = SearchEngine(index, EngineConfig(device="cpu", threads=1, poll_seconds=0))  # what moco serve runs
    try:
        assert engine.stats()["model"]["init_source"] == path.name
    finally:
        engine.close()


def test_export__moco_v3_vit_layout_matches_within_the_export_tolerance(sources, tmp_path):
    path, reference = sources["moco_v3_vit"]
    result = export_pretrained(path, tmp_path / "vit.onnx", arch="vit_tiny")
    assert all(check.passed for check in result.checks)
    assert result.metadata["init_layout"] == "moco_v3" and result.metadata["moco_version"] == "3"
    images = np.random.default_rng(1).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    (out,) = ort.InferenceSession(str(tmp_path / "vit.onnx"), providers=["CPUExecutionProvider"]).run(
        ["embeddings"], {"images": images}
    )
    assert read_encoder_metadata(tmp_path / "vit.onnx")["mirror_average"] == 1
    with torch.no_grad():
        assert compare(out, reference_embeddings(readout(reference, True)[0], images), FP32_TOLERANCE).passed


def test_export_cli__needs_one_source(tmp_path, capsys):
    assert main(["export", "--out", str(tmp_path / "e.onnx")]) == 2
    assert "either a run directory" in capsys.readouterr().err


def test_eval_knn__accepts_the_same_source(sources, shapes_dir, tmp_path, capsys):
    path, _ = sources["moco_v2"]
    out = tmp_path / "knn.json"
    assert (
        main(
            [
                "eval",
                "knn",
                "--train",
                str(shapes_dir),
                "--test",
                str(shapes_dir),
                str(path),
                "--image-size",
                "32",
                "--k",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["model"]["model_kind"] == "weights" and doc["model"]["layout"] == "moco_v2"
    assert doc["model"]["sha256"] == sha256_file(path) and 0.0 <= doc["results"][0]["top1"] <= 1.0


def test_model_label__names_the_moco_version_or_the_weights_file():
    from moco_retrieval.contracts.encoder_format import model_label

    assert model_label({"moco_version": 2, "arch": "resnet50"}) == "MoCo v2 resnet50"
    assert (
        model_label({"moco_version": "0", "arch": "resnet18", "init_source": "r18.pth"})
        == "resnet18 (weights from r18.pth)"
    )
