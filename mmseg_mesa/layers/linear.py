"""Linear with an 8-bit saved input."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..quantizer import ActivationQuantizer, unpack
from ..saved import load
from .base import MesaModule, no_autocast_backward, weighted_forward


class MesaLinearFunction(torch.autograd.Function):
    """``F.linear`` that keeps a packed copy of its input (and the weight Parameter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        return weighted_forward(ctx, F.linear, x, weight, bias, quantizer)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, weight = load(ctx)
        grad = grad.to(ctx.compute_dtype)
        grad_x = grad_w = grad_b = None
        grad_2d = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            # first, so the decoded fp32 input is freed before grad_x (as large) is made
            x = unpack(packed)
            grad_w = (grad_2d.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
            del x
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight.to(ctx.compute_dtype)).to(ctx.input_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


class MesaLinear(MesaModule, nn.Linear):
    """``nn.Linear`` whose saved input is quantized per channel group (last dim)."""

    mesa_quantizers = {'quant_input': (-1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        return MesaLinearFunction.apply(x, self.weight, self.bias, self.quant_input)
