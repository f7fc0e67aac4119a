"""``a @ b`` as a module, both operands saved in ``bits`` bits (attention's two matmuls)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..quantizer import ActivationQuantizer
from ..registry import mesa_layer
from ..reuse import packed_reusing
from ..saved import save
from .autocast import autocast_inputs, autocast_off, no_autocast_backward, returns_owned
from .base import MesaModule
from .formulas import operand_gradients, sum_to


def autocast_matmul(ctx: Any, a: torch.Tensor, b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.matmul(a, b)`` as autocast runs it, with the operands as it cast them; records
    ``ctx.a_meta`` and ``ctx.b_meta`` (shape and dtype of each gradient) and the compute dtype."""
    ac, bc = autocast_inputs(ctx, a, b)
    with autocast_off(ctx.device_type):
        y = torch.matmul(ac, bc)
    ctx.a_meta = (a.shape, a.dtype)
    ctx.b_meta = (b.shape, b.dtype)
    return y, ac, bc


def left_gradient(grad: torch.Tensor, b: torch.Tensor, a_meta: tuple) -> torch.Tensor:
    """The gradient of ``a`` in ``a @ b``, reduced to ``a``'s shape and dtype (``a_meta``)."""
    return sum_to(grad @ b.transpose(-2, -1), *a_meta)


def right_gradient(grad: torch.Tensor, a: torch.Tensor, b_meta: tuple) -> torch.Tensor:
    """The gradient of ``b`` in ``a @ b``, reduced to ``b``'s shape and dtype (``b_meta``)."""
    return sum_to(a.transpose(-2, -1) @ grad, *b_meta)


class MesaMatMulFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, quant_a: ActivationQuantizer,
                quant_b: ActivationQuantizer) -> torch.Tensor:
        y, ac, bc = autocast_matmul(ctx, a, b)
        # grad of a needs b and vice versa.
        packed_b = packed_reusing(b, bc, quant_b) if ctx.needs_input_grad[0] else None
        packed_a = packed_reusing(a, ac, quant_a) if ctx.needs_input_grad[1] else None
        save(ctx, packed_a, packed_b)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (*operand_gradients(
            ctx, grad.to(ctx.compute_dtype), 0,
            lambda g, b: left_gradient(g, b, ctx.a_meta),
            lambda g, a: right_gradient(g, a, ctx.b_meta)), None, None)


class MatMul(nn.Module):
    """``a @ b`` as a module, so that a model can mark the matmuls Mesa may compress."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


@mesa_layer(MatMul, 'matmul')
class MesaMatMul(MesaModule, MatMul):
    """``forward(a, b) = a @ b``, compressing operands of 2 or more dims.

    Both operands are quantized with one group per index of dim 1: one group per head for
    ``(B, heads, N, d)`` attention operands.
    """

    mesa_quantizers = {'quant_a': (1, 1), 'quant_b': (1, 1)}

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(a, b) or a.dim() < 2 or b.dim() < 2:
            return super().forward(a, b)
        return MesaMatMulFunction.apply(a, b, self.quant_a, self.quant_b)
