"""Pooling layers that keep the least backward can do with.

MaxPool2d keeps where each maximum sits inside its window, in one byte; average poolings keep
nothing (``MesaLinearPoolFunction``).

torch's max pooling saves its input (4 bytes a value, fp32) and int64 flat indices into the input
plane (8 bytes per output value), and once ReLU keeps only a mask nothing else holds that input. The
position of the maximum inside its ``kH x kW`` window is all backward needs; it fits in a uint8
whenever ``kH * kW <= 256`` (every pooling in mmseg's models). Backward rebuilds the flat indices
and accumulates with ``scatter_add_`` in output order, as torch's CPU kernel does, so the gradient
is exact: bit-identical to torch's on CPU in fp32. Where windows overlap, an input value that is
the maximum of several windows sums their gradients; fp16 / bf16 sums are taken in fp32 and
rounded once (torch sums in the low precision, which can differ in the last bit), and on CUDA
both sum in their own order.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import mesa_layer
from ..saved import load, save
from .autocast import record_autocast, replayed_autocast, returns_owned
from .base import MesaModule


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def index_dtype(window: int) -> torch.dtype:
    """The smallest integer type that holds a position inside a window of ``window`` values."""
    if window <= 256:
        return torch.uint8
    return torch.int16 if window <= 2 ** 15 else torch.int32


def window_origins(out_size: int, stride: int, padding: int, device: torch.device
                   ) -> torch.Tensor:
    """Input coordinate of each window's first row (or column), padding included."""
    return torch.arange(out_size, device=device) * stride - padding


def local_indices(indices: torch.Tensor, width: int, kernel: tuple[int, int],
                  stride: tuple[int, int], padding: tuple[int, int],
                  dilation: tuple[int, int]) -> torch.Tensor:
    """Flat input indices (``h * width + w``) to positions ``kh * kW + kw`` inside each window."""
    out_h, out_w = indices.shape[-2:]
    row0 = window_origins(out_h, stride[0], padding[0], indices.device).view(-1, 1)
    col0 = window_origins(out_w, stride[1], padding[1], indices.device).view(1, -1)
    kh = (torch.div(indices, width, rounding_mode='floor') - row0) // dilation[0]
    kw = (indices.remainder(width) - col0) // dilation[1]
    return (kh * kernel[1] + kw).to(index_dtype(kernel[0] * kernel[1]))


