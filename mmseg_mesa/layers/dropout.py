"""Dropout and DropPath saving 1-bit keep masks, and a decode head's Dropout2d whose backward
reuses its incoming gradient."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layer_types import declare_layer_type
from ..registry import mesa_layer
from ..saved import PackedMask, load, save
from .autocast import returns_owned
from .base import MesaModule
from .ownership import owned_gradients


def dropout_with_mask(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly ``F.dropout(x, p, training=True)`` for 0 < p < 1, plus its keep mask.

    Same random draws as torch: the fused ``native_dropout`` on accelerators, Bernoulli noise
    on the CPU, so a seeded run gives bit-identical outputs.
    """
    if not x.is_cpu:
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    mask = noise != 0
    noise.div_(1 - p)
    return x * noise, mask


class MesaDropoutFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        ctx.p = p
        y, mask = dropout_with_mask(x, p)
        save(ctx, PackedMask.of(mask))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        return grad * (mask.unpack().to(grad.dtype) / (1 - ctx.p)), None


class FeatureDropoutFunction(torch.autograd.Function):
    """``F.dropout2d(x, p, training=True)`` of a 4-d ``x`` (0 < p < 1): torch's draws (one
    ``bernoulli_`` per sample and channel, scaled) and output bit for bit. It saves that noise,
    as torch's product does; backward writes the input gradient into the incoming one where
    nothing else holds it, where torch's makes a second tensor of the features' size.
    ``in_place``: the caller vouches that nothing reads ``x`` afterwards
    (``ownership.sole_reference``); the product is then written into it, the same values."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, p: float, in_place: bool = False) -> torch.Tensor:
        noise = x.new_empty((*x.shape[:2], 1, 1)).bernoulli_(1 - p).div_(1 - p)
        ctx.save_for_backward(noise)
        if in_place:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    @owned_gradients
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (noise,) = ctx.saved_tensors
        if ctx.owned_grads[0] and grad.dtype == noise.dtype:
            return grad.mul_(noise), None, None
        return grad * noise, None, None


def inplace_or_no_mask_reason(module: nn.Dropout) -> str | None:
    if module.inplace:
        return 'in-place dropout is not supported'
    if not 0.0 < module.p < 1.0:
        return f'p={module.p} saves no mask'
    return None


@mesa_layer(nn.Dropout, 'dropout', inplace_or_no_mask_reason)
class MesaDropout(MesaModule, nn.Dropout):
    """``nn.Dropout`` keeping a 1-bit mask instead of the scaled noise tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x) or not 0.0 < self.p < 1.0 or self.inplace or x.numel() == 0:
            return super().forward(x)
        return MesaDropoutFunction.apply(x, self.p)


# mmcv's drop_path (integrations.modules.MesaDropPath) is converted only when config.layers names
# it: it keeps one number per sample for backward, which a 1-bit mask does not usefully shrink,
# while the conversion costs a Function call per block.
declare_layer_type('droppath', opt_in=True)


class MesaDropPathFunction(torch.autograd.Function):
    """mmcv's ``drop_path`` (per-sample stochastic depth), keeping one bit per sample."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, drop_prob: float) -> torch.Tensor:
        keep_prob = 1 - drop_prob
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        keep = (keep_prob + torch.rand(shape, dtype=x.dtype, device=x.device)).floor_()
        ctx.keep_prob = keep_prob
        save(ctx, PackedMask.of(keep != 0))
        return x.div(keep_prob) * keep

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = load(ctx)
        return (grad * mask.unpack().to(grad.dtype)).div(ctx.keep_prob), None
