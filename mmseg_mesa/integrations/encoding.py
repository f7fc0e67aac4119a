"""EncNet's ``Encoding`` layer keeping only its packed input for backward.

``Encoding`` assigns every pixel softly to ``K`` codewords and sums the residuals: its forward
expands the ``(N, HW, C)`` features to ``(N, HW, K, C)`` residuals twice, and autograd keeps
them (and their squares' input) for backward, more than all of EncNet's convolutions keep once
packed. ``MesaEncodingFunction`` runs the layer's own
forward without grad (bit-identical) and saves its input packed; backward decodes it and runs the
same forward again with grad, a block of pixels at a time (every pixel's assignment is its own,
and the aggregation is a sum over pixels), so no full residual tensor exists in backward either.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from mmseg.models.utils.encoding import Encoding

from ..layers.autocast import record_autocast, replayed_autocast, returns_owned
from ..layers.base import MesaModule
from ..layers.formulas import restore
from ..quantizer import ActivationQuantizer
from ..reuse import packed_reusing
from ..saved import load, save

# Elements of one block's residuals in backward (16 MiB in fp32), as the banded loss's bands.
BLOCK_ELEMENTS = 1 << 22


class MesaEncodingFunction(torch.autograd.Function):
    """``forward_fn(x)`` of an ``Encoding`` with ``codewords`` and ``scale``, saving ``x`` packed
    per channel (its codes reused where the layer before left them)."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, codewords: torch.Tensor, scale: torch.Tensor,
                forward_fn: Callable[[torch.Tensor], torch.Tensor],
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_autocast(ctx, x)
        ctx.shape = x.shape
        with torch.no_grad():
            y = forward_fn(x)
        save(ctx, packed_reusing(x, x, quantizer), codewords, scale)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, codewords, scale = load(ctx)
        need_x, need_codewords, need_scale = ctx.needs_input_grad[:3]
        batch, channels = ctx.shape[:2]
        # the layer's own layout: (N, HW, C)
        x = restore(packed, ctx.input_dtype).view(batch, channels, -1).transpose(1, 2)
        pixels, num_codes = x.shape[1], codewords.shape[0]
        step = max(1, BLOCK_ELEMENTS // max(1, batch * num_codes * channels))
        grad_x = torch.empty_like(x) if need_x else None
        grad_codewords = torch.zeros_like(codewords) if need_codewords else None
        grad_scale = torch.zeros_like(scale) if need_scale else None
        for start in range(0, pixels, step):
            block = slice(start, min(start + step, pixels))
            with torch.enable_grad(), replayed_autocast(ctx):
                leaves = (x[:, block].detach().requires_grad_(need_x),
                          codewords.detach().requires_grad_(need_codewords),
                          scale.detach().requires_grad_(need_scale))
                weights = F.softmax(Encoding.scaled_l2(*leaves), dim=2)
                encoded = Encoding.aggregate(weights, leaves[0], leaves[1])
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            found = iter(torch.autograd.grad(encoded, wanted, grad))
            if need_x:
                grad_x[:, block] = next(found)
            if need_codewords:
                grad_codewords += next(found)
            if need_scale:
                grad_scale += next(found)
        if grad_x is not None:
            grad_x = grad_x.transpose(1, 2).reshape(ctx.shape)
        return grad_x, grad_codewords, grad_scale, None, None


class MesaEncoding(MesaModule, Encoding):
    """``Encoding`` (EncNet's context encoding) saving its input packed per channel."""

    mesa_quantizers = {'quant_input': (1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.codewords, self.scale) or x.dim() != 4:
            return super().forward(x)
        return MesaEncodingFunction.apply(x, self.codewords, self.scale, super().forward,
                                          self.quant_input)
