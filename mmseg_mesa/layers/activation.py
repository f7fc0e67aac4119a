"""GELU (``bits``-bit saved input) and ReLU (1-bit saved mask)."""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..quantizer import ActivationQuantizer, Mapped, Packed, unpack
from ..reuse import attach_codes
from ..saved import PackedMask, load, save
from .base import MesaModule, cast, no_autocast_backward, record_input, returns_owned


class MesaGELUFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
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
        # torch's own GELU backward (one fused pass) on the decoded input, in fp32
        grad_x = torch.ops.aten.gelu_backward(cast(grad, torch.float32),
                                              unpack(packed, torch.float32),
                                              approximate=ctx.approximate)
        return cast(grad_x, ctx.input_dtype), None, None


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
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            y = torch.relu_(x)
        else:
            y = torch.relu(x)
        save(ctx, PackedMask.positive(y))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        return mask.select(grad), None


class MesaReLU(MesaModule, nn.ReLU):
    """``nn.ReLU`` that saves a 1-bit mask instead of its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x):
            return super().forward(x)
        return MesaReLUFunction.apply(x, self.inplace)
