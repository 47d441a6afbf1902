"""MoCo v2 building blocks against hand computations: InfoNCE, queue, momentum update, shuffle-BN, split-BN,
multi-crop's small crops, the symmetric loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.trainer.backbones import SplitBatchNorm2d, build_resnet
from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.moco import (
    MoCoV2,
    batch_shuffle,
    batch_unshuffle,
    info_nce_logits,
    momentum_update_,
)
from moco_retrieval.trainer.schedule import Schedule


def test_info_nce_logits__match_hand_computation():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    queue = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])  # columns are keys: (1,0), (0,1), (-1,0)
    logits, labels = info_nce_logits(q, k, queue, temperature=0.5)
    expected = torch.tensor([[0.6, 1.0, 0.0, -1.0], [1.0, 0.0, 1.0, 0.0]]) / 0.5
    torch.testing.assert_close(logits, expected)
    assert labels.tolist() == [0, 0]
    loss = F.cross_entropy(logits, labels)
    row0 = -math.log(math.exp(1.2) / (math.exp(1.2) + math.exp(2.0) + 1 + math.exp(-2.0)))
    row1 = -math.log(math.exp(2.0) / (math.exp(2.0) + 1 + math.exp(2.0) + 1))
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)


def _tiny_moco(queue_size: int = 8, dim: int = 4) -> MoCoV2:
    backbone, feature_dim = build_resnet("resnet18", "imagenet")
    return MoCoV2(backbone, feature_dim, dim=dim, queue_size=queue_size)


def test_queue__wraps_when_full():
    model = _tiny_moco(queue_size=6, dim=4)
    batches = [torch.full((2, 4), float(i)) for i in range(1, 5)]
    for keys in batches[:3]:
        model.dequeue_and_enqueue(keys)
    assert int(model.queue_ptr) == 0  # 3 batches of 2 filled 6 slots and wrapped
    model.dequeue_and_enqueue(batches[3])
    assert int(model.queue_ptr) == 2
    assert model.queue[:, 0:2].eq(4.0).all()  # the oldest keys were overwritten
    assert model.queue[:, 2:4].eq(2.0).all() and model.queue[:, 4:6].eq(3.0).all()


def test_queue__rejects_batch_not_dividing_queue():
    model = _tiny_moco(queue_size=6)
    with pytest.raises(ValueError, match="multiple"):
        model.dequeue_and_enqueue(torch.zeros(4, 4))


def test_momentum_update__follows_formula():
    key = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    query = [torch.tensor([0.0, 4.0]), torch.tensor([[-1.0]])]
    momentum_update_(key, query, 0.9)
    torch.testing.assert_close(key[0], torch.tensor([0.9, 2.2]))
    torch.testing.assert_close(key[1], torch.tensor([[2.6]]))


def test_momentum_update__key_encoder_starts_as_copy_and_moves_towards_query():
    model = _tiny_moco()
    for pq, pk in zip(model.encoder_q.parameters(), model.encoder_k.parameters()):
        assert torch.equal(pq, pk) and not pk.requires_grad
    with torch.no_grad():
        for p in model.encoder_q.parameters():
            p.add_(1.0)
    before = [p.clone() for p in model.encoder_k.parameters()]
    model.momentum_update(0.99)
    for pk, b in zip(model.encoder_k.parameters(), before):
        torch.testing.assert_close(pk, b + 0.01)


def test_batch_shuffle__unshuffle_is_identity_on_outputs():
    x = torch.arange(24.0).view(8, 3)
    shuffled, idx_unshuffle = batch_shuffle(x)
    assert not torch.equal(shuffled, x) or x.shape[0] == 1
    assert sorted(shuffled[:, 0].tolist()) == x[:, 0].tolist()  # a permutation
    outputs = shuffled * 2 + 1  # any per-sample function
    torch.testing.assert_close(batch_unshuffle(outputs, idx_unshuffle), x * 2 + 1)


def test_split_bn__normalises_each_block_of_the_batch_separately_and_is_plain_bn_in_eval():
    torch.manual_seed(0)
    bn = SplitBatchNorm2d(3, num_splits=2)
    x = torch.randn(8, 3, 4, 4)
    x[:4] += 5.0  # group 0 (the first half of the batch) has a different mean from group 1
    out = bn(x)
    for g in range(2):
        group = out[4 * g : 4 * (g + 1)]
        torch.testing.assert_close(group.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    plain = torch.nn.BatchNorm2d(3)
    plain.load_state_dict(bn.state_dict())
    bn.eval(), plain.eval()
    torch.testing.assert_close(bn(x), plain(x))


def test_split_bn__equals_one_plain_bn_per_block_in_both_layouts_and_keeps_channels_last():
    torch.manual_seed(0)
    x = torch.randn(12, 5, 6, 6) * 3 + 1
    blocks = [torch.nn.BatchNorm2d(5) for _ in range(3)]
    expected = torch.cat([bn(part) for bn, part in zip(blocks, x.split(4))])
    for layout in (torch.contiguous_format, torch.channels_last):
        split = SplitBatchNorm2d(5, num_splits=3)
        out = split(x.contiguous(memory_format=layout).requires_grad_())
        assert out.is_contiguous(memory_format=layout)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(split.running_mean, torch.stack([bn.running_mean for bn in blocks]).mean(0))
        torch.testing.assert_close(split.running_var, torch.stack([bn.running_var for bn in blocks]).mean(0))
        assert int(split.num_batches_tracked) == 1
        out.square().sum().backward()  # gradients flow through every block


def test_forward__returns_finite_loss_and_enqueues_keys():
    torch.manual_seed(0)
    backbone, feature_dim = build_resnet("resnet18", "imagenet", bn_splits=2)
    model = MoCoV2(backbone, feature_dim, dim=8, queue_size=16)
    queue_before = model.queue.clone()
    loss = model(torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32), 0.99)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert model.encoder_q.backbone.conv1.weight.grad is not None
    assert model.encoder_k.backbone.conv1.weight.grad is None
    assert int(model.queue_ptr) == 4 and not torch.equal(model.queue[:, :4], queue_before[:, :4])


def test_small_crops__weigh_as_many_queries_as_they_are_and_only_the_keys_enter_the_queue():
    """Small crops that are copies of the first view are S more copies of its query: the mean over 1 + S equal
    losses is the two-view loss (with one BN group, whose statistics copies leave as they are). Different crops
    change it, get gradients, and add nothing to the queue."""
    torch.manual_seed(0)
    backbone, feature_dim = build_resnet("resnet18", "imagenet", bn_splits=1)
    model = MoCoV2(backbone, feature_dim, dim=8, queue_size=16)
    x1, x2 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    losses = {}
    for name, small in (("two views", None), ("copies", x1.repeat(3, 1, 1, 1)), ("crops", torch.randn(12, 3, 16, 16))):
        torch.manual_seed(1)  # the same shuffle-BN permutation in each
        losses[name] = copy.deepcopy(model)(x1, x2, 0.99, small)
    assert losses["copies"].item() == pytest.approx(losses["two views"].item(), rel=1e-5)
    assert abs(losses["crops"].item() - losses["two views"].item()) > 1e-3
    trained, two_views = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1)
    trained(x1, x2, 0.99, 5 * torch.randn(12, 3, 16, 16)).backward()
    torch.manual_seed(1)
    two_views(x1, x2, 0.99)
    assert trained.encoder_q.backbone.conv1.weight.grad is not None
    assert int(trained.queue_ptr) == 4  # one key per image, not per crop
    running = {k: v for k, v in trained.encoder_q.state_dict().items() if "running_" in k}
    assert len(running) == 2 * 20  # mean and variance of ResNet-18's 20 BN layers: the full-size views' alone
    for name, buffer in running.items():
        assert torch.equal(buffer, two_views.encoder_q.state_dict()[name]), name
    assert trained.encoder_q.backbone.bn1.momentum == 0.1


def test_symmetric__is_the_mean_of_both_directions_and_enqueues_the_second_views_keys():
    """With one BN group (batch statistics do not depend on the shuffle), the symmetric loss is the mean of the
    one-way losses x1 -> x2 and x2 -> x1 of two copies of the model, gradients included; the queue gets x2's
    keys, as the one-way model's does."""
    torch.manual_seed(0)
    backbone, feature_dim = build_resnet("resnet18", "imagenet", bn_splits=1)
    one_way = MoCoV2(backbone, feature_dim, dim=8, queue_size=16)
    symmetric = copy.deepcopy(one_way)
    symmetric.symmetric = True
    reverse = copy.deepcopy(one_way)
    x1, x2 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    loss_12, loss_21 = one_way(x1, x2, 0.99), reverse(x2, x1, 0.99)
    loss = symmetric(x1, x2, 0.99)
    assert loss.item() == pytest.approx((loss_12.item() + loss_21.item()) / 2, rel=1e-5)
    assert abs(loss_12.item() - loss_21.item()) > 1e-4  # the two directions differ: the mean is not either alone
    ((loss_12 + loss_21) / 2).backward()  # each copy's gradient is half its own loss's
    loss.backward()
    torch.testing.assert_close(
        symmetric.encoder_q.backbone.conv1.weight.grad,
        one_way.encoder_q.backbone.conv1.weight.grad + reverse.encoder_q.backbone.conv1.weight.grad,
        rtol=1e-3,
        atol=1e-4,  # gradients of order 1, summed in another order
    )
    assert int(symmetric.queue_ptr) == 4
    torch.testing.assert_close(symmetric.queue, one_way.queue)


