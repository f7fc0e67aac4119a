"""GELU (``bits``-bit saved input) and ReLU (1-bit saved mask)."""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..quantizer import ActivationQuantizer, Mapped, Packed, attach_codes, unpack
from ..saved import PackedMask, load, save
from .base import MesaModule, no_autocast_backward, record_input

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu_derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """d GELU(x) / dx in fp32, for both of torch's variants."""
    x = x.float()
    if approximate == 'tanh':
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))
        t = torch.tanh(inner)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * 0.044715 * x * x)
    cdf = 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2))
    return cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


class MesaGELUFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, approximate: str,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.approximate = approximate
        y = F.gelu(x, approximate=approximate)
        packed = quantizer.pack(x)
        save(ctx, packed)
        if isinstance(packed, Packed):  # the next Linear saves y as these codes
            attach_codes(y, Mapped(packed, functools.partial(F.gelu, approximate=approximate),
                                   y.dtype))
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed,) = load(ctx)
        derivative = gelu_derivative(unpack(packed, torch.float32), ctx.approximate)
        return (grad.float() * derivative).to(ctx.input_dtype), None, None


class MesaGELU(MesaModule, nn.GELU):
    """``nn.GELU`` whose saved input is quantized per channel group (last dim)."""

    mesa_quantizers = {'quant_input': (-1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaGELUFunction.apply(x, self.approximate, self.quant_input)


class MesaReLUFunction(torch.autograd.Function):
    """ReLU keeping only ``output > 0`` as one bit per element; supports in-place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            y = torch.relu_(x)
        else:
            y = torch.relu(x)
        save(ctx, PackedMask.of(y > 0))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        # torch's threshold_backward: no float copy of the mask
        return torch.where(mask.unpack(), grad, 0), None


class MesaReLU(MesaModule, nn.ReLU):
    """``nn.ReLU`` that saves a 1-bit mask instead of its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaReLUFunction.apply(x, self.inplace)
