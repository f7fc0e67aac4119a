"""L2 norms a module computes itself: ``F.normalize`` (SwinV2's cosine attention) and
``x.norm(2, dim)`` (ConvNeXt-V2's global response normalization).

Torch's nodes keep their input (and the normalized output, or the norm) at full precision. These
Functions call torch's own op in forward, so the result is torch's to the bit, and keep one 8-bit
copy (of the output for ``normalize``, of the input for ``norm``) and the norms themselves, exact
(one value per normalized vector, small next to the vectors). Backward is the op's derivative on
the decoded copy.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..layer_types import declare_layer_type
from ..quantizer import ActivationQuantizer, unpack
from ..saved import load, save
from .autocast import cast, no_autocast_backward, record_input, returns_owned

# L2 norms and normalizations a module computes itself.
declare_layer_type('normalize')


class MesaNormalizeFunction(torch.autograd.Function):
    """``F.normalize(x, p=2, dim, eps)`` keeping the packed output and the clamped norms."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, dim: int, eps: float,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.dim = dim
        y = F.normalize(x, 2.0, dim, eps)
        norm = torch.linalg.vector_norm(x, 2, dim, keepdim=True, dtype=torch.float32)
        save(ctx, quantizer.pack(y), norm.clamp_min(eps), norm > eps)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, denom, above = load(ctx)
        y = unpack(packed, torch.float32)
        g = grad.float()
        # y = x / max(|x|, eps): where the norm is clamped the map is linear, x / eps
        radial = torch.where(above, (g * y).sum(ctx.dim, keepdim=True), 0.0)
        return cast((g - y * radial) / denom, ctx.input_dtype), None, None, None


class MesaVectorNormFunction(torch.autograd.Function):
    """``x.norm(2, dim, keepdim)`` (any of torch's spellings, called by ``op``) keeping the
    packed input and the exact norms."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, op: Any, dims: tuple[int, ...], keepdim: bool,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.dims, ctx.keepdim = dims, keepdim
        norm = op(x)
        save(ctx, quantizer.pack(x), norm)
        return norm

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, norm = load(ctx)
        x = unpack(packed, torch.float32)
        g, n = grad.float(), norm.float()
        if not ctx.keepdim:
            for d in sorted(d % x.dim() for d in ctx.dims):
                g, n = g.unsqueeze(d), n.unsqueeze(d)
        # d|x|/dx = x / |x|, and 0 where the norm is 0 (torch's convention)
        scale = torch.where(n == 0, 0.0, g / n)
        return cast(x * scale, ctx.input_dtype), None, None, None, None
