"""LayerNorm and BatchNorm saving their `bits`-bit normalized inputs and exact 1/std."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._backend import select_backend
from ..codes import Affine, Codes
from ..constants import filled
from ..quantizer import ActivationQuantizer, Mapped, Packed, unpack, unpack_divided, without_grad
from ..registry import mesa_layer
from ..reuse import attach_codes
from ..saved import load, save
from . import scale_free
from .autocast import cast, device_type, no_autocast_backward, record_input, returns_owned
from .base import MesaModule
from .chunking import channel_dot
from .layout import mark_channels_first
from .norm_backward import NormSets, fits_fused, normalization_backward
from .norm_backward_owned import batch_norm_backward_into
from .ownership import owned_gradients

# Moments torch's norms return that are kept as they are; half-precision ones (bf16 or fp16
# parameters on CPU) are recomputed in fp32 from the input.
WIDE_MOMENTS = (torch.float32, torch.float64)


def moments(x: torch.Tensor, dims: tuple[int, ...] | int, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 mean and exact ``rstd = 1 / sqrt(var + eps)`` over ``dims`` (kept dims)."""
    with without_grad():
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0, keepdim=True)
        return mean, torch.rsqrt(var + eps)


def normalized(x: torch.Tensor, dims: tuple[int, ...] | int, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean) * rstd`` in fp32 and the exact ``rstd`` over ``dims`` (what LayerNorm and
    GroupNorm keep for backward), computed without grad and with one full-size temporary."""
    mean, rstd = moments(x, dims, eps)
    return standardized(x, mean, rstd), rstd


def standardized(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``(x - mean) * rstd`` (fp32 or wider, by type promotion), without grad."""
    with without_grad():
        return (x - mean).mul_(rstd)


