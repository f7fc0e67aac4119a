"""The activations, each saving only what its backward needs.

- GELU: its input, ``bits``-bit (the Linear after it saves its output as these codes); on a
  feature map a convolution or a norm over channels made (``nn.GELU``), its derivative.
- ReLU: a 1-bit mask.
- Hardtanh / ReLU6, LeakyReLU, Hardsigmoid: their derivative is piecewise constant, so one bit per
  element says which piece; the gradient is exact.
- PReLU: the sign bit (input gradient, exact) and the quantized negative part of the input (the
  only part the weight gradient reads).
- SiLU, Mish, Sigmoid and Tanh: one quantized copy of their derivative.
- Hardswish: one bit for "inside (-3, 3)" and the quantized input clamped to [-3, 3] (outside,
  the derivative is 0 or 1 and the clamped value's sign tells which).
- ELU: the sign bit and the quantized negative part of the output (``alpha * exp(x) = y + alpha``).

Bits are computed from the input before an in-place op overwrites it, with the comparisons torch's
own backward makes. Quantized copies of CNN activations are grouped per channel: dim 1 for inputs
with 4 or more dims (N, C, H, W), the last dim otherwise (tokens x channels).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..constants import filled
from ..quantizer import ActivationQuantizer, Mapped, Packed, Refined, unpack
from ..registry import mesa_layer
from ..reuse import attach_codes
from ..saved import PackedMask, load, save
from . import scale_free
from .autocast import (
    autocast_inputs,
    autocast_off,
    cast,
    no_autocast_backward,
    record_input,
    returns_owned,
)
from .base import MesaModule
from .formulas import sum_to
from .layout import channels_first
from .ownership import owned_gradients


def gelu_derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU's derivative at ``x``, by torch's own backward kernel (in fp32 for fp16/bf16), its
    incoming gradient a kept one broadcast over ``x`` (the result takes ``x``'s layout)."""
    x = comparable(x)
    one = filled(1.0, (), x, x.dtype).expand(x.shape)
    return torch.ops.aten.gelu_backward(one, x, approximate=approximate)


class MesaGELUFunction(torch.autograd.Function):
    """GELU keeping its input's codes (offered to the next Linear, which saves the output as
    these same codes) or, with ``derivative``, its derivative's codes.

    ``MesaGELU`` keeps the derivative on a feature map a convolution or a norm over channels made
    (``layout.channels_first``), where its input's codes, grouped by the last dim (a shape cannot
    tell a map from tokens), are no codes a conv after it could reuse: the derivative spans
    [-0.17, 1.13], where 8 bits of a feature map's input range turn GELU's curvature into
    derivative errors that a deep stack adds up (ConvMixer's 64 GELUs: whole-gradient error
    0.072 -> 0.023, 0.018 rounded to nearest). Tokens keep their input, whose codes the next
    Linear reuses, as does ``F.gelu`` in a module's own forward (the generic path groups a
    feature map's codes by channel, and a conv after it reuses them).
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, approximate: str,
                quantizer: ActivationQuantizer, derivative: bool = False) -> torch.Tensor:
        record_input(ctx, x)
        ctx.approximate = approximate
        ctx.derivative = derivative
        y = F.gelu(x, approximate=approximate)
        if derivative:
            save(ctx, quantizer.pack(gelu_derivative(x, approximate)))
            return y
        packed = quantizer.pack(x)
        save(ctx, packed)
        if isinstance(packed, (Packed, Refined)):  # the next Linear saves y as these codes
            attach_codes(y, Mapped(packed, functools.partial(F.gelu, approximate=approximate),
                                   y.dtype))
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed,) = load(ctx)
        if ctx.derivative:
            grad_x = cast(grad, torch.float32) * unpack(packed, torch.float32)
        else:  # torch's own GELU backward (one fused pass) on the decoded input, in fp32
            grad_x = torch.ops.aten.gelu_backward(cast(grad, torch.float32),
                                                  unpack(packed, torch.float32),
                                                  approximate=ctx.approximate)
        return cast(grad_x, ctx.input_dtype), None, None, None


# GELU's and the other activations' codes round to nearest (``nearest_rounding``): half the
# variance of stochastic rounding, and over independent batches their errors stayed independent
# (no bias; docs/benchmarks.md).
@mesa_layer(nn.GELU, 'gelu', division=True, nearest_rounding=True)
class MesaGELU(MesaModule, nn.GELU):
    """``nn.GELU`` whose saved input is quantized per channel group (last dim); a feature map
    keeps its derivative."""

    mesa_any_mode = True

    # derivative codes grouped along the last dim like the input's: the derivative spans the same
    # range in every channel, and a group per channel costs 8 bytes each on small maps
    mesa_quantizers = {'quant_input': (-1, None), 'quant_derivative': (-1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        if channels_first(x):
            return MesaGELUFunction.apply(x, self.approximate, self.quant_derivative, True)
        return MesaGELUFunction.apply(x, self.approximate, self.quant_input)


class MesaReLUFunction(torch.autograd.Function):
    """ReLU keeping only ``output > 0`` as one bit per element; supports in-place. Its backward
    writes into the incoming gradient where nothing else holds it."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        scale_free.carry(ctx, x)  # relu(s * x) = s * relu(x)
        if inplace:
            ctx.mark_dirty(x)
            y = torch.relu_(x)
        else:
            y = torch.relu(x)
        save(ctx, PackedMask.positive(y))
        scale_free.offer(ctx, y, source=False, dirty=inplace)
        return y

    @staticmethod
    @owned_gradients
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        received = scale_free.receives(ctx, grad)
        if ctx.owned_grads[0] and grad.shape == mask.shape:
            grad_x = mask.select_(grad)
        else:
            grad_x = mask.select(grad)
        scale_free.carry_back(ctx, received, grad_x)
        return grad_x, None


