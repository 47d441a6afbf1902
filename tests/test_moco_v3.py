"""MoCo v3 building blocks against hand computations: loss, momentum schedule, LARS, ViT stability recipe,
paper defaults; and v3 ResNet-18 / ViT-Tiny learning on the generated shapes."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F
from timm.layers import build_sincos2d_pos_embed

from moco_retrieval.contracts.errors import ConfigError
from tests.conftest import resolved_config, tiny_train_config
from moco_retrieval.trainer.batch_augment import MOCO_V3_VIEWS
from moco_retrieval.trainer.config import TrainConfig, add_arguments, from_arguments
from moco_retrieval.trainer.lars import LARS
from moco_retrieval.trainer.moco import MoCoV3, contrastive_loss
from moco_retrieval.trainer.train import train
from moco_retrieval.trainer.variants import MoCoV2Variant, build_model, variant_for


def build_optimizer(cfg: TrainConfig, model):
    return variant_for(cfg).build_optimizer(cfg, model)


def _v3(arch: str = "resnet18", **overrides) -> TrainConfig:
    values = dict(
        data_dir="-",
        out_dir="-",
        moco_version=3,
        arch=arch,
        stem="imagenet",
        image_size=32,
        epochs=2,
        batch_size=8,
        dim=16,
        mlp_hidden=32,
        recipe="paper",
    )
    values.update(overrides)
    return resolved_config(TrainConfig(**values), num_images=64)


# ---- loss ------------------------------------------------------------------------------------------------
def test_contrastive_loss__matches_hand_computation():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # T = 1: logits [[1, 0], [0, 1]]; each row's CE is log(1 + e^-1); scaled by 2T = 2
    assert contrastive_loss(q, k, 1.0).item() == pytest.approx(2 * math.log(1 + math.exp(-1)), rel=1e-6)
    # T = 0.5: logits [[2, 0], [0, 2]]; CE log(1 + e^-2); scaled by 2T = 1. Norms of q and k do not matter.
    assert contrastive_loss(3 * q, 0.5 * k, 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-6)


def test_contrastive_loss__is_cross_entropy_scaled_by_two_t():
    torch.manual_seed(0)
    q, k = torch.randn(6, 4), torch.randn(6, 4)
    for t in (0.2, 1.0):
        logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / t
        expected = 2 * t * F.cross_entropy(logits, torch.arange(6))
        assert contrastive_loss(q, k, t).item() == pytest.approx(expected.item(), rel=1e-6)


def test_contrastive_loss__positives_sit_in_this_ranks_slice_of_the_gathered_keys(monkeypatch):
    from moco_retrieval.trainer import dist

    torch.manual_seed(0)
    q_all, k_all = torch.randn(8, 4), torch.randn(8, 4)
    monkeypatch.setattr(dist, "rank", lambda: 1)  # rank 1 of 2: its batch is samples 4..7
    monkeypatch.setattr(dist, "gather_no_grad", lambda k: F.normalize(k_all, dim=1))  # rank 0 sent 0..3
    logits = F.normalize(q_all[4:], dim=1) @ F.normalize(k_all, dim=1).T / 0.2
    expected = 0.4 * F.cross_entropy(logits, torch.arange(4, 8))
    assert contrastive_loss(q_all[4:], k_all[4:], 0.2).item() == pytest.approx(expected.item(), rel=1e-6)


def test_moco_v3__loss_is_symmetric_in_its_two_views():
    torch.manual_seed(0)
    model = build_model(_v3())
    x1, x2 = torch.randn(8, 3, 32, 32), torch.randn(8, 3, 32, 32)
    with torch.no_grad():  # m = 1 keeps the key encoder fixed between the two calls
        a, b = model(x1, x2, 1.0), model(x2, x1, 1.0)
    assert a.item() == pytest.approx(b.item(), rel=1e-5)


def test_moco_v3__loss_is_sum_of_both_directions_from_predictor_and_key_encoder():
    torch.manual_seed(0)
    model = build_model(_v3())
    x1, x2 = torch.randn(8, 3, 32, 32), torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        loss = model(x1, x2, 1.0)
        q1, q2 = model.predictor(model.encoder_q(x1)), model.predictor(model.encoder_q(x2))
        k1, k2 = model.encoder_k(x1), model.encoder_k(x2)
        expected = contrastive_loss(q1, k2, 1.0) + contrastive_loss(q2, k1, 1.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_moco_v3__heads_have_paper_shape():
    resnet = build_model(_v3())
    vit = build_model(_v3("vit_tiny"))
    linears = lambda seq: [m for m in seq if isinstance(m, torch.nn.Linear)]  # noqa: E731
    assert len(linears(resnet.encoder_q.head)) == 2 and len(linears(vit.encoder_q.head)) == 3
    assert len(linears(resnet.predictor)) == 2 and len(linears(vit.predictor)) == 2
    last = resnet.encoder_q.head[-1]
    assert isinstance(last, torch.nn.BatchNorm1d) and not last.affine  # last BN without affine parameters
    assert isinstance(resnet.encoder_q.head[1], torch.nn.BatchNorm1d) and resnet.encoder_q.head[1].affine
    assert not hasattr(resnet, "queue") and not hasattr(resnet.encoder_k, "predictor")


# ---- schedules and optimizers ------------------------------------------------------------------------------
def test_key_momentum__rises_from_099_to_1_on_a_cosine():
    v3 = variant_for(_v3())
    assert v3.key_momentum(0.99, 0.0) == pytest.approx(0.99)
    assert v3.key_momentum(0.99, 0.5) == pytest.approx(0.995)
    assert v3.key_momentum(0.99, 0.25) == pytest.approx(1 - 0.01 * (1 + math.cos(math.pi / 4)) / 2)
    assert v3.key_momentum(0.99, 1.0) == pytest.approx(1.0)
    v2 = MoCoV2Variant()
    assert v2.key_momentum(0.999, 0.0) == v2.key_momentum(0.999, 0.99) == 0.999


def test_lars__one_step_matches_hand_computation():
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))  # ||w|| = 5
    b = torch.nn.Parameter(torch.tensor([1.0]))
    w.grad, b.grad = torch.tensor([[0.6, 0.8]]), torch.tensor([0.5])
    opt = LARS([{"params": [w]}, {"params": [b], "lars_exclude": True}], lr=0.5, weight_decay=0.1, momentum=0.9)
    opt.step()
    # d = g + 0.1 w = [0.9, 1.2], ||d|| = 1.5; trust = 0.001 * 5 / 1.5; w -= 0.5 * trust * d
    trust = 0.001 * 5 / 1.5
    assert torch.allclose(w.detach(), torch.tensor([[3 - 0.5 * trust * 0.9, 4 - 0.5 * trust * 1.2]]), atol=1e-7)
    assert b.item() == pytest.approx(1.0 - 0.5 * 0.5)  # excluded: plain SGD, no decay, no trust ratio
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    opt.step()  # zero gradient: the momentum buffer alone moves the excluded bias again by 0.9 * its last step
    assert b.item() == pytest.approx(0.75 - 0.5 * 0.9 * 0.5)


def test_build_optimizer__lars_for_resnet_adamw_for_vit_without_decay_on_biases_and_norms():
    resnet = build_model(_v3())
    opt = build_optimizer(_v3(), resnet)
    assert isinstance(opt, LARS)
    decayed, exempt = opt.param_groups
    assert not decayed["lars_exclude"] and exempt["lars_exclude"]
    assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim <= 1 for p in exempt["params"])
    trainable = {id(p) for p in resnet.parameters() if p.requires_grad}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == trainable
    vit_cfg = _v3("vit_tiny")
    opt = build_optimizer(vit_cfg, build_model(vit_cfg))
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_vit__patch_projection_and_position_table_stay_fixed_after_a_step():
    torch.manual_seed(0)
    cfg = _v3("vit_tiny", lr=1e-3)
    model = build_model(cfg)
    vit = model.encoder_q.backbone
    assert vit.patch_embed.proj.kernel_size == (4, 4)  # auto patch size at 32 px
    frozen = {name: p.detach().clone() for name, p in vit.named_parameters() if not p.requires_grad}
    assert set(frozen) == {"pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"}
    table = build_sincos2d_pos_embed([8, 8], dim=192)
    assert torch.equal(frozen["pos_embed"][0, 1:], table) and not frozen["pos_embed"][0, 0].any()
    block_before = vit.blocks[0].attn.qkv.weight.detach().clone()
    opt = build_optimizer(cfg, model)
    for group in opt.param_groups:
        group["lr"] = 1e-3
    loss = model(torch.randn(8, 3, 32, 32), torch.randn(8, 3, 32, 32), 0.99)
    opt.zero_grad()
    loss.backward()
    opt.step()
    for name, p in vit.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    assert not torch.equal(vit.blocks[0].attn.qkv.weight, block_before)  # the rest of the ViT did train


def test_v3_views__are_asymmetric():
    first, second = variant_for(_v3()).views()
    assert (first, second) == MOCO_V3_VIEWS
    assert (first.blur_p, second.blur_p) == (1.0, 0.1) and (first.solarize_p, second.solarize_p) == (0.0, 0.2)
    assert first.crop_scale == (0.08, 1.0) and first.saturation == 0.2


# ---- configuration ---------------------------------------------------------------------------------------
def _cli_config(*args: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = from_arguments(parser.parse_args(["--recipe", "paper", *args]), data_dir="data", out_dir="run")
    return resolved_config(cfg, num_images=1024)


def test_config__moco_version_3_alone_gets_the_paper_values():
    resnet = _cli_config("--moco-version", "3", "--epochs", "100")
    assert (resnet.lr, resnet.weight_decay, resnet.warmup_epochs) == (0.6, 1e-6, pytest.approx(10.0))
    assert (resnet.temperature, resnet.momentum, resnet.dim, resnet.mlp_hidden) == (1.0, 0.99, 256, 4096)
    assert resnet.queue_size == 0
    vit = _cli_config("--moco-version", "3", "--arch", "vit_small", "--epochs", "300")
    assert (vit.lr, vit.weight_decay, vit.warmup_epochs, vit.temperature) == (1.5e-4, 0.1, pytest.approx(40.0), 0.2)
    v2 = _cli_config("--epochs", "200")
    assert (v2.lr, v2.weight_decay, v2.warmup_epochs, v2.queue_size) == (0.03, 1e-4, 0.0, 512)  # capped at half
    assert v2.derived["queue_size"]["why"].startswith("65536 is more than half of the 1024 images")
    assert (v2.temperature, v2.momentum, v2.dim, v2.mlp_hidden) == (0.2, 0.999, 128, 0)
    explicit = _cli_config("--moco-version", "3", "--temperature", "0.5", "--lr", "1.0")
    assert (explicit.temperature, explicit.lr) == (0.5, 1.0)


def test_config__v3_round_trips_through_json_and_skips_queue_check():
    cfg = _v3(batch_size=24, queue_size=100, recipe="paper")  # v2 would refuse a queue not a multiple of the batch
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg and json.loads(cfg.to_json())["temperature"] == 1.0


def test_config__vit_needs_v3_and_enough_patches():
    with pytest.raises(ConfigError, match="needs --moco-version 3"):
        TrainConfig(data_dir="-", out_dir="-", arch="vit_tiny")
    with pytest.raises(ConfigError, match="fewer than 4 patches"):
        TrainConfig(data_dir="-", out_dir="-", moco_version=3, arch="vit_tiny", image_size=32, patch_size=32)


def test_moco_v3__model_type_and_vit_output_shape():
    model = build_model(_v3("vit_tiny"))
    assert isinstance(model, MoCoV3) and model.temperature == 0.2
    model.eval()
    assert model.backbone(torch.randn(2, 3, 32, 32)).shape == (2, 192)


@pytest.mark.parametrize("arch, lr", [("resnet18", 2.0), ("vit_tiny", 1e-3)])
def test_moco_v3__optimizer_step_fits_instance_discrimination_on_a_fixed_batch(arch, lr):
    """The objective, optimizer and momentum encoder together learn: two noisy views of 16 fixed images become
    recognisable as pairs (the loss starts near its chance value 2 * 2T * log(16) and falls by a quarter)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = _v3(
        arch, batch_size=16, lr=lr, lr_scale=False, temperature=0.2, patch_size=8 if arch != "resnet18" else 0, epochs=1
    )
    model = build_model(cfg)
    opt = build_optimizer(cfg, model)
    for group in opt.param_groups:
        group["lr"] = lr
    x = torch.randn(16, 3, 32, 32)
    losses = []
    for step in range(20):
        m = variant_for(cfg).key_momentum(0.99, step / 20)
        loss = model(x + 0.3 * torch.randn_like(x), x + 0.3 * torch.randn_like(x), m)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    chance = 2 * 2 * 0.2 * math.log(16)
    assert losses[0] > 0.9 * chance
    assert sum(losses[-3:]) / 3 < 0.75 * losses[0], losses  # a quarter of the loss gone in 20 steps


def test_train_v3_vit__resume_gives_same_parameters_as_straight_run(shapes_dir, tmp_path):
    torch.set_num_threads(1)
    cfg = lambda out: tiny_train_config(  # noqa: E731
        shapes_dir,
        out,
        moco_version=3,
        arch="vit_tiny",
        patch_size=8,  # noqa: E731
        epochs=2,
        dim=16,
        mlp_hidden=32,
        lr=1e-3,
        lr_scale=False,
    )
    straight = train(cfg(tmp_path / "straight"))
    train(cfg(tmp_path / "resumed"), stop_at_epoch=1)
    resumed = train(cfg(tmp_path / "resumed"))  # continues from checkpoint_last.pt: AdamW state and momentum schedule
    assert straight.steps == resumed.steps == 2 * (96 // 16)
    a = torch.load(tmp_path / "straight" / "checkpoint_last.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "checkpoint_last.pt", weights_only=False)
    # the auto recipe: T 0.2 and a warm-up of 1 epoch capped at 10% of the 2-epoch run
    assert a["config"]["temperature"] == 0.2 and a["config"]["warmup_epochs"] == pytest.approx(0.2)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