def flat_indices(local: torch.Tensor, width: int, kernel: tuple[int, int],
                 stride: tuple[int, int], padding: tuple[int, int],
                 dilation: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`local_indices` (int64, for ``scatter_add_``)."""
    out_h, out_w = local.shape[-2:]
    local = local.long()
    row0 = window_origins(out_h, stride[0], padding[0], local.device).view(-1, 1)
    col0 = window_origins(out_w, stride[1], padding[1], local.device).view(1, -1)
    rows = row0 + torch.div(local, kernel[1], rounding_mode='floor') * dilation[0]
    cols = col0 + local.remainder(kernel[1]) * dilation[1]
    return rows * width + cols


class MesaMaxPool2dFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], dilation: tuple[int, int], ceil_mode: bool
                ) -> torch.Tensor:
        y, indices = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode,
                                  return_indices=True)
        ctx.input_shape = x.shape
        ctx.geometry = (kernel, stride, padding, dilation)
        save(ctx, local_indices(indices, x.shape[-1], *ctx.geometry))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (local,) = load(ctx)
        n, c, h, w = ctx.input_shape
        index = flat_indices(local, w, *ctx.geometry).view(n, c, -1)
        # fp16 / bf16: summed in fp32 and rounded once (see the module docstring)
        acc = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()
        grad_x = acc.new_zeros(n, c, h * w).scatter_add_(2, index, acc.reshape(n, c, -1))
        return grad_x.view(n, c, h, w).to(grad.dtype), None, None, None, None, None


@mesa_layer(nn.MaxPool2d, 'pooling',
            lambda m: 'return_indices=True: the int64 indices are an output'
            if m.return_indices else None)
class MesaMaxPool2d(MesaModule, nn.MaxPool2d):
    """``nn.MaxPool2d`` saving only the argmax's position inside its window (uint8).

    ``return_indices=True`` is not supported (the int64 indices are then an output); conversion
    leaves such layers alone. Unbatched (3-dim) inputs run the torch path.
    """

    def mesa_setup(self, config: Any) -> None:
        if self.return_indices:
            raise ValueError('MesaMaxPool2d: return_indices=True is not supported')
        super().mesa_setup(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x) or x.dim() != 4:
            return super().forward(x)
        kernel = _pair(self.kernel_size)
        stride = _pair(self.stride if self.stride is not None else self.kernel_size)
        return MesaMaxPool2dFunction.apply(x, kernel, stride, _pair(self.padding),
                                           _pair(self.dilation), self.ceil_mode)


class MesaLinearPoolFunction(torch.autograd.Function):
    """An average pooling that saves nothing: its backward does not read the input's values.

    Backward calls ``adjoint(grad, probe)``, the backward op torch's autograd calls for the
    pooling, on a probe of the input's shape and memory format, left unfilled: the op reads only
    its sizes and layout, so the gradient is exactly torch's. Where there is no such op, or
    autocast was on in forward (its casts have backward steps of their own), it runs the pooling
    on the probe under the forward's autocast state and takes the probe's gradient: the same
    kernels, one more pooling. torch's adaptive / strided average pooling saves the whole input
    for that gradient.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, pool: Any,
                adjoint: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        record_autocast(ctx, x)
        ctx.input_meta = (x.shape, x.dtype, x.device, x.is_contiguous(
            memory_format=torch.channels_last) and not x.is_contiguous())
        ctx.pool = pool
        ctx.adjoint = None if ctx.autocast[0] else adjoint
        return pool(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        shape, dtype, device, channels_last = ctx.input_meta
        probe = torch.empty(shape, dtype=dtype, device=device, memory_format=(
            torch.channels_last if channels_last else torch.contiguous_format))
        if ctx.adjoint is not None:
            return ctx.adjoint(grad, probe), None, None
        with torch.enable_grad(), replayed_autocast(ctx):
            probe.requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.pool(probe), probe, grad)
        return grad_x, None, None


def adaptive_pool_adjoint(output_size: Any) -> Callable[[torch.Tensor, torch.Tensor],
                                                        torch.Tensor]:
    """The backward of ``F.adaptive_avg_pool2d(x, output_size)`` as torch's autograd takes it:
    a 1x1 output is the mean over the plane (torch computes it so), whose backward spreads
    ``grad / (H * W)``; any other is ``_adaptive_avg_pool2d``'s backward op."""
    def adjoint(grad: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
        plane = probe.shape[-2:]
        pair = (output_size, output_size) if isinstance(output_size, int) else output_size
        if all((plane[i] if s is None else s) == 1 for i, s in enumerate(pair)):
            return grad.expand(probe.shape) / (plane[0] * plane[1])
        return torch.ops.aten._adaptive_avg_pool2d_backward(grad, probe)
    return adjoint


def avg_pool_adjoint(pool: nn.AvgPool2d) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The backward of ``pool`` (``F.avg_pool2d`` with its settings): ``avg_pool2d``'s
    backward op."""
    kernel = list(_pair(pool.kernel_size))
    stride = [] if pool.stride is None else list(_pair(pool.stride))
    padding = list(_pair(pool.padding))

    def adjoint(grad: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.avg_pool2d_backward(
            grad, probe, kernel, stride, padding, pool.ceil_mode, pool.count_include_pad,
            pool.divisor_override)
    return adjoint


# UPerHead's and PSPNet's pyramid pooling, SE blocks: torch keeps the whole input.
@mesa_layer(nn.AdaptiveAvgPool2d, 'pooling')
class MesaAdaptiveAvgPool2d(MesaModule, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` that saves nothing for backward (only the input's shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaLinearPoolFunction.apply(x, super().forward,
                                            adaptive_pool_adjoint(self.output_size))


@mesa_layer(nn.AvgPool2d, 'pooling')
class MesaAvgPool2d(MesaModule, nn.AvgPool2d):
    """``nn.AvgPool2d`` that saves nothing for backward (only the input's shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaLinearPoolFunction.apply(x, super().forward, avg_pool_adjoint(self))
