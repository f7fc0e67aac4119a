"""Conv2d and Conv1d with a ``bits``-bit saved input."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MesaConfig
from ..quantizer import ActivationQuantizer
from ..registry import mesa_layer
from . import scale_free
from .autocast import no_autocast_backward, returns_owned
from .base import MesaModule
from .formulas import weighted_backward, weighted_forward
from .layout import mark_channels_first


def unpad_grad(grad: torch.Tensor, pad: tuple, mode: str, shape: torch.Size) -> torch.Tensor:
    """Gradient through ``F.pad(x, pad, mode)`` (only the shape of x matters)."""
    with torch.enable_grad():
        probe = torch.zeros(shape, dtype=grad.dtype, device=grad.device, requires_grad=True)
        (result,) = torch.autograd.grad(F.pad(probe, pad, mode=mode), probe, grad)
    return result


def conv_bias_grad(grad: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a 2-d (transposed) convolution: ``grad`` summed but over channels."""
    return grad.sum((0, 2, 3))


def conv_forward(ctx: Any, conv: Any, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, conv_args: tuple, quantizer: ActivationQuantizer
                 ) -> torch.Tensor:
    """``conv(x, weight, bias, *conv_args)`` as ``weighted_forward`` runs it, recording the
    arguments (stride, padding, dilation, groups) and input shape its backward reads."""
    ctx.conv_args = conv_args
    ctx.input_shape = x.shape
    ctx.scale_bias = None if bias is None else bias.detach()
    y = weighted_forward(ctx, lambda xc, wc, bc: conv(xc, wc, bc, *conv_args), x, weight, bias,
                         quantizer)
    scale_free.offer(ctx, y, source=ctx.needs_input_grad[1])
    return mark_channels_first(y)


def carry_if_depthwise(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, groups: int) -> None:
    """A depthwise convolution without bias (one input channel per output channel) scales
    each channel with its input's: it passes on the input's ``scale_free`` link."""
    if bias is None and groups == x.shape[1] == weight.shape[0]:
        scale_free.carry(ctx, x)


def conv_backward(ctx: Any, grad: torch.Tensor, *formulas: Any) -> tuple:
    """``weighted_backward(ctx, grad, *formulas)``, passing the ``scale_free`` chain on."""
    received = scale_free.receives(ctx, grad)
    grads = weighted_backward(ctx, grad, *formulas)
    scale_free.carry_back(ctx, received, grads[0])
    return grads