def mesa_relu(x: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``MesaReLUFunction`` as layers call it: an in-place call's ``scale_free`` link is for its
    output as autograd returns it."""
    y = MesaReLUFunction.apply(x, inplace)
    return scale_free.settle(y) if inplace else y


@mesa_layer(nn.ReLU, 'relu')
class MesaReLU(MesaModule, nn.ReLU):
    """``nn.ReLU`` that saves a 1-bit mask instead of its output."""

    mesa_any_mode = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return mesa_relu(x, self.inplace)


def comparable(x: torch.Tensor) -> torch.Tensor:
    """``x`` as torch's activation backward kernels compare it: fp16/bf16 widened to fp32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class MesaPiecewiseFunction(torch.autograd.Function):
    """An activation whose derivative is ``inside`` where a 1-bit mask is set, else ``outside``."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                region: Callable[[torch.Tensor], torch.Tensor], inside: float, outside: float,
                inplace: bool) -> torch.Tensor:
        mask = PackedMask.of(region(comparable(x)))  # before an in-place op changes x
        if inplace:
            ctx.mark_dirty(x)
        y = activation(x)
        ctx.factors = (inside, outside)
        save(ctx, mask)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        inside, outside = ctx.factors
        grad_in = grad if inside == 1.0 else grad * inside
        grad_out = grad * outside if outside else torch.zeros_like(grad)
        return torch.where(mask.unpack(), grad_in, grad_out), None, None, None, None, None


class ChannelQuantized(MesaModule):
    """A Mesa activation with one quantized copy, grouped per channel whatever the layout."""

    mesa_any_mode = True

    mesa_quantizers = {'quant_channels': (1, None), 'quant_tokens': (-1, None)}

    def saved_quantizer(self, x: torch.Tensor) -> ActivationQuantizer:
        return self.quant_channels if x.dim() >= 4 else self.quant_tokens  # type: ignore[attr-defined]


@mesa_layer(nn.Hardtanh, 'activation')
class MesaHardtanh(MesaModule, nn.Hardtanh):
    """``nn.Hardtanh`` saving one bit per element (inside the pass-through range or not)."""

    mesa_any_mode = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        lo, hi = self.min_val, self.max_val
        return MesaPiecewiseFunction.apply(
            x, lambda t: F.hardtanh(t, lo, hi, self.inplace),
            lambda t: (t > lo) & (t < hi), 1.0, 0.0, self.inplace)


@mesa_layer(nn.ReLU6, 'activation')
class MesaReLU6(MesaHardtanh, nn.ReLU6):
    """``nn.ReLU6`` (a Hardtanh on [0, 6]) saving one bit per element."""


@mesa_layer(nn.LeakyReLU, 'activation')
class MesaLeakyReLU(MesaModule, nn.LeakyReLU):
    """``nn.LeakyReLU`` saving the sign bit of its input."""

    mesa_any_mode = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        slope = self.negative_slope
        return MesaPiecewiseFunction.apply(
            x, lambda t: F.leaky_relu(t, slope, self.inplace), lambda t: t > 0, 1.0, slope,
            self.inplace)


@mesa_layer(nn.Hardsigmoid, 'activation')
class MesaHardsigmoid(MesaModule, nn.Hardsigmoid):
    """``nn.Hardsigmoid`` saving one bit per element (inside (-3, 3) or not)."""

    mesa_any_mode = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaPiecewiseFunction.apply(
            x, lambda t: F.hardsigmoid(t, self.inplace), lambda t: (t > -3) & (t < 3),
            1.0 / 6.0, 0.0, self.inplace)


def _silu_derivative(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _mish_derivative(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(F.softplus(x))
    return t + x * torch.sigmoid(x) * (1.0 - t * t)


# name -> (derivative from the output rather than the input, the derivative); in fp32
_SMOOTH: dict[str, tuple[bool, Callable[[torch.Tensor], torch.Tensor]]] = {
    'silu': (False, _silu_derivative),
    'mish': (False, _mish_derivative),
    'sigmoid': (True, lambda y: y * (1.0 - y)),
    'tanh': (True, lambda y: 1.0 - y * y),
}


class MesaSmoothFunction(torch.autograd.Function):
    """SiLU / Mish / Sigmoid / Tanh keeping one quantized copy of their derivative.

    The derivative, not the input: it spans about [-0.1, 1.1] (SiLU, Mish) or less, so 8 bits
    of it err far less than the derivative of 8-bit inputs spanning a feature map's range, where
    the curvature turns each code step into a derivative error (on a +-45 input the input
    gradient errs by under 0.6% against 1.3-2.8% from input codes; tests/test_cnn_layers.py).
    Nothing reuses these codes, so the choice costs no memory; forward computes the derivative
    once, backward only multiplies.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                kind: str, inplace: bool, quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        from_output, derivative = _SMOOTH[kind]
        packed = None if from_output else quantizer.pack(derivative(comparable(x)))
        if inplace:
            ctx.mark_dirty(x)
        y = activation(x)
        save(ctx, quantizer.pack(derivative(comparable(y))) if from_output else packed)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed,) = load(ctx)
        return ((grad.float() * unpack(packed, torch.float32)).to(ctx.input_dtype),
                None, None, None, None)


