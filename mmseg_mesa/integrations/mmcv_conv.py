"""Mesa versions of mmcv's convolutions that do more than ``nn.Conv2d`` in their forward.

Both run the steps of their mmcv forward that come before the convolution as they are (weight
standardization, TensorFlow-style "same" padding) and the convolution itself through
``MesaConv2dFunction``, so the output is bit-identical and the saved input is ``bits``-bit.
"""
from __future__ import annotations

import math

import torch
from mmcv.cnn.bricks.conv2d_adaptive_padding import Conv2dAdaptivePadding
from mmcv.cnn.bricks.conv_ws import ConvWS2d

from ..layers.conv import MesaConv2d, MesaConv2dFunction


def standardized_weight(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The weight ``mmcv.cnn.bricks.conv_ws.conv_ws_2d`` convolves with (same ops, same order)."""
    out_channels = weight.size(0)
    flat = weight.view(out_channels, -1)
    mean = flat.mean(dim=1, keepdim=True).view(out_channels, 1, 1, 1)
    std = flat.std(dim=1, keepdim=True).view(out_channels, 1, 1, 1)
    return (weight - mean) / (std + eps)


class MesaConvWS2d(MesaConv2d, ConvWS2d):
    """mmcv ``ConvWS2d`` (weight standardization) with a ``bits``-bit saved input.

    The standardization stays in autograd (it acts on the weight, not the activation); like
    mmcv's forward, the convolution pads with zeros whatever ``padding_mode`` says.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return ConvWS2d.forward(self, x)
        return MesaConv2dFunction.apply(
            x, standardized_weight(self.weight, self.eps), self.bias, self.stride, self.padding,
            self.dilation, self.groups, self.quant_input)


def same_padding(module: Conv2dAdaptivePadding, x: torch.Tensor) -> tuple[int, int, int, int]:
    """``F.pad`` widths of ``Conv2dAdaptivePadding.forward`` for this input (TF's "same")."""
    img_h, img_w = x.size()[-2:]
    kernel_h, kernel_w = module.weight.size()[-2:]
    stride_h, stride_w = module.stride
    pad_h = max((math.ceil(img_h / stride_h) - 1) * stride_h
                + (kernel_h - 1) * module.dilation[0] + 1 - img_h, 0)
    pad_w = max((math.ceil(img_w / stride_w) - 1) * stride_w
                + (kernel_w - 1) * module.dilation[1] + 1 - img_w, 0)
    return pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2


class MesaConv2dAdaptivePadding(MesaConv2d, Conv2dAdaptivePadding):
    """mmcv ``Conv2dAdaptivePadding`` (MobileNetV3) with a ``bits``-bit saved input.

    The zero padding is applied inside the Function, so the padded copy is not saved in full
    precision; backward slices its gradient off again.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return Conv2dAdaptivePadding.forward(self, x)
        pad = same_padding(self, x)
        return MesaConv2dFunction.apply(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
            self.quant_input, pad if any(pad) else None, 'constant')
