"""The one normalization backward that LayerNorm, GroupNorm, BatchNorm and SyncBatchNorm share.

Each of them keeps its normalized input ``x_norm = (x - mean) * rstd`` (as codes) and the exact
``rstd`` of every *set* of values it normalizes together: a token's channels (LayerNorm), a
sample's group of channels (GroupNorm), a channel over the batch (BatchNorm; over every rank for
SyncBatchNorm). With ``y = x_norm * weight + bias`` and ``g`` the gradient of ``y``::

    grad_weight = sum(g * x_norm)    grad_bias = sum(g)    (over the dims the weight is not on)
    grad_x = rstd * (gw - mean_S(gw) - x_norm * mean_S(gw * x_norm)),    gw = g * weight

``mean_S`` averages over each set; these two means are all that couples the values (what
SyncBatchNorm all-reduces). torch's fused backward kernels compute exactly this when handed
``x_norm`` as their input with mean 0 and 1/std 1, which normalizes nothing, and ``rstd`` then
scales the input gradient. The formula runs in place on ``x_norm`` instead where no kernel fits:
a BatchNorm input above ``FUSED_BACKWARD_BYTES`` (the kernels hold two full-size tensors where the
in-place form holds one) and set sums reduced over ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import filled
from .chunking import FUSED_BACKWARD_BYTES, channel_dot

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class NormSets:
    """Which values share one mean and 1/std: ``groups`` channel groups of each sample
    (GroupNorm), or each channel of dim 1 over the batch and space (BatchNorm: none given). The
    weight is on dim 1. (LayerNorm's backward is torch's kernel on its decoded input:
    ``norm.MesaLayerNormFunction``.)"""

    groups: int = 0

    @classmethod
    def channel_groups(cls, groups: int) -> NormSets:
        return cls(groups=groups)

    @classmethod
    def channels(cls) -> NormSets:
        return cls()


def fits_fused(t: torch.Tensor) -> bool:
    """Whether a BatchNorm backward on ``t``'s shape takes torch's fused kernels (two full-size
    fp32 tensors alive) rather than the in-place formula (one)."""
    return t.numel() * 4 <= FUSED_BACKWARD_BYTES


def normalization_backward(grad: torch.Tensor, x_norm: torch.Tensor, rstd: torch.Tensor,
                           weight: torch.Tensor | None, bias: torch.Tensor | None,
                           sets: NormSets, needs: tuple[bool, bool, bool],
                           set_sums: tuple[torch.Tensor, torch.Tensor, float] | None = None
                           ) -> Grads:
    """``(grad_x, grad_weight, grad_bias)`` in fp32 (each None unless ``needs`` says so and the
    parameter exists) from the fp32 output gradient, the decoded ``x_norm`` (the caller's own:
    it may be overwritten) and the exact ``rstd`` of each set (kept dims).

    ``set_sums``, per channel, ``(sum(g), sum(g * x_norm), count)`` over every rank, replace the
    local sums in the input gradient (SyncBatchNorm; only with ``NormSets.channels()``, whose
    weight and bias gradients stay local, as torch's).
    """
    needs_w = weight is not None and needs[1]
    needs_b = bias is not None and needs[2]
    w32 = None if weight is None else weight.float()
    if sets.groups:
        n, c = x_norm.shape[:2]
        grad_x, grad_w, grad_b = torch.ops.aten.native_group_norm_backward(
            grad.contiguous(), x_norm.contiguous(), filled(0.0, (n, sets.groups), rstd),
            filled(1.0, (n, sets.groups), rstd), w32, n, c,
            x_norm.numel() // max(n * c, 1), sets.groups, [needs[0], needs_w, needs_b])
        if grad_x is not None:
            grad_x.view(n, sets.groups, -1).mul_(rstd.view(n, sets.groups, 1))
        return grad_x, grad_w, grad_b
    if set_sums is None and fits_fused(grad):
        # the kernel's input gradient is scaled by its weight times its 1/std
        scale = rstd.reshape(-1) if w32 is None else rstd.reshape(-1) * w32
        return torch.ops.aten.native_batch_norm_backward(
            grad, x_norm, scale, None, None, filled(0.0, scale.shape, scale, scale.dtype),
            filled(1.0, scale.shape, scale, scale.dtype), True, 0.0, [needs[0], needs_w, needs_b])
    dims = [0] + list(range(2, grad.dim()))
    sum_dy = sum_dy_xnorm = None
    if needs_b or (needs[0] and set_sums is None):
        sum_dy = grad.sum(dims, keepdim=True)
    if needs_w or (needs[0] and set_sums is None):
        sum_dy_xnorm = channel_dot(grad, x_norm, dims)
    grad_w = sum_dy_xnorm.flatten() if needs_w else None
    grad_b = sum_dy.flatten() if needs_b else None
    grad_x = None
    if needs[0]:
        total_dy, total_dy_xnorm, count = set_sums or (sum_dy, sum_dy_xnorm,
                                                       grad.numel() / grad.shape[1])
        grad_x = channel_input_grad(grad, x_norm, rstd, w32, total_dy, total_dy_xnorm, count)
    return grad_x, grad_w, grad_b


def channel_input_grad(grad: torch.Tensor, x_norm: torch.Tensor, rstd: torch.Tensor,
                       weight: torch.Tensor | None, sum_dy: torch.Tensor,
                       sum_dy_xnorm: torch.Tensor, count: float) -> torch.Tensor:
    """The input gradient for per-channel sets, written into ``x_norm``: backward then holds no
    full-size tensor besides ``grad`` and this one (the out-of-place formula made three more, at
    the peak of a CNN head's backward). Per-channel tensors broadcast over ``x_norm``;
    the weight is constant over a set, so it leaves the two means as a factor."""
    scale = rstd if weight is None else rstd * weight.view_as(rstd)
    out = x_norm.mul_(-(sum_dy_xnorm / count)).add_(grad).sub_(sum_dy / count)
    return out.mul_(scale)
