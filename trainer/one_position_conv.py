"""Convolutions whose output is a single position, computed as the matrix product they are.

A ResNet at 28-32 px with the ImageNet stem (the CPU default) ends on a 1x1 map: layer4's 3x3 convolutions
see one position padded with zeros, so eight of their nine taps multiply zeros. oneDNN still runs them as 3x3
convolutions, and their backward was the largest part of the training step on 2 CPU cores. As matrix products,
the MoCo v2 step alone ran 1.7x the images/s at 28 and 32 px (``bench/train_throughput.py --plain-convs``,
``bench/results/one_position_conv_cpu.json``).

:class:`OnePositionConv2d` is an ``nn.Conv2d`` (same parameters, same state dict) that computes an output of
one position as ``linear(window, taps)``: the input window the kernel covers and the kernel taps that meet it.
The result is the convolution's, up to the order of float sums; the other taps get the zero gradient they get
from the convolution. Any other output size runs the ordinary convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def one_position_window(size: int, kernel: int, stride: int, padding: int) -> tuple[int, int] | None:
    """Along one axis: the input rows ``[0, end)`` and the first kernel tap that meets them, when the
    convolution's output there has exactly one position; None otherwise.

    Args:
        size: the input's length along the axis.
        kernel, stride, padding: the convolution's, along the axis.

    Returns:
        ``(end, first_tap)``: input rows ``0 .. end - 1`` meet taps ``first_tap .. first_tap + end - 1``.
    """
    if (size + 2 * padding - kernel) // stride + 1 != 1 or padding >= kernel:
        return None
    end = min(size, kernel - padding)
    return (end, padding) if end > 0 else None


class OnePositionConv2d(nn.Conv2d):
    """``nn.Conv2d`` that computes a one-position output ``[N, out, 1, 1]`` as a matrix product.

    Only for ``groups == 1``, ``dilation == 1`` and zero padding; otherwise, or when the output has more than one
    position, it is the plain convolution.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = one_position_window(x.shape[-2], self.kernel_size[0], self.stride[0], self.padding[0])
        cols = one_position_window(x.shape[-1], self.kernel_size[1], self.stride[1], self.padding[1])
        if rows is None or cols is None or self.groups != 1 or self.dilation != (1, 1) or self.padding_mode != "zeros":
            return super().forward(x)
        (row_end, row_tap), (col_end, col_tap) = rows, cols
        window = x[:, :, :row_end, :col_end].reshape(x.shape[0], -1)
        taps = self.weight[:, :, row_tap : row_tap + row_end, col_tap : col_tap + col_end]
        taps = taps.reshape(self.out_channels, -1)
        return F.linear(window, taps, self.bias).view(x.shape[0], self.out_channels, 1, 1)


def use_one_position_convs(model: nn.Module) -> nn.Module:
    """Turn every plain ``nn.Conv2d`` of ``model`` into :class:`OnePositionConv2d`, in place (same parameters,
    same state dict, same results); returns ``model``."""
    for module in model.modules():
        if type(module) is nn.Conv2d and isinstance(module.padding, tuple):
            module.__class__ = OnePositionConv2d
    return model


def use_plain_convs(model: nn.Module) -> nn.Module:
    """The inverse of :func:`use_one_position_convs`: every :class:`OnePositionConv2d` back to ``nn.Conv2d``, in
    place (for benchmarks and tests that compare the two); returns ``model``."""
    for module in model.modules():
        if type(module) is OnePositionConv2d:
            module.__class__ = nn.Conv2d
    return model