def layer_norm_moments(x: torch.Tensor, normalized_shape: tuple, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.layer_norm``'s output with the mean and 1/std of each token (kept dims, fp32 or
    wider): what the normalized input ``(x - mean) * rstd`` is packed from.

    Outside autocast they are the moments ``native_layer_norm`` returns with the output (one
    call: a ``var_mean`` costs several times the whole layer norm on CPU, docs/benchmarks.md).
    Under autocast (``F.layer_norm`` has its own cast rule there) or where torch keeps the
    moments in half precision (bf16 on CPU), they are computed in fp32.
    """
    if not torch.is_autocast_enabled(device_type(x)):
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        if mean.dtype in WIDE_MOMENTS:
            return y, mean, rstd
    else:
        y = F.layer_norm(x, normalized_shape, weight, bias, eps)
    mean, rstd = moments(x, tuple(range(-len(normalized_shape), 0)), eps)
    return y, mean, rstd


def pack_layer_normalized(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                          quantizer: Any) -> Any:
    """The packed ``(x - mean) * rstd`` of a LayerNorm (moments per token). An
    ``ActivationQuantizer`` packs it straight from ``x`` (``row_moments``: the kernels
    standardize each value as they read it, so the norm runs once and no full-size fp32
    temporary is made); other compressors (DIVISION) get the normalized tensor."""
    if isinstance(quantizer, ActivationQuantizer):
        return quantizer.pack(x, row_moments=(mean, rstd))
    return quantizer.pack(standardized(x, mean, rstd))


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
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: tuple, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        ctx.normalized_shape = normalized_shape
        x = x.contiguous()  # a strided input (a transposed patch map) is copied once, not twice
        y, mean, rstd = layer_norm_moments(x, normalized_shape, weight, bias, eps)
        packed = pack_layer_normalized(x, mean, rstd, quantizer)
        save(ctx, packed, rstd, weight, bias)
        if isinstance(packed, Packed):  # a Linear reading y saves it as these codes
            attach_codes(y, affine_codes(packed, weight, bias, y.dtype))
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, rstd, weight, bias = load(ctx)
        needs = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                 bias is not None and ctx.needs_input_grad[3]]
        # x_norm / rstd decoded in one call: the input less its token's mean, which torch's
        # kernel standardizes with the exact rstd (no pass multiplies the input gradient by it)
        grads = torch.ops.aten.native_layer_norm_backward(
            cast(grad, torch.float32), unpack_divided(packed, rstd, torch.float32),
            ctx.normalized_shape, filled(0.0, rstd.shape, rstd), rstd.float(),
            None if weight is None else weight.float(), None if bias is None else bias.float(),
            needs)
        grad_x, grad_w, grad_b = cast_grads(ctx, grads, weight, bias)
        return grad_x, None, grad_w, grad_b, None, None


def elementwise_affine(weight: torch.Tensor | None, bias: torch.Tensor | None,
                       x_norm: torch.Tensor) -> torch.Tensor:
    """``x_norm * weight + bias`` (each optional), in place on a freshly decoded ``x_norm``."""
    if weight is not None:
        x_norm = x_norm.mul_(weight)
    return x_norm if bias is None else x_norm.add_(bias)


def affine_codes(packed: Packed, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> Codes:
    """LayerNorm's output as the codes of its normalized input: the affine is per channel, so
    quantizing ``x_norm`` per channel and mapping the codes through it is quantizing the output
    per channel over the mapped range (one step times ``|weight|``), without a second copy.
    With one channel per group, the affine folds into the codes' own (``codes.Affine``);
    otherwise it is applied to the decoded values, from a copy (fp32) that an in-place update of
    the Parameters cannot change."""
    if weight is None and bias is None:
        return replace(packed, dtype=dtype)
    if packed.group_size == 1 and all(t is None or t.dim() == 1 for t in (weight, bias)):
        return Affine(packed, weight, bias, dtype)
    fp32 = [None if t is None else t.detach().to(torch.float32, copy=True) for t in (weight, bias)]
    return Mapped(packed, functools.partial(elementwise_affine, *fp32), dtype)


@mesa_layer(nn.LayerNorm, 'layernorm', division=True)
class MesaLayerNorm(MesaModule, nn.LayerNorm):
    """``nn.LayerNorm`` whose saved normalized input is quantized per channel group (last dim)."""

    mesa_any_mode = True

    mesa_quantizers = {'quant_input': (-1, None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        return MesaLayerNormFunction.apply(x, tuple(self.normalized_shape), self.weight,
                                           self.bias, self.eps, self.quant_input)


class MesaBatchNormFunction(torch.autograd.Function):
    """Training-mode ``F.batch_norm`` saving the packed *normalized* input and 1/std per channel.

    The normalized input ``(x - mean) / std`` is what backward needs, and unlike ``x`` it is
    equally well conditioned in every channel: with very few values per channel (PPM's 1x1
    pooled branch sees batch-size values) the spread of ``x`` within a channel can be far below
    a quantization step of ``x``'s range, which wrecked gradients. Backward re-standardizes the
    dequantized values, so the input gradient stays exactly orthogonal to per-channel constants
    (a bias in front of BatchNorm keeps its analytically zero gradient). Over few values per
    channel the codes are refined (``few_values``): each channel's sum of them against the
    output gradient then has too few terms to average their rounding out. Where nothing else
    holds the incoming gradient, backward writes the input gradient into it
    (``norm_backward_owned``).
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, momentum: float, eps: float,
                quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.eps = eps
        scale_free.claim(ctx, x, weight)
        y, mean, invstd = batch_norm_with_moments(x, running_mean, running_var, weight, bias,
                                                  momentum, eps)
        refined = few_values(quantizer, x.numel() // max(x.shape[1], 1))
        save(ctx, pack_channel_normalized(x, mean, invstd, quantizer, refined), invstd, weight,
             bias)
        scale_free.offer(ctx, y, source=weight is not None and ctx.needs_input_grad[1])
        return mark_channels_first(y)

    @staticmethod
    @owned_gradients
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, invstd, weight, bias = load(ctx)
        exact = scale_free.target(ctx, grad)  # before the input gradient overwrites grad
        needs = ctx.needs_input_grad[:3]
        if scale_free.wanted(ctx):  # the weight's gradient tells the conv in front of it
            needs = (needs[0], True, needs[2])
        if exact is not None:  # the affine part's gradient is corrected along itself
            needs = (needs[0], needs[1], True)
        grads = eps_share = None
        if (ctx.owned_grads[0] and grad.dtype == ctx.input_dtype == torch.float32
                and not fits_fused(grad)):
            # the input gradient overwrites the incoming one, decoded by chunks
            eps_share = eps_share_of(invstd, ctx.eps)
            grads = batch_norm_backward_into(grad, packed, invstd, ctx.eps, weight, bias, needs,
                                             (1.0 - eps_share).view_as(invstd))
        if grads is None:
            grads, eps_share = channel_backward(
                cast(grad, torch.float32), unpack(packed, torch.float32), invstd, ctx.eps,
                weight, bias, needs, getattr(packed, 'backend', 'auto'), eps_share)
        grad_x, grad_w, grad_b = cast_grads(ctx, grads, weight, bias)
        grad_w, grad_b = scale_free.corrected_affine(exact, grad_w, grad_b, weight, bias)
        scale_free.leave(ctx, grad_x, grad_w, weight, eps_share)
        return (grad_x, grad_w if ctx.needs_input_grad[1] else None,
                grad_b if ctx.needs_input_grad[2] else None, None, None, None, None, None)


def cast_grads(ctx: Any, grads: tuple, weight: torch.Tensor | None,
               bias: torch.Tensor | None) -> tuple:
    """A norm's fp32 ``(grad_x, grad_weight, grad_bias)`` in the dtypes of its input and
    affine parameters."""
    grad_x, grad_w, grad_b = grads
    return (None if grad_x is None else cast(grad_x, ctx.input_dtype),
            None if grad_w is None else cast(grad_w, weight.dtype),
            None if grad_b is None else cast(grad_b, bias.dtype))


def eps_share_of(invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """``eps / (var + eps) = eps * invstd**2`` per channel, flat fp32: the share of a channel's
    variance that eps takes (``1 -`` it, unclamped, is the normalized input's variance: a
    channel below 0 by rounding is not reliable anyway)."""
    rstd = invstd.reshape(-1).float()
    return torch.addcmul(filled(0.0, (), rstd), rstd, rstd, value=eps)


def channel_backward(grad: torch.Tensor, decoded: torch.Tensor, invstd: torch.Tensor,
                     eps: float, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     needs: tuple[bool, bool, bool], backend: str = 'auto',
                     eps_share: torch.Tensor | None = None) -> tuple[tuple, torch.Tensor]:
    """A BatchNorm's fp32 ``(grad_x, grad_weight, grad_bias)`` from the fp32 output gradient and
    its decoded normalized input restored to the exact per-channel moments it had before
    quantization, and ``eps_share_of`` its channels.

    Below ``FUSED_BACKWARD_BYTES``: torch's fused kernels (two full-size tensors alive), the
    codes normalized by ``native_batch_norm`` (whose epsilon only keeps a constant channel
    finite), and its backward given the spread each channel had as its 1/std, so no pass
    multiplies it out; the per-channel terms come from one op (``norm_terms``: unreliable
    channels keep the codes' own spread). Above it, re-standardized in place (one), with
    ``eps_share`` where the caller has it.
    """
    if not fits_fused(decoded):
        if eps_share is None:
            eps_share = eps_share_of(invstd, eps)
        x_norm = standardize(decoded, [0] + list(range(2, decoded.dim())), invstd, eps,
                             (1.0 - eps_share).view_as(invstd))
        return normalization_backward(grad, x_norm, invstd, weight, bias, NormSets.channels(),
                                      needs), eps_share
    rstd = invstd.reshape(-1).float()
    out, _, decoded_invstd = torch.native_batch_norm(
        decoded, None, None, None, None, True, 0.0, RESTANDARDIZE_EPS)
    eps_share, spread, scale = select_backend(rstd, backend).norm_terms(
        rstd, decoded_invstd, None if weight is None else weight.detach().float(), eps,
        RELIABLE_NORMALIZED_VARIANCE)
    grads = torch.ops.aten.native_batch_norm_backward(
        grad, out, scale, None, None, filled(0.0, scale.shape, scale, scale.dtype), spread, True,
        0.0, [needs[0], weight is not None and needs[1], bias is not None and needs[2]])
    return grads, eps_share


def batch_norm_with_moments(x: torch.Tensor, running_mean: torch.Tensor | None,
                            running_var: torch.Tensor | None, weight: torch.Tensor | None,
                            bias: torch.Tensor | None, momentum: float, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode ``F.batch_norm``'s output (running statistics updated) with the fp32 (or
    wider) mean and 1/std of each channel, shaped to broadcast over ``x``.

    On CPU without autocast ``F.batch_norm`` is ``native_batch_norm``, whose moments are taken
    as it returns them (unless they are half precision): a ``var_mean`` over every dim but 1
    costs more than the whole batch norm there. Elsewhere (cuDNN's kernels, autocast's cast
    rules) they are computed in fp32.
    """
    if x.is_cpu and not torch.is_autocast_enabled('cpu'):
        if x.numel() == x.shape[1]:  # F.batch_norm's own check; native_batch_norm has none
            raise ValueError('Expected more than 1 value per channel when training, got input '
                             f'size {x.size()}')
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var,
                                                  True, momentum, eps)
        if mean.dtype in WIDE_MOMENTS:
            shape = [1, -1] + [1] * (x.dim() - 2)
            return y, mean.view(shape), invstd.view(shape)
    else:
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    mean, invstd = moments(x, (0, *range(2, x.dim())), eps)
    return y, mean, invstd


def few_values(quantizer: Any, count: int) -> bool:
    """Whether batch statistics over ``count`` values per channel are too few for the
    quantizer's own codes of the normalized input: it refines them
    (``MesaConfig.batchnorm_refine_below``; Mesa's quantizer only, DIVISION has its own)."""
    return isinstance(quantizer, ActivationQuantizer) and count < quantizer.spec.refine_below


def pack_channel_normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                            quantizer: Any, refined: bool = False) -> Any:
    """The packed ``(x - mean) * invstd`` (per channel of dim 1), ``refined`` to about 16 bits
    if asked (``few_values``).

    An ``ActivationQuantizer`` packs it straight from ``x`` (``pack_standardized``: no
    full-size temporary); other compressors (DIVISION) get the normalized tensor.
    """
    if isinstance(quantizer, ActivationQuantizer):
        return quantizer.pack_standardized(x, mean, invstd, refined)
    return quantizer.pack(standardized(x, mean, invstd))


def standardize(x_norm: torch.Tensor, dims: list[int], invstd: torch.Tensor,
                eps: float, target: torch.Tensor | None = None) -> torch.Tensor:
    """Restore the exact per-channel moments of ``(x - mean) * invstd`` after dequantization,
    in place on the freshly decoded ``x_norm``.

    Its mean is 0 and its variance ``var / (var + eps) = 1 - eps * invstd**2`` (well below 1 when
    a channel's variance is small next to eps, as in PPM's pooled 1x1 branch): ``target``
    where the caller has it.
    """
    x_norm.sub_(x_norm.mean(dims, keepdim=True))
    # two passes (mean, then the centred values' mean square): torch's var_mean over every dim
    # but 1 is several times slower on CPU, and this is as accurate
    var = channel_dot(x_norm, x_norm, dims).div_(x_norm.numel() // x_norm.shape[1])
    return x_norm.mul_(standardize_scale(var, invstd, eps, target))


# The least variance re-standardizing divides by (``standardize_scale`` clamps to it, the fused
# batch-norm backward adds it): far below any variance the codes can have; a constant channel
# has 0 and stays 0 times a large factor.
RESTANDARDIZE_EPS = 1e-30


def normalized_variance(invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """The variance of ``x_norm = (x - mean) * invstd``: ``var / (var + eps) = 1 - eps *
    invstd**2`` (clamped at 0 against rounding)."""
    return (1.0 - eps * invstd.square()).clamp_min(0.0)


# Below this variance of ``x_norm`` (``var / (var + eps)``), ``1 - eps * invstd**2`` is mostly
# rounding (an fp32 invstd errs by about 1e-7 of itself), and the codes' own variance is the better
# figure: a channel that a near-zero weight all but silences (a RepVGG-style scale branch) would
# otherwise be scaled to nothing, and its weight gradient with it.
RELIABLE_NORMALIZED_VARIANCE = 1e-4


def standardize_scale(var: torch.Tensor, invstd: torch.Tensor, eps: float,
                      target: torch.Tensor | None = None) -> torch.Tensor:
    """The factor that gives centred values of variance ``var`` the variance of ``x_norm``
    (``target``: ``normalized_variance`` unless the caller has it; 1 where that variance is
    below ``RELIABLE_NORMALIZED_VARIANCE``).

    Separate from ``standardize`` so that SyncBatchNorm can apply it with moments all-reduced
    over the process group.
    """
    if target is None:
        target = normalized_variance(invstd, eps)
    scale = torch.sqrt(target / var.clamp_min(RESTANDARDIZE_EPS))
    return torch.where(target >= RELIABLE_NORMALIZED_VARIANCE, scale, 1.0)


def batch_norm_momentum(bn: _BatchNorm) -> float:
    """The exponential-average factor ``_BatchNorm.forward`` would use (updates the counter)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return factor


def channel_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector over ``x`` (channels in dim 1)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class EvalBatchNormFunction(torch.autograd.Function):
    """Eval-mode ``F.batch_norm`` (running statistics: ``norm_eval``, as mmdet's ResNets keep
    it), a per-channel affine map of its input.

    torch keeps the whole input for its backward. The input and bias gradients read nothing of
    it (the input's is ``grad * weight / std``, the product torch's eval backward forms); only a
    trainable weight's gradient reads the normalized input, which is then kept packed. A frozen
    affine keeps one scale per channel.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, running_mean: torch.Tensor,
                running_var: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        y = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
        with torch.no_grad():
            invstd = 1.0 / torch.sqrt(running_var.float() + eps)
            scale = invstd if weight is None else weight.float() * invstd
            packed = pack_channel_normalized(x, running_mean.float(), invstd, quantizer) \
                if ctx.needs_input_grad[3] else None
        ctx.weight_dtype = None if weight is None else weight.dtype
        save(ctx, packed, scale)
        return mark_channels_first(y)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, scale = load(ctx)
        g = cast(grad, torch.float32)
        dims = [0] + list(range(2, g.dim()))
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = cast(g * scale.view(channel_shape(g)), ctx.input_dtype)
        if ctx.needs_input_grad[3]:
            grad_w = cast(channel_dot(g, unpack(packed, torch.float32), dims).flatten(),
                          ctx.weight_dtype)
        if ctx.needs_input_grad[4]:
            grad_b = cast(g.sum(dims), ctx.weight_dtype)
        return grad_x, None, None, grad_w, grad_b, None, None


def eval_batch_norm(module: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``module(x)`` through ``EvalBatchNormFunction`` where the module normalizes with its
    running statistics (eval mode) in a training step; else None (the caller's own path)."""
    if module.training or not module.track_running_stats or module.running_mean is None \
            or not module.mesa_config.enabled or not torch.is_grad_enabled() \
            or not (x.requires_grad or any(p is not None and p.requires_grad
                                           for p in (module.weight, module.bias))):
        return None
    module._check_input_dim(x)
    return EvalBatchNormFunction.apply(x, module.running_mean, module.running_var, module.weight,
                                       module.bias, module.eps, module.quant_input)


# BatchNorm's backward sums its normalized input against the output gradient over every pixel of
# a channel and sends that one number back to all of them, so the rounding error of the sum
# reaches every upstream weight in one direction; nearest rounding has half the variance of
# stochastic rounding, and its bias measured nothing over independent batches
# (docs/benchmarks.md).
@mesa_layer(_BatchNorm, 'batchnorm', division=True, nearest_rounding=True)
class MesaBatchNorm(MesaModule, _BatchNorm):
    """Any single-process BatchNorm (1d/2d/3d, mmengine's ``_BatchNormXd``), input saved in
    ``bits`` bits.

    Running statistics are updated exactly as torch does. In eval mode (``norm_eval``) inside a
    training step it keeps no input for the input gradient (``EvalBatchNormFunction``). The
    normalized input is quantized with one group per channel (the statistics are per channel
    anyway, and 2 floats per channel cost nothing next to the activation).
    """

    mesa_quantizers = {'quant_input': (1, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        evaluated = eval_batch_norm(self, x)
        if evaluated is not None:
            return evaluated
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
