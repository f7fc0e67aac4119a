"""Element-wise powers and quotients and max-reductions a module computes itself: MetaFormer's
``StarReLU`` (``relu(x) ** 2``), hand-written layer norms (``(x - u) / sqrt(s + eps)``), Hiera's
token pooling (``x.amax(dim)``), graph convolutions' max over neighbours (``torch.max(x, dim)``).

Torch keeps the base of a power and both sides of a quotient at full precision. These Functions
compute the op with torch's own call, so the forward is torch's to the bit, and keep the base, or
the numerator, as 8-bit codes. A denominator is kept as it is: it is usually a per-token or
per-channel statistic, small next to the numerator, and one quantization step of a denominator
near zero would be a large error in the quotient's gradient.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..quantizer import ActivationQuantizer, unpack
from ..saved import PackedMask, load, save
from .autocast import cast, no_autocast_backward, record_input, returns_owned
from .formulas import sum_to
from .pooling import index_dtype


class MesaPowFunction(torch.autograd.Function):
    """``x ** exponent`` for a number ``exponent``, keeping ``x`` packed."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, exponent: float,
                op: Callable[[torch.Tensor], torch.Tensor],
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.exponent = exponent
        y = op(x)
        save(ctx, quantizer.pack(x))
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed,) = load(ctx)
        e = ctx.exponent
        if e == 0:
            return torch.zeros_like(grad, dtype=ctx.input_dtype), None, None, None
        x = unpack(packed, torch.float32)
        grad_x = grad.float() * (e * x.pow(e - 1))
        return cast(grad_x, ctx.input_dtype), None, None, None


class MesaDivFunction(torch.autograd.Function):
    """``a / b`` (broadcasting), keeping ``a`` packed (what ``b``'s gradient reads) and ``b`` as
    it is."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor,
                op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                quantizer: ActivationQuantizer | None) -> torch.Tensor:
        record_input(ctx, a)
        ctx.metas = ((a.shape, a.dtype), (b.shape, b.dtype))
        y = op(a, b)
        keep_a = ctx.needs_input_grad[1]
        saved_a = (a if quantizer is None else quantizer.pack(a)) if keep_a else None
        save(ctx, saved_a, b)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        saved_a, b = load(ctx)
        a_meta, b_meta = ctx.metas
        g, bf = grad.float(), b.float()
        grad_a = sum_to(g / bf, *a_meta) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            a = saved_a.float() if isinstance(saved_a, torch.Tensor) else \
                unpack(saved_a, torch.float32)
            grad_b = sum_to(-g * a / (bf * bf), *b_meta)
        return grad_a, grad_b, None, None


class MesaAmaxFunction(torch.autograd.Function):
    """``x.amax(dims, keepdim)`` keeping where ``x`` equals its maximum, 1 bit per element:
    backward spreads the gradient evenly over the ties, as torch's does, so it is exact."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool,
                op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.dims = tuple(sorted(d % x.dim() for d in dims))
        ctx.keepdim = keepdim
        y = op(x)
        kept = y if keepdim else _unsqueezed(y, ctx.dims)
        save(ctx, PackedMask.of(x == kept))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        if not ctx.keepdim:
            grad = _unsqueezed(grad, ctx.dims)
        hits = mask.unpack()
        count = hits.sum(ctx.dims, keepdim=True)
        return mask.select(grad / count), None, None, None


class MesaMaxDimFunction(torch.autograd.Function):
    """``torch.max(x, dim, keepdim)`` (or ``min``) by torch's own call, keeping the indices it
    returns in the narrowest integer type, as max pooling keeps its positions
    (``pooling.index_dtype``: one byte for up to 256 candidates, where torch keeps eight):
    backward puts the gradient where they point, as torch's does, so it is exact."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, dim: int, keepdim: bool,
                op: Callable[[torch.Tensor], tuple]) -> tuple:
        ctx.shape, ctx.dim, ctx.keepdim = x.shape, dim % x.dim(), keepdim
        values, indices = op(x)
        ctx.mark_non_differentiable(indices)
        save(ctx, indices.to(index_dtype(x.shape[ctx.dim])))
        return values, indices

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
        (indices,) = load(ctx)
        indices = indices.long()
        if not ctx.keepdim:
            grad, indices = grad.unsqueeze(ctx.dim), indices.unsqueeze(ctx.dim)
        out = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        return out.scatter_(ctx.dim, indices, grad), None, None, None


def _unsqueezed(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        t = t.unsqueeze(d)
    return t
