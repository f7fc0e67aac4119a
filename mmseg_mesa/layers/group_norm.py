"""GroupNorm saving its ``bits``-bit normalized input and the exact 1/std of every (sample, group).

Backward needs ``x_norm = (x - mean) / std`` and ``1/std`` per (sample, group). Quantizing the raw
input and recomputing both from the dequantized values would multiply the quantization noise by
``1/std``, which is large for a group whose spread is small next to its channels' range (the
failure the fidelity issue found in LayerNorm). ``x_norm`` has unit spread in every group, so it
quantizes equally well everywhere; ``1/std`` is kept exactly (4 bytes per sample and group). The
dequantized ``x_norm`` is used as it is: re-standardizing it would blow a constant group's
quantization noise (its ``x_norm`` is exactly 0) up to unit variance.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..quantizer import ActivationQuantizer, unpack
from ..registry import mesa_layer
from ..saved import load, save
from .autocast import cast, no_autocast_backward, record_input, returns_owned
from .base import MesaModule
from .layout import mark_channels_first
from .norm import cast_grads, normalized
from .norm_backward import NormSets, normalization_backward


def grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(N, C, *)`` viewed as ``(N, G, C/G * prod(*))``."""
    return x.reshape(x.shape[0], groups, -1)


class MesaGroupNormFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        ctx.num_groups = num_groups
        y = F.group_norm(x, num_groups, weight, bias, eps)
        x_norm, rstd = normalized(grouped(x, num_groups), 2, eps)
        save(ctx, quantizer.pack(x_norm.view(x.shape)), rstd, weight, bias)
        del x_norm
        return mark_channels_first(y)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, rstd, weight, bias = load(ctx)
        grads = normalization_backward(
            cast(grad, torch.float32), unpack(packed, torch.float32), rstd, weight, bias,
            NormSets.channel_groups(ctx.num_groups),
            (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]))
        grad_x, grad_w, grad_b = cast_grads(ctx, grads, weight, bias)
        return grad_x, None, grad_w, grad_b, None, None


@mesa_layer(nn.GroupNorm, 'groupnorm')
class MesaGroupNorm(MesaModule, nn.GroupNorm):
    """``nn.GroupNorm`` saving its normalized input (``bits`` bits, per channel group of dim 1) and
    the exact 1/std per (sample, group)."""

    mesa_any_mode = True

    mesa_quantizers = {'quant_input': (1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias) or x.dim() < 2:
            return super().forward(x)
        return MesaGroupNormFunction.apply(x, self.num_groups, self.weight, self.bias,
                                           self.eps, self.quant_input)
