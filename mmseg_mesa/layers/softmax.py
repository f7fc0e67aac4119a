"""Softmax that saves only its output (the original Mesa saved input and output)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..quantizer import ActivationQuantizer, unpack
from ..registry import mesa_layer
from ..reuse import attach_codes
from ..saved import SOFTMAX_OUTPUT, load, save
from .autocast import no_autocast_backward, record_input, returns_owned
from .base import MesaModule


class MesaSoftmaxFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, dim: int, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        ctx.dim = dim
        y = F.softmax(x, dim)
        packed = quantizer.pack(y)
        save(ctx, packed, label=SOFTMAX_OUTPUT)
        attach_codes(y, packed)  # attn @ v saves the same map: it reuses these codes
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed,) = load(ctx)
        grad_x = softmax_backward(grad, unpack(packed, torch.float32), ctx.dim)
        return grad_x.to(ctx.input_dtype), None, None


def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """The input gradient of ``y = softmax(x, dim)``, ``y * (grad - sum(grad * y, dim))``, in
    ``y``'s dtype: torch's own softmax backward kernel, one fused pass with no full-size
    temporary besides its result (every Mesa softmax and recomputed attention map use it)."""
    return torch._softmax_backward_data(grad.to(y.dtype), y, dim, y.dtype)


def softmax_dim(dim: int | None, ndim: int) -> int:
    """nn.Softmax's legacy rule when ``dim`` is None."""
    if dim is not None:
        return dim
    return 0 if ndim in (0, 1, 3) else 1


@mesa_layer(nn.Softmax, 'softmax')
class MesaSoftmax(MesaModule, nn.Softmax):
    """``nn.Softmax`` saving its ``bits``-bit output, one quantization group per index of dim 1.

    For attention maps ``(B, heads, N, N)`` that is one group per head, as in Mesa.
    """

    mesa_quantizers = {'quant_output': (1, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x) or x.dim() < 2:
            return super().forward(x)
        return MesaSoftmaxFunction.apply(x, softmax_dim(self.dim, x.dim()), self.quant_output)
