"""Convolutions on maps so small that a matrix product does less work, computed as that product.

A ResNet at 28-32 px with the ImageNet stem (the CPU default) ends on a 2x2 map in layer3 and a 1x1 map in
layer4. There most of a 3x3 kernel's taps multiply padding: on a 1x1 map eight of nine, on a 2x2 map five of
nine for each output position. oneDNN still runs them as 3x3 convolutions, and their backward was the largest
part of the training step on 2 CPU cores. Two exact rewrites:

- **one output position** (layer4): ``linear(window, taps)``, the input window the kernel covers and the
  kernel taps that meet it. The MoCo v2 step alone ran 1.7x the images/s at 28 and 32 px
  (``bench/train_throughput.py --plain-convs``, ``bench/results/one_position_conv_cpu.json``).
- **fewer input positions than kernel taps** (layer3's 3x3 convolutions on 2x2): every output position is a
  linear map of the whole input, so the convolution is one product with a ``[P * out, Q * in]`` matrix of
  kernel taps (P output positions, Q input positions; a zero block where a tap falls outside the kernel), Q
  multiply-adds per output instead of the kernel's kh * kw. Channels-last in, channels-last out.

:class:`SmallMapConv2d` is an ``nn.Conv2d`` (same parameters, same state dict) that takes these paths; the
result is the convolution's up to the order of float sums, and the taps that meet only padding get the zero
gradient they get from the convolution. Any other input runs the ordinary convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """A convolution's output length along one axis, for an input of ``size``."""
    return (size + 2 * padding - kernel) // stride + 1


def one_position_window(size: int, kernel: int, stride: int, padding: int) -> tuple[int, int] | None:
    """Along one axis: the input rows ``[0, end)`` and the first kernel tap that meets them, when the
    convolution's output there has exactly one position; None otherwise.

    Args:
        size: the input's length along the axis.
        kernel, stride, padding: the convolution's, along the axis.

    Returns:
        ``(end, first_tap)``: input rows ``0 .. end - 1`` meet taps ``first_tap .. first_tap + end - 1``.
    """
    if output_size(size, kernel, stride, padding) != 1 or padding >= kernel:
        return None
    end = min(size, kernel - padding)
    return (end, padding) if end > 0 else None


def small_map_taps(weight: torch.Tensor, in_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]):
    """The convolution of an ``in_size`` map as one matrix: ``[P * out, Q * in]``, row ``p * out + o`` and column
    ``q * in + c`` (P output and Q input positions, row-major; positions outer, channels inner, as a channels-last
    map flattens). Block ``(p, q)`` is the kernel tap that output position p applies to input position q, zero
    where that tap lies outside the kernel.

    Args:
        weight: the convolution's kernel, ``[out, in, kh, kw]``.
        in_size: ``(H, W)`` of the input map; stride, padding: the convolution's.
    """
    out_channels, in_channels, kh, kw = weight.shape
    (height, width), (sh, sw), (ph, pw) = in_size, stride, padding
    out_h, out_w = output_size(height, kh, sh, ph), output_size(width, kw, sw, pw)
    # input row a meets tap a - i * sh + ph for output row i; with height - 1 zero taps on each side of the
    # kernel, every output row's taps are one slice of ``height`` rows (likewise for columns)
    padded = F.pad(weight, (width - 1, width - 1, height - 1, height - 1))
    blocks = [
        padded[:, :, row : row + height, col : col + width]
        for row in range(ph + height - 1, ph + height - 1 - out_h * sh, -sh)
        for col in range(pw + width - 1, pw + width - 1 - out_w * sw, -sw)
    ]  # P x [out, in, H, W]
    taps = torch.stack(blocks).permute(0, 1, 3, 4, 2)  # [P, out, H, W, in]
    return taps.reshape(len(blocks) * out_channels, height * width * in_channels)


class SmallMapConv2d(nn.Conv2d):
    """``nn.Conv2d`` that computes a one-position output, or an output from fewer input positions than kernel
    taps, as a matrix product (see the module docstring).

    Only for ``groups == 1``, ``dilation == 1`` and zero padding; otherwise it is the plain convolution.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups != 1 or self.dilation != (1, 1) or self.padding_mode != "zeros":
            return super().forward(x)
        (height, width), (kh, kw) = x.shape[-2:], self.kernel_size
        rows = one_position_window(height, kh, self.stride[0], self.padding[0])
        cols = one_position_window(width, kw, self.stride[1], self.padding[1])
        if rows is not None and cols is not None:
            (row_end, row_tap), (col_end, col_tap) = rows, cols
            window = x[:, :, :row_end, :col_end].reshape(x.shape[0], -1)
            taps = self.weight[:, :, row_tap : row_tap + row_end, col_tap : col_tap + col_end]
            taps = taps.reshape(self.out_channels, -1)
            return F.linear(window, taps, self.bias).view(x.shape[0], self.out_channels, 1, 1)
        if height * width >= kh * kw or self.padding[0] >= kh or self.padding[1] >= kw:
            return super().forward(x)
        out_h = output_size(height, kh, self.stride[0], self.padding[0])
        out_w = output_size(width, kw, self.stride[1], self.padding[1])
        taps = small_map_taps(self.weight, (height, width), self.stride, self.padding)
        bias = None if self.bias is None else self.bias.repeat(out_h * out_w)
        positions = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)  # a view when x is channels-last
        out = F.linear(positions, taps, bias)
        return out.view(x.shape[0], out_h, out_w, self.out_channels).permute(0, 3, 1, 2)


def use_small_map_convs(model: nn.Module) -> nn.Module:
    """Turn every plain ``nn.Conv2d`` of ``model`` into :class:`SmallMapConv2d`, in place (same parameters,
    same state dict, same results); returns ``model``."""
    for module in model.modules():
        if type(module) is nn.Conv2d and isinstance(module.padding, tuple):
            module.__class__ = SmallMapConv2d
    return model


def use_plain_convs(model: nn.Module) -> nn.Module:
    """The inverse of :func:`use_small_map_convs`: every :class:`SmallMapConv2d` back to ``nn.Conv2d``, in
    place (for benchmarks and tests that compare the two); returns ``model``."""
    for module in model.modules():
        if type(module) is SmallMapConv2d:
            module.__class__ = nn.Conv2d
    return model