class MesaConv2dFunction(torch.autograd.Function):
    """``F.conv2d`` (numeric padding) keeping a packed input; backward via ``torch.nn.grad``."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple, padding: tuple, dilation: tuple, groups: int,
                quantizer: ActivationQuantizer, explicit_pad: tuple | None = None,
                pad_mode: str = 'zeros') -> torch.Tensor:
        ctx.explicit_pad = (explicit_pad, pad_mode, x.shape) if explicit_pad else None
        carry_if_depthwise(ctx, x, weight, bias, groups)
        if explicit_pad:
            # Reflect/replicate/circular padding: torch's pad would save the unpadded input in
            # full precision, so we pad here and undo it in backward.
            x = F.pad(x, explicit_pad, mode=pad_mode)
        return conv_forward(ctx, F.conv2d, x, weight, bias, (stride, padding, dilation, groups),
                            quantizer)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        def input_grad(grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            grad_x = torch.nn.grad.conv2d_input(ctx.input_shape, w, grad, *ctx.conv_args)
            return unpad_grad(grad_x, *ctx.explicit_pad) if ctx.explicit_pad else grad_x

        def joint(x: torch.Tensor, grad: torch.Tensor, w: torch.Tensor, needs: list[bool]
                  ) -> tuple:
            stride, padding, dilation, groups = ctx.conv_args
            return torch.ops.aten.convolution_backward(
                grad, x, w, [w.shape[0]] if needs[2] else None, stride, padding, dilation,
                False, [0, 0], groups, needs)

        return conv_backward(
            ctx, grad, input_grad,
            lambda x, grad, shape: torch.nn.grad.conv2d_weight(x, shape, grad, *ctx.conv_args),
            conv_bias_grad, None if ctx.explicit_pad else joint)


def numeric_padding(padding: Any, kernel_size: tuple, dilation: tuple) -> tuple | None:
    """``padding`` as numbers per spatial dim: ``'valid'`` is none, ``'same'`` half the kernel's
    span on each side where that span is even (what torch then runs); None where ``'same'`` pads
    one side more (an even span: torch pads the input first) or ``padding`` is unknown."""
    if not isinstance(padding, str):
        return tuple(padding)
    if padding == 'valid':
        return (0,) * len(kernel_size)
    spans = [d * (k - 1) for k, d in zip(kernel_size, dilation)]
    if padding != 'same' or any(span % 2 for span in spans):
        return None
    return tuple(span // 2 for span in spans)


def string_padding_reason(module: nn.Module) -> str | None:
    if numeric_padding(module.padding, module.kernel_size, module.dilation) is None:
        return (f'string padding {module.padding!r} pads one side more (an even kernel span) '
                f'and is not supported')
    return None


# MesaConv2d.forward calls F.conv2d itself, so an overridden _conv_forward would be lost too.
@mesa_layer(nn.Conv2d, 'conv2d', string_padding_reason, replaces=('forward', '_conv_forward'),
            division=True)
class MesaConv2d(MesaModule, nn.Conv2d):
    """``nn.Conv2d`` whose saved input is quantized per channel group (dim 1).

    String padding runs as the numbers torch would use; ``'same'`` with an even kernel span (torch
    pads the input unevenly first) is not supported, and conversion leaves such layers alone.
    """

    mesa_any_mode = True

    mesa_quantizers = {'quant_input': (1, None)}

    def mesa_setup(self, config: MesaConfig) -> None:
        reason = string_padding_reason(self)
        if reason is not None:
            raise ValueError(f'MesaConv2d: {reason}')
        super().mesa_setup(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        if self.padding_mode != 'zeros':
            # nn.Conv2d pads explicitly for these modes, then convolves without padding.
            return MesaConv2dFunction.apply(
                x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups,
                self.quant_input, tuple(self._reversed_padding_repeated_twice), self.padding_mode)
        padding = numeric_padding(self.padding, self.kernel_size, self.dilation)
        return MesaConv2dFunction.apply(x, self.weight, self.bias, self.stride, padding,
                                        self.dilation, self.groups, self.quant_input)


class MesaConv1dFunction(torch.autograd.Function):
    """``F.conv1d`` (numeric padding) keeping a packed input; backward via ``torch.nn.grad``."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple, padding: tuple, dilation: tuple, groups: int,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        carry_if_depthwise(ctx, x, weight, bias, groups)
        return conv_forward(ctx, F.conv1d, x, weight, bias, (stride, padding, dilation, groups),
                            quantizer)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return conv_backward(
            ctx, grad,
            lambda grad, w: torch.nn.grad.conv1d_input(ctx.input_shape, w, grad, *ctx.conv_args),
            lambda x, grad, shape: torch.nn.grad.conv1d_weight(x, shape, grad, *ctx.conv_args),
            lambda grad: grad.sum((0, 2)))


def conv1d_reason(module: nn.Conv1d) -> str | None:
    """Why a Conv1d is left as it is, or None."""
    reason = string_padding_reason(module)
    if reason is None and module.padding_mode != 'zeros':
        return f'padding_mode={module.padding_mode!r} is not supported'
    return reason


@mesa_layer(nn.Conv1d, 'conv1d', conv1d_reason, replaces=('forward', '_conv_forward'))
class MesaConv1d(MesaModule, nn.Conv1d):
    """``nn.Conv1d`` (PointRend's point head) whose saved input is quantized per channel group
    (dim 1). Zero padding only (string padding as ``MesaConv2d``); conversion leaves other
    layers alone."""

    mesa_any_mode = True

    mesa_quantizers = {'quant_input': (1, None)}

    def mesa_setup(self, config: MesaConfig) -> None:
        reason = conv1d_reason(self)
        if reason is not None:
            raise ValueError(f'MesaConv1d: {reason}')
        super().mesa_setup(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias) or x.dim() != 3:
            return super().forward(x)
        padding = numeric_padding(self.padding, self.kernel_size, self.dilation)
        return MesaConv1dFunction.apply(x, self.weight, self.bias, self.stride, padding,
                                        self.dilation, self.groups, self.quant_input)