@mesa_layer(nn.SiLU, 'activation', nearest_rounding=True)  # rounding: see GELU's
class MesaSiLU(ChannelQuantized, nn.SiLU):
    """``nn.SiLU`` whose derivative is kept quantized per channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaSmoothFunction.apply(x, lambda t: F.silu(t, self.inplace), 'silu',
                                        self.inplace, self.saved_quantizer(x))


@mesa_layer(nn.Mish, 'activation')
class MesaMish(ChannelQuantized, nn.Mish):
    """``nn.Mish`` whose derivative is kept quantized per channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaSmoothFunction.apply(x, lambda t: F.mish(t, self.inplace), 'mish',
                                        self.inplace, self.saved_quantizer(x))


@mesa_layer(nn.Sigmoid, 'activation')
class MesaSigmoid(ChannelQuantized, nn.Sigmoid):
    """``nn.Sigmoid`` whose derivative is kept quantized per channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaSmoothFunction.apply(x, torch.sigmoid, 'sigmoid', False,
                                        self.saved_quantizer(x))


@mesa_layer(nn.Tanh, 'activation')
class MesaTanh(ChannelQuantized, nn.Tanh):
    """``nn.Tanh`` whose derivative is kept quantized per channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaSmoothFunction.apply(x, torch.tanh, 'tanh', False, self.saved_quantizer(x))


