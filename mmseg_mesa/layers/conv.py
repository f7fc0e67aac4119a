"""Conv2d with an 8-bit saved input."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MesaConfig
from ..quantizer import ActivationQuantizer
from ..saved import load
from .base import MesaModule, no_autocast_backward, summed_over_samples, weighted_forward


def unpad_grad(grad: torch.Tensor, pad: tuple, mode: str, shape: torch.Size) -> torch.Tensor:
    """Gradient through ``F.pad(x, pad, mode)`` (only the shape of x matters)."""
    with torch.enable_grad():
        probe = torch.zeros(shape, dtype=grad.dtype, device=grad.device, requires_grad=True)
        (result,) = torch.autograd.grad(F.pad(probe, pad, mode=mode), probe, grad)
    return result


class MesaConv2dFunction(torch.autograd.Function):
    """``F.conv2d`` (numeric padding) keeping a packed input; backward via ``torch.nn.grad``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple, padding: tuple, dilation: tuple, groups: int,
                quantizer: ActivationQuantizer, explicit_pad: tuple | None = None,
                pad_mode: str = 'zeros') -> torch.Tensor:
        ctx.conv_args = (stride, padding, dilation, groups)
        ctx.explicit_pad = (explicit_pad, pad_mode, x.shape) if explicit_pad else None
        if explicit_pad:
            # Reflect/replicate/circular padding: torch's pad would save the unpadded input in
            # full precision, so we pad here and undo it in backward.
            x = F.pad(x, explicit_pad, mode=pad_mode)
        ctx.input_shape = x.shape
        return weighted_forward(
            ctx, lambda xc, wc, bc: F.conv2d(xc, wc, bc, stride, padding, dilation, groups),
            x, weight, bias, quantizer)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, weight = load(ctx)
        grad = grad.to(ctx.compute_dtype)
        w = weight.to(ctx.compute_dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            # first, so the decoded fp32 input is freed before grad_x (as large) is made
            grad_w = summed_over_samples(packed, lambda x, rows: torch.nn.grad.conv2d_weight(
                x, w.shape, grad[rows], *ctx.conv_args)).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(ctx.input_shape, w, grad, *ctx.conv_args)
            if ctx.explicit_pad:
                grad_x = unpad_grad(grad_x, *ctx.explicit_pad)
            grad_x = grad_x.to(ctx.input_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 2, 3)).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


class MesaConv2d(MesaModule, nn.Conv2d):
    """``nn.Conv2d`` whose saved input is quantized per channel group (dim 1).

    String padding (``'same'``/``'valid'``) is not supported; conversion leaves such layers alone.
    """

    mesa_quantizers = {'quant_input': (1, None)}

    def mesa_setup(self, config: MesaConfig) -> None:
        if isinstance(self.padding, str):
            raise ValueError(f'MesaConv2d: string padding {self.padding!r} is not supported')
        super().mesa_setup(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        if self.padding_mode != 'zeros':
            # nn.Conv2d pads explicitly for these modes, then convolves without padding.
            return MesaConv2dFunction.apply(
                x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups,
                self.quant_input, tuple(self._reversed_padding_repeated_twice), self.padding_mode)
        return MesaConv2dFunction.apply(x, self.weight, self.bias, self.stride, self.padding,
                                        self.dilation, self.groups, self.quant_input)
