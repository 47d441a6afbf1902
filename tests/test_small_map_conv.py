"""The small-map convolution: the same outputs and gradients as ``nn.Conv2d``, and where it takes effect."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from moco_retrieval.trainer.backbones import build_resnet
from moco_retrieval.trainer.small_map_conv import (
    SmallMapConv2d,
    one_position_window,
    small_map_taps,
    use_plain_convs,
    use_small_map_convs,
)


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "expected"),
    [
        (1, 3, 1, 1, (1, 1)),  # layer4's 3x3 on a 1x1 map: the centre tap only
        (2, 3, 1, 1, None),  # a 2x2 map keeps two output positions: not this path
        (2, 3, 2, 1, (2, 1)),  # layer4's first strided 3x3, 2x2 -> 1x1: taps 1 and 2
        (3, 3, 2, 1, None),  # 3x3 -> 2x2
        (2, 1, 2, 0, (1, 0)),  # the 1x1 strided shortcut, 2x2 -> 1x1: the top-left pixel
        (4, 7, 2, 3, None),
        (1, 7, 2, 3, (1, 3)),
    ],
)
def test_one_position_window__only_where_the_output_has_one_position(size, kernel, stride, padding, expected):
    assert one_position_window(size, kernel, stride, padding) == expected


def test_small_map_taps__place_each_kernel_tap_where_output_and_input_positions_meet():
    """A 3x3 kernel (padding 1) on a 2x2 map: output (0, 0) applies the centre tap to input (0, 0), the tap right
    of it to input (0, 1), the one below to input (1, 0); output (1, 1) applies the top-left tap to input (0, 0)."""
    weight = torch.arange(9.0).view(1, 1, 3, 3)  # tap (r, c) holds 3r + c
    taps = small_map_taps(weight, (2, 2), (1, 1), (1, 1))
    assert taps.tolist() == [[4, 5, 7, 8], [3, 4, 6, 7], [1, 2, 4, 5], [0, 1, 3, 4]]
    # stride 2 and padding 0, 2x3 -> 1x1 with a 2x2 kernel: only the inputs under the kernel, zero elsewhere
    weight = torch.arange(1.0, 5.0).view(1, 1, 2, 2)
    assert small_map_taps(weight, (2, 3), (2, 2), (0, 0)).tolist() == [[1, 2, 0, 3, 4, 0]]


@pytest.mark.parametrize(
    ("size", "conv"),
    [
        ((1, 1), dict(kernel_size=3, stride=1, padding=1)),
        ((2, 2), dict(kernel_size=3, stride=2, padding=1)),
        ((2, 2), dict(kernel_size=1, stride=2, padding=0, bias=True)),
        ((1, 1), dict(kernel_size=(3, 1), stride=1, padding=(1, 0), bias=True)),
        ((2, 2), dict(kernel_size=3, stride=1, padding=1)),  # layer3's 3x3 at 28-32 px: the small-map product
        ((2, 2), dict(kernel_size=3, stride=1, padding=1, bias=True)),
        ((2, 3), dict(kernel_size=(3, 5), stride=1, padding=(1, 2))),
        ((3, 3), dict(kernel_size=5, stride=2, padding=2)),
        ((1, 4), dict(kernel_size=3, stride=1, padding=1)),
        ((2, 2), dict(kernel_size=3, stride=1, padding=3)),  # padding past the kernel: the plain path
        ((3, 3), dict(kernel_size=3, stride=1, padding=1)),  # as many positions as taps: the plain path
        ((4, 4), dict(kernel_size=3, stride=2, padding=1)),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_small_map_conv__outputs_and_gradients_equal_the_convolution(size, conv, channels_last):
    torch.manual_seed(0)
    plain = nn.Conv2d(6, 5, **{"bias": False, **conv}).double()
    fast = copy.deepcopy(plain)
    fast.__class__ = SmallMapConv2d
    x = torch.randn(4, 6, *size, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
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


@pytest.mark.parametrize("size", [28, 32])
def test_build_resnet__small_map_convs_keep_torchvision_state_dict_and_results(size):
    """ResNet-18 with the ImageNet stem ends on a 2x2 map in layer3 and 1x1 in layer4 at 28-32 px: same keys as
    torchvision's, same features and gradients as the plain convolutions (float64, channels-last as training
    runs), and the layer3 / layer4 convolutions do see those maps."""
    torch.manual_seed(0)
    backbone, dim = build_resnet("resnet18", "imagenet")
    reference = torchvision.models.resnet18(weights=None)
    reference.fc = nn.Identity()
    assert backbone.state_dict().keys() == reference.state_dict().keys() and dim == 512
    assert type(backbone.layer4[1].conv2) is SmallMapConv2d and type(backbone.layer3[1].conv1) is SmallMapConv2d
    plain = use_plain_convs(copy.deepcopy(backbone)).double().to(memory_format=torch.channels_last)
    assert not any(type(m) is SmallMapConv2d for m in plain.modules())
    backbone = backbone.double().to(memory_format=torch.channels_last)
    seen = []
    for conv in (backbone.layer3[1].conv1, backbone.layer4[1].conv2):
        conv.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape[-2:])))
    x = torch.randn(3, 3, size, size, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(backbone(x), plain(x))
    backbone(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, fast), slow in zip(backbone.named_parameters(), plain.parameters()):
        torch.testing.assert_close(fast.grad, slow.grad, msg=name)
    assert seen == [(2, 2), (1, 1)] * 2


def test_use_small_map_convs__leaves_other_modules_and_string_padding_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 4, 1), nn.Linear(4, 2))
    use_small_map_convs(model)
    assert [type(m) for m in model] == [nn.Conv2d, SmallMapConv2d, nn.Linear]