class MesaHardswishFunction(torch.autograd.Function):
    """Hardswish keeping ``-3 < x < 3`` as a bit and ``clamp(x, -3, 3)`` quantized.

    Inside, the derivative ``x / 3 + 1/2`` is read from the quantized value; outside it is 0
    (``x <= -3``) or 1 (``x >= 3``), as in torch's backward, told apart by the sign of the
    clamped value, which quantization cannot flip (a step is at most 6 / 3 = 2 even at 2 bits).
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, inplace: bool, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        xf = comparable(x)
        inside = PackedMask.of((xf > -3) & (xf < 3))
        packed = quantizer.pack(x.detach().clamp(-3.0, 3.0))
        if inplace:
            ctx.mark_dirty(x)
        y = F.hardswish(x, inplace)
        save(ctx, inside, packed)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        inside, packed = load(ctx)
        x = unpack(packed, torch.float32)
        derivative = torch.where(inside.unpack(), x / 3.0 + 0.5, (x > 0).float())
        return (grad.float() * derivative).to(ctx.input_dtype), None, None


@mesa_layer(nn.Hardswish, 'activation')
class MesaHardswish(ChannelQuantized, nn.Hardswish):
    """``nn.Hardswish``: a bit per element plus the quantized input clamped to [-3, 3]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaHardswishFunction.apply(x, self.inplace, self.saved_quantizer(x))


class MesaELUFunction(torch.autograd.Function):
    """ELU keeping ``x > 0`` as a bit and the quantized negative part of the output.

    For ``x <= 0`` the derivative is ``alpha * exp(x) = y + alpha``; for ``x > 0`` it is 1.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, alpha: float, inplace: bool,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.alpha = alpha
        positive = comparable(x) > 0
        if inplace:
            ctx.mark_dirty(x)
        y = F.elu(x, alpha, inplace)
        negative_part = y.detach().masked_fill(positive, 0)
        save(ctx, PackedMask.of(positive), quantizer.pack(negative_part))
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        positive, packed = load(ctx)
        derivative = unpack(packed, torch.float32) + ctx.alpha
        g = grad.float()
        grad_x = torch.where(positive.unpack(), g, g * derivative)
        return grad_x.to(ctx.input_dtype), None, None, None


@mesa_layer(nn.ELU, 'activation')
class MesaELU(ChannelQuantized, nn.ELU):
    """``nn.ELU``: the sign bit plus the quantized negative part of its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaELUFunction.apply(x, self.alpha, self.inplace, self.saved_quantizer(x))


class MesaPReLUFunction(torch.autograd.Function):
    """``F.prelu`` keeping the sign bit of x and, for the weight gradient, its negative part."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        xc, wc = autocast_inputs(ctx, x, weight)
        with autocast_off(ctx.device_type):
            y = F.prelu(xc, wc)
        positive = xc > 0
        packed = (quantizer.pack(xc.detach().masked_fill(positive, 0))
                  if ctx.needs_input_grad[1] else None)
        save(ctx, PackedMask.of(positive), packed, weight)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        positive, packed, weight = load(ctx)
        grad = grad.to(ctx.compute_dtype)
        mask = positive.unpack()
        # weight broadcasts along dim 1 (one per channel) or is a single value
        shape = [1] * grad.dim()
        if weight.numel() > 1:
            shape[1] = weight.numel()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w = weight.to(ctx.compute_dtype).view(shape)
            grad_x = torch.where(mask, grad, w * grad).to(ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            negative = unpack(packed, torch.float32).masked_fill_(mask, 0)
            grad_w = sum_to(grad.float() * negative, torch.Size(shape), weight.dtype)
            grad_w = grad_w.reshape(weight.shape)
        return grad_x, grad_w, None


@mesa_layer(nn.PReLU, 'activation')
class MesaPReLU(MesaModule, nn.PReLU):
    """``nn.PReLU``: exact input gradient from the sign bit; the weight gradient reads the
    quantized negative part of the input (grouped per channel, dim 1)."""

    mesa_any_mode = True

    mesa_quantizers = {'quant_negative': (1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight) or x.dim() < 2:
            return super().forward(x)
        return MesaPReLUFunction.apply(x, self.weight, self.quant_negative)
