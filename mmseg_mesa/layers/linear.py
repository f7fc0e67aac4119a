"""Linear with a ``bits``-bit saved input."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..quantizer import ActivationQuantizer
from ..registry import mesa_layer
from .autocast import no_autocast_backward, returns_owned
from .base import MesaModule
from .formulas import weighted_backward, weighted_forward


class MesaLinearFunction(torch.autograd.Function):
    """``F.linear`` that keeps a packed copy of its input (and the weight Parameter)."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        return weighted_forward(ctx, F.linear, x, weight, bias, quantizer)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return weighted_backward(
            ctx, grad, lambda grad, w: grad @ w,
            lambda x, grad, shape: (grad.reshape(-1, grad.shape[-1]).t()
                                    @ x.reshape(-1, x.shape[-1])),
            lambda grad: grad.reshape(-1, grad.shape[-1]).sum(0))


@mesa_layer(nn.Linear, 'linear', division=True)
@mesa_layer(NonDynamicallyQuantizableLinear, 'linear',
            lambda m: 'out_proj of nn.MultiheadAttention: only called through its weight, '
                      'compressed when the attention is converted')
class MesaLinear(MesaModule, nn.Linear):
    """``nn.Linear`` whose saved input is quantized per channel group (last dim)."""

    mesa_any_mode = True

    mesa_quantizers = {'quant_input': (-1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        return MesaLinearFunction.apply(x, self.weight, self.bias, self.quant_input)
