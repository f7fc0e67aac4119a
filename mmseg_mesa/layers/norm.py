"""LayerNorm and BatchNorm saving their `bits`-bit normalized inputs and exact 1/std."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..quantizer import ActivationQuantizer, unpack
from ..saved import load, save
from .base import MesaModule, channel_dot, no_autocast_backward, record_input


def moments(x: torch.Tensor, dims: tuple[int, ...] | int, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 mean and exact ``rstd = 1 / sqrt(var + eps)`` over ``dims`` (kept dims)."""
    with torch.no_grad():
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0, keepdim=True)
        return mean, torch.rsqrt(var + eps)


def normalized(x: torch.Tensor, dims: tuple[int, ...] | int, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean) * rstd`` in fp32 and the exact ``rstd`` over ``dims`` (what LayerNorm and
    GroupNorm keep for backward), computed without grad and with one full-size temporary."""
    mean, rstd = moments(x, dims, eps)
    with torch.no_grad():
        return (x - mean).mul_(rstd), rstd  # fp32 by type promotion


def normalized_input_grad(g_norm: torch.Tensor, x_norm: torch.Tensor, rstd: torch.Tensor,
                          dims: tuple[int, ...] | int) -> torch.Tensor:
    """Input gradient of a normalization over ``dims`` from the gradient of its normalized
    output (``g_norm``, the weight already applied), the normalized input and the exact 1/std."""
    return rstd * (g_norm - g_norm.mean(dims, keepdim=True)
                   - x_norm * (g_norm * x_norm).mean(dims, keepdim=True))


class MesaLayerNormFunction(torch.autograd.Function):
    """``F.layer_norm`` saving the packed *normalized* input and the exact 1/std of each token.

    Backward needs ``x_norm = (x - mean) * rstd`` and ``rstd``. Recomputing them from a quantized
    ``x`` would multiply the quantization noise by ``rstd``, so a token whose spread is small next
    to its channels' ranges (ViT's class token and position embeddings at init, low-variance
    tokens of trained models) would get gradients dominated by noise (DeiT-S UPerNet's
    ``pos_embed`` gradient, docs/benchmarks.md). ``x_norm`` has unit spread in every token, so
    its quantization error does not depend on the token, and ``rstd`` costs 4 bytes per token.
    The dequantized values are not re-standardized: a constant token has ``x_norm == 0`` exactly,
    and re-standardizing would blow its noise up to unit variance.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: tuple, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        ctx.norm_dims = tuple(range(-len(normalized_shape), 0))
        y = F.layer_norm(x, normalized_shape, weight, bias, eps)
        x_norm, rstd = normalized(x, ctx.norm_dims, eps)
        save(ctx, quantizer.pack(x_norm), rstd, weight, bias)
        del x_norm
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, rstd, weight, bias = load(ctx)
        x_norm = unpack(packed, torch.float32)
        dims = ctx.norm_dims
        g = grad.float()
        batch_dims = tuple(range(g.dim() - len(dims)))
        grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[2]:
            grad_w = (g * x_norm).sum(batch_dims).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[3]:
            grad_b = g.sum(batch_dims).to(bias.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g_norm = g * weight.float() if weight is not None else g
            grad_x = normalized_input_grad(g_norm, x_norm, rstd, dims).to(ctx.input_dtype)
        return grad_x, None, grad_w, grad_b, None, None


class MesaLayerNorm(MesaModule, nn.LayerNorm):
    """``nn.LayerNorm`` whose saved normalized input is quantized per channel group (last dim)."""

    mesa_quantizers = {'quant_input': (-1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        return MesaLayerNormFunction.apply(x, tuple(self.normalized_shape), self.weight,
                                           self.bias, self.eps, self.quant_input)


def batch_norm_grads(grad: torch.Tensor, x_norm: torch.Tensor, invstd: torch.Tensor,
                     weight: torch.Tensor | None, sum_dy: torch.Tensor,
                     sum_dy_xnorm: torch.Tensor, count: float) -> torch.Tensor:
    """Input gradient of training-mode batch norm from (possibly all-reduced) channel sums.

    ``x_norm = (x - mean) * invstd``, the caller's own fp32 temporary: the result is written
    into it, so backward holds no full-size tensor besides ``grad`` and this one (the
    out-of-place formula made three more, up to 320 MiB at Swin-T UPerNet's 512x512 peak).
    All per-channel tensors are shaped to broadcast over x.
    """
    scale = invstd if weight is None else invstd * weight.float().view_as(invstd)
    out = x_norm.mul_(-(sum_dy_xnorm / count)).add_(grad).sub_(sum_dy / count)
    return out.mul_(scale)


class MesaBatchNormFunction(torch.autograd.Function):
    """Training-mode ``F.batch_norm`` saving the packed *normalized* input and 1/std per channel.

    The normalized input ``(x - mean) / std`` is what backward needs, and unlike ``x`` it is
    equally well conditioned in every channel: with very few values per channel (PPM's 1x1
    pooled branch sees batch-size values) the spread of ``x`` within a channel can be far below
    a quantization step of ``x``'s range, which wrecked gradients. Backward re-standardizes the
    dequantized values, so the input gradient stays exactly orthogonal to per-channel constants
    (a bias in front of BatchNorm keeps its analytically zero gradient).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, momentum: float, eps: float,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.eps = eps
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
        packed, invstd = pack_channel_normalized(x, eps, quantizer)
        save(ctx, packed, invstd, weight, bias)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, invstd, weight, bias = load(ctx)
        g = grad.float()
        dims = [0] + list(range(2, g.dim()))
        x_norm = standardize(unpack(packed, torch.float32), dims, invstd, ctx.eps)
        sum_dy = g.sum(dims, keepdim=True)
        sum_dy_xnorm = channel_dot(g, x_norm, dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            count = g.numel() / g.shape[1]
            grad_x = batch_norm_grads(g, x_norm, invstd, weight, sum_dy, sum_dy_xnorm,
                                      count).to(ctx.input_dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xnorm.flatten().to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.flatten().to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def pack_channel_normalized(x: torch.Tensor, eps: float, quantizer: Any
                            ) -> tuple[Any, torch.Tensor]:
    """The packed ``(x - mean) * invstd`` over every dim but 1, and the exact ``invstd``.

    An ``ActivationQuantizer`` packs it straight from ``x`` (``pack_standardized``: no
    full-size temporary); other compressors (DIVISION) get the normalized tensor.
    """
    dims = (0, *range(2, x.dim()))
    if isinstance(quantizer, ActivationQuantizer):
        mean, invstd = moments(x, dims, eps)
        return quantizer.pack_standardized(x, mean, invstd), invstd
    x_norm, invstd = normalized(x, dims, eps)
    return quantizer.pack(x_norm), invstd


def standardize(x_norm: torch.Tensor, dims: list[int], invstd: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Restore the exact per-channel moments of ``(x - mean) * invstd`` after dequantization,
    in place on the freshly decoded ``x_norm``.

    Its mean is 0 and its variance ``var / (var + eps) = 1 - eps * invstd**2`` (well below 1 when
    a channel's variance is small next to eps, as in PPM's pooled 1x1 branch).
    """
    var, mean = torch.var_mean(x_norm, dim=dims, correction=0, keepdim=True)
    return x_norm.sub_(mean).mul_(standardize_scale(var, invstd, eps))


def standardize_scale(var: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """The factor that gives centred values of variance ``var`` the variance of ``x_norm``.

    Separate from ``standardize`` so that SyncBatchNorm can apply it with moments all-reduced
    over the process group.
    """
    target = (1.0 - eps * invstd.square()).clamp_min(0.0)
    return torch.sqrt(target / var.clamp_min(1e-30))


def batch_norm_momentum(bn: _BatchNorm) -> float:
    """The exponential-average factor ``_BatchNorm.forward`` would use (updates the counter)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return factor


class MesaBatchNorm(MesaModule, _BatchNorm):
    """Any single-process BatchNorm (1d/2d/3d, mmengine's ``_BatchNormXd``), input saved in
    ``bits`` bits.

    Running statistics are updated exactly as torch does; eval mode runs the torch path. The
    normalized input is quantized with one group per channel (the statistics are per channel
    anyway, and 2 floats per channel cost nothing next to the activation).
    """

    mesa_quantizers = {'quant_input': (1, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        self._check_input_dim(x)
        momentum = batch_norm_momentum(self)
        track = self.track_running_stats
        return MesaBatchNormFunction.apply(
            x, self.weight, self.bias, self.running_mean if track else None,
            self.running_var if track else None, momentum, self.eps, self.quant_input)


class MesaBatchNorm2d(MesaBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with a ``bits``-bit saved input."""