def test_symmetric__config_round_trips_and_refuses_v3_and_small_crops():
    cfg = TrainConfig(data_dir="d", out_dir="o", symmetric=True)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert TrainConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "symmetric"}).symmetric is False
    for changes in ({"moco_version": 3}, {"small_crops": 2}):
        with pytest.raises(ConfigError, match="--symmetric is for MoCo v2"):
            TrainConfig(data_dir="d", out_dir="o", symmetric=True, **changes)


def test_small_crops__config_refuses_v3_vits_and_sizes_out_of_range():
    cfg = TrainConfig(data_dir="d", out_dir="o", image_size=32, small_crops=4)
    assert cfg.resolved_small_crop_size == 16 and TrainConfig.from_json(cfg.to_json()) == cfg
    assert (
        TrainConfig(
            data_dir="d", out_dir="o", image_size=32, small_crops=2, small_crop_size=24
        ).resolved_small_crop_size
        == 24
    )
    assert TrainConfig(data_dir="d", out_dir="o", image_size=16, small_crops=2).resolved_small_crop_size == 8
    for changes, message in (
        ({"moco_version": 3}, "needs MoCo v2"),
        ({"moco_version": 3, "arch": "vit_tiny"}, "needs MoCo v2"),
        ({"small_crop_size": 4}, "small-crop-size"),
        ({"small_crop_size": 40}, "small-crop-size"),
        ({"small_crops": -1}, ">= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(data_dir="d", out_dir="o", image_size=32, **{"small_crops": 2, **changes})


def test_lr_schedule__warmup_then_cosine_to_zero():
    schedule = Schedule(peak_lr=0.03, warmup_steps=100, total_steps=1000, m0=0.999, momentum_fn=lambda m, p: m)
    assert schedule.lr(0) == pytest.approx(0.03 / 100)
    assert schedule.lr(99) == pytest.approx(0.03)
    assert schedule.lr(100) == pytest.approx(0.03)
    assert schedule.lr(550) == pytest.approx(0.015)
    assert schedule.lr(999) == pytest.approx(0.0, abs=1e-5)
    assert schedule.lr(1500) == pytest.approx(0.0, abs=1e-12)  # past the end (a run stopped late): stays at 0


def test_config__round_trips_json_and_scales_lr():
    cfg = TrainConfig(data_dir="d", out_dir="o", batch_size=512, queue_size=1024, amp=True, lr=0.03)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert cfg.effective_lr == pytest.approx(0.06)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"queue_size": 1000, "batch_size": 256}, "not a multiple"),
        ({"arch": "vgg"}, "unknown --arch"),
        ({"temperature": 0}, "must be positive"),
        ({"momentum": 1.0}, r"\[0, 1\)"),
        ({"device": "tpu"}, "unknown --device"),
    ],
)
def test_config__rejects_bad_values(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(data_dir="d", out_dir="o", **changes)


@pytest.mark.parametrize("stem, grid", [("imagenet", 1), ("nopool", 2), ("small", 4)])
def test_stems__the_resolution_each_leaves_at_layer4(stem, grid):
    backbone, dim = build_resnet("resnet18", stem)
    x = torch.randn(2, 3, 32, 32)
    trunk = torch.nn.Sequential(*list(backbone.children())[:-2])  # up to layer4, before the pooling
    assert trunk(x).shape == (2, dim, grid, grid)
    assert backbone(x).shape == (2, dim)
    with pytest.raises(ConfigError, match="nopool"):
        build_resnet("resnet18", "tiny")


@pytest.mark.parametrize("stem, grid", [("imagenet", 1), ("small", 4)])
def test_narrow_resnet18__a_quarter_of_the_channels_same_layout(stem, grid):
    backbone, dim = build_resnet("resnet18_narrow", stem, bn_splits=2)
    wide = build_resnet("resnet18", stem)[0].state_dict()
    narrow = backbone.state_dict()
    assert dim == 128 and set(narrow) == set(wide)  # torchvision's keys: --init, export and the heads see a ResNet-18
    assert narrow["conv1.weight"].shape[0] == 16 and narrow["layer4.1.conv2.weight"].shape[:2] == (128, 128)
    assert isinstance(backbone.bn1, SplitBatchNorm2d) and isinstance(backbone.layer3[0].downsample[1], SplitBatchNorm2d)
    params = sum(p.numel() for p in backbone.parameters())
    assert 0.6e6 < params < 0.8e6  # 1/16 of ResNet-18's 11.2M
    x = torch.randn(4, 3, 32, 32)
    trunk = torch.nn.Sequential(*list(backbone.children())[:-2])
    assert trunk(x).shape == (4, dim, grid, grid)
    assert backbone(x).shape == (4, dim)


def test_bn_splits__auto_makes_at_most_8_groups_of_at_least_min_bn_group_images():
    """The auto rule at and across ``MIN_BN_GROUP`` (16): the most groups (up to 8) that divide the batch and
    keep 16 images each; one group under DDP (shuffle-BN does it); a requested count must divide the batch."""
    from moco_retrieval.trainer.variants import MIN_BN_GROUP, MoCoV2Variant

    variant = MoCoV2Variant()
    assert MIN_BN_GROUP == 16
    auto = {batch: variant.bn_splits(0, batch, 1) for batch in (256, 128, 64, 48, 32, 31, 24, 16, 8)}
    assert auto == {256: 8, 128: 8, 64: 4, 48: 3, 32: 2, 31: 1, 24: 1, 16: 1, 8: 1}
    assert all(batch // g >= MIN_BN_GROUP or g == 1 for batch, g in auto.items())
    assert variant.bn_splits(0, 256, 2) == 1
    assert variant.bn_splits(4, 8, 1) == 4  # a requested count is the user's, small groups and all
    with pytest.raises(ConfigError, match="--bn-splits 3 must divide the per-process batch 64"):
        variant.bn_splits(3, 64, 1)
