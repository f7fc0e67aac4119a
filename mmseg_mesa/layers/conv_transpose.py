"""ConvTranspose2d with a ``bits``-bit saved input (the weight gradient is all that reads it)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MesaConfig
from ..quantizer import ActivationQuantizer
from ..registry import mesa_layer
from .autocast import no_autocast_backward, returns_owned
from .base import MesaModule
from .conv import conv_bias_grad
from .formulas import weighted_backward, weighted_forward
from .layout import mark_channels_first


class MesaConvTranspose2dFunction(torch.autograd.Function):
    """``F.conv_transpose2d`` keeping a packed input.

    A transposed convolution is the input gradient of ``conv2d(z, w)``, so its own input
    gradient is ``conv2d(grad, w)`` and its weight gradient is ``conv2d``'s weight gradient
    with the roles of input and output gradient swapped (``torch.nn.grad.conv2d_weight``). Both
    need ``output_padding < stride`` (the convolution then maps the output back onto exactly the
    input's size); conversion leaves other layers alone.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple, padding: tuple, output_padding: tuple, groups: int,
                dilation: tuple, quantizer: ActivationQuantizer) -> torch.Tensor:
        ctx.conv_args = (stride, padding, dilation, groups)
        return mark_channels_first(weighted_forward(
            ctx, lambda xc, wc, bc: F.conv_transpose2d(xc, wc, bc, stride, padding,
                                                       output_padding, groups, dilation),
            x, weight, bias, quantizer))

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        stride, padding, dilation, groups = ctx.conv_args
        return weighted_backward(
            ctx, grad, lambda grad, w: F.conv2d(grad, w, None, stride, padding, dilation, groups),
            lambda x, grad, shape: torch.nn.grad.conv2d_weight(grad, shape, x, *ctx.conv_args),
            conv_bias_grad)


def conv_transpose_reason(module: nn.ConvTranspose2d) -> str | None:
    """Why a ConvTranspose2d cannot be converted, or None."""
    if module.padding_mode != 'zeros':
        return f'padding_mode={module.padding_mode!r} is not supported by torch either'
    if any(p >= s for p, s in zip(module.output_padding, module.stride)):
        return (f'output_padding={tuple(module.output_padding)} not below '
                f'stride={tuple(module.stride)}')
    return None


@mesa_layer(nn.ConvTranspose2d, 'conv_transpose2d', conv_transpose_reason)
class MesaConvTranspose2d(MesaModule, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` whose saved input is quantized per channel group (dim 1).

    Unbatched (3-dim) inputs run the torch path.
    """

    mesa_any_mode = True

    mesa_quantizers = {'quant_input': (1, None)}

    def mesa_setup(self, config: MesaConfig) -> None:
        reason = conv_transpose_reason(self)
        if reason is not None:
            raise ValueError(f'MesaConvTranspose2d: {reason}')
        super().mesa_setup(config)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias) or x.dim() != 4:
            return super().forward(x, output_size)
        output_padding = self._output_padding(x, output_size, self.stride, self.padding,
                                              self.kernel_size, 2, self.dilation)
        return MesaConvTranspose2dFunction.apply(
            x, self.weight, self.bias, self.stride, self.padding, tuple(output_padding),
            self.groups, self.dilation, self.quant_input)
