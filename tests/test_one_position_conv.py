"""The one-position convolution: the same outputs and gradients as ``nn.Conv2d``, and where it takes effect."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from moco_retrieval.trainer.backbones import build_resnet
from moco_retrieval.trainer.one_position_conv import (
    OnePositionConv2d,
    one_position_window,
    use_one_position_convs,
    use_plain_convs,
)


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "expected"),
    [
        (1, 3, 1, 1, (1, 1)),  # layer4's 3x3 on a 1x1 map: the centre tap only
        (2, 3, 1, 1, None),  # a 2x2 map keeps two output positions: the plain convolution
        (2, 3, 2, 1, (2, 1)),  # layer4's first strided 3x3, 2x2 -> 1x1: taps 1 and 2
        (3, 3, 2, 1, None),  # 3x3 -> 2x2
        (2, 1, 2, 0, (1, 0)),  # the 1x1 strided shortcut, 2x2 -> 1x1: the top-left pixel
        (4, 7, 2, 3, None),
        (1, 7, 2, 3, (1, 3)),
    ],
)
def test_one_position_window__only_where_the_output_has_one_position(size, kernel, stride, padding, expected):
    assert one_position_window(size, kernel, stride, padding) == expected


@pytest.mark.parametrize(
    ("size", "conv"),
    [
        (1, dict(kernel_size=3, stride=1, padding=1)),
        (2, dict(kernel_size=3, stride=2, padding=1)),
        (2, dict(kernel_size=1, stride=2, padding=0, bias=True)),
        (1, dict(kernel_size=(3, 1), stride=1, padding=(1, 0), bias=True)),
        (3, dict(kernel_size=3, stride=1, padding=1)),  # more than one position: the plain path
    ],
)
def test_one_position_conv__outputs_and_gradients_equal_the_convolution(size, conv):
    torch.manual_seed(0)
    plain = nn.Conv2d(6, 5, **{"bias": False, **conv}).double()
    fast = copy.deepcopy(plain)
    fast.__class__ = OnePositionConv2d
    x = torch.randn(4, 6, size, size, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [plain(xs[0]), fast(xs[1])]
    assert outs[0].shape == outs[1].shape
    torch.testing.assert_close(outs[1], outs[0])
    grad = torch.randn_like(outs[0])
    for out in outs:
        out.backward(grad)
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    torch.testing.assert_close(fast.weight.grad, plain.weight.grad)
    if plain.bias is not None:
        torch.testing.assert_close(fast.bias.grad, plain.bias.grad)


def test_build_resnet__one_position_convs_keep_torchvision_state_dict_and_results_at_28_px():
    """ResNet-18 with the ImageNet stem ends on a 1x1 map at 28 px: same keys as torchvision's, same features and
    gradients as the plain convolutions (float64), and the layer4 convolutions do take the matrix-product path."""
    torch.manual_seed(0)
    backbone, dim = build_resnet("resnet18", "imagenet")
    reference = torchvision.models.resnet18(weights=None)
    reference.fc = nn.Identity()
    assert backbone.state_dict().keys() == reference.state_dict().keys() and dim == 512
    assert type(backbone.layer4[1].conv2) is OnePositionConv2d
    plain = use_plain_convs(copy.deepcopy(backbone)).double()
    assert not any(type(m) is OnePositionConv2d for m in plain.modules())
    backbone = backbone.double()
    calls = []
    backbone.layer4[1].conv2.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2:]))
    x = torch.randn(3, 3, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(backbone(x), plain(x))
    backbone(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, fast), slow in zip(backbone.named_parameters(), plain.parameters()):
        torch.testing.assert_close(fast.grad, slow.grad, msg=name)
    assert calls == [torch.Size([1, 1]), torch.Size([1, 1])]


def test_use_one_position_convs__leaves_other_modules_and_string_padding_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 4, 1), nn.Linear(4, 2))
    use_one_position_convs(model)
    assert [type(m) for m in model] == [nn.Conv2d, OnePositionConv2d, nn.Linear]
