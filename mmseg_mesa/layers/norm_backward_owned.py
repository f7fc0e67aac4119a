"""BatchNorm's backward written into its own incoming gradient, the input decoded by chunks.

Where nothing else holds the gradient (``ownership.owned_gradients``: a ReLU's backward made it
and passed it on alone), the input gradient overwrites it, a chunk of samples at a time, and the
decoded normalized input never exists for the whole batch: backward holds one full-size tensor
instead of two (a ConvModule's BatchNorm backward is the peak of a CNN head's backward). Each
chunk is decoded three times: for the re-standardizing moments (``norm.standardize``), for the
channel sums and for the input gradient (``norm_backward.channel_input_grad``'s formula). The
sums add up chunk by chunk, so they differ from the whole-tensor ones by float rounding only.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from ..codes import Codes, sample_range
from ..quantizer import unpack
from .chunking import channel_dot, sample_slices, summed
from .norm_backward import Grads


def chunks_of(packed: Codes, shape: torch.Size) -> list[tuple[slice, Codes]] | None:
    """The codes of each chunk of samples whose fp32 decoding stays bounded; None where the
    tensor is one chunk or its codes cannot be sliced."""
    slices = sample_slices(shape, 4)
    if len(slices) < 2:
        return None
    parts = [sample_range(packed, rows.start, rows.stop) for rows in slices]
    if any(part is None for part in parts):
        return None
    return list(zip(slices, parts))


def batch_norm_backward_into(grad: torch.Tensor, packed: Codes, invstd: torch.Tensor,
                             eps: float, weight: torch.Tensor | None, bias: torch.Tensor | None,
                             needs: tuple[bool, bool, bool], target: torch.Tensor | None = None
                             ) -> Grads | None:
    """``normalization_backward`` for per-channel sets of the re-standardized codes
    (``MesaBatchNormFunction``), the input gradient written into the fp32 ``grad``; None where
    the codes are not decoded by chunks (the caller runs the whole-tensor backward).
    ``target`` is the variance each channel had (``norm.normalized_variance``), where the caller
    has it."""
    from .norm import standardize_scale
    chunks = chunks_of(packed, grad.shape)
    if chunks is None:
        return None
    dims = [0, *range(2, grad.dim())]
    count = grad.numel() // grad.shape[1]

    def decoded() -> Iterator[tuple[slice, torch.Tensor]]:
        for rows, part in chunks:
            yield rows, unpack(part, torch.float32)

    mean = summed(x.sum(dims, keepdim=True) for _, x in decoded()).div_(count)
    var = summed(channel_dot(c, c, dims) for c in (x.sub_(mean) for _, x in decoded()))
    scale = standardize_scale(var.div_(count), invstd, eps, target)

    def normalized() -> Iterator[tuple[slice, torch.Tensor]]:
        for rows, x in decoded():
            yield rows, x.sub_(mean).mul_(scale)

    needs_w = weight is not None and needs[1]
    needs_b = bias is not None and needs[2]
    sum_dy = sum_dy_xnorm = None
    if needs_b or needs[0]:
        sum_dy = grad.sum(dims, keepdim=True)
    if needs_w or needs[0]:
        sum_dy_xnorm = summed(channel_dot(grad[rows], x, dims) for rows, x in normalized())
    grad_w = sum_dy_xnorm.flatten() if needs_w else None
    grad_b = sum_dy.flatten() if needs_b else None
    if not needs[0]:
        return None, grad_w, grad_b
    factor = invstd if weight is None else invstd * weight.float().view_as(invstd)
    for rows, x in normalized():
        grad[rows] = x.mul_(-(sum_dy_xnorm / count)).add_(grad[rows]).sub_(sum_dy / count) \
            .mul_(factor)
        del x
    return grad, grad_w, grad_b
