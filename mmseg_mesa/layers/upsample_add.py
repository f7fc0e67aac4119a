"""An FPN's top-down step, ``fine + upsample(coarse)``, written into ``fine`` a block at a time.

FPN heads add each coarser level, upsampled, to the next finer one. Out of place that holds three
full-resolution tensors at once (the finer level, the upsampled coarser one and their sum); on
Swin-T UPerNet 512x512 the last step alone is 64 MiB per image, and at batch 8 it was the step's
peak, above the fused bottleneck's (docs/benchmarks.md). ``UpsampleAddFunction`` adds into the
finer level's storage where nothing else reads it (``ownership.sole_reference``), upsampling one
block of samples at a time (``chunking.sample_slices``): the same element-wise sum of the same
upsampled values, so the result is bit-identical. Nothing is saved: the sum's gradient passes to
the finer level as it is, and to the coarser one through the upsampling's own backward, a block
at a time.
"""
from __future__ import annotations

from typing import Any

import torch

from .autocast import returns_owned
from .chunking import sample_slices
from .level_fusion import Upsample, upsample_backward
from .ownership import sole_reference


class UpsampleAddFunction(torch.autograd.Function):
    """``fine.add_(upsample(coarse))``, one block of samples at a time; returns ``fine``."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, fine: torch.Tensor, coarse: torch.Tensor, upsample: Upsample
                ) -> torch.Tensor:
        ctx.upsample, ctx.coarse_shape, ctx.coarse_dtype = upsample, coarse.shape, coarse.dtype
        for rows in sample_slices(fine.shape, fine.element_size()):
            fine[rows].add_(upsample(coarse[rows]))
        ctx.mark_dirty(fine)
        return fine

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_coarse = None
        if ctx.needs_input_grad[1]:
            blocks = sample_slices(grad.shape, grad.element_size())
            if len(blocks) == 1:
                grad_coarse = upsample_backward(ctx.upsample, grad, ctx.coarse_shape,
                                                ctx.coarse_dtype)
                return grad, grad_coarse, None
            grad_coarse = torch.empty(ctx.coarse_shape, dtype=ctx.coarse_dtype,
                                      device=grad.device)
            for rows in blocks:
                grad_coarse[rows] = upsample_backward(ctx.upsample, grad[rows],
                                                      grad_coarse[rows].shape, ctx.coarse_dtype)
        return grad, grad_coarse, None


def upsample_add(levels: list[torch.Tensor], index: int, coarse: torch.Tensor,
                 upsample: Upsample) -> torch.Tensor:
    """``levels[index] + upsample(coarse)``, computed in ``levels[index]``'s storage (and
    ``levels[index]`` cleared) where only ``levels`` holds it and the in-place sum is the
    out-of-place one bit for bit: same shape, contiguous layouts, and the upsampled values already
    in the finer level's dtype (an upsampling keeps its input's, but autocast may change it: there
    one channel of one sample is tried). Out of place otherwise."""
    fine = levels[index]
    in_place = (fine.shape[:2] == coarse.shape[:2] and fine.device == coarse.device
                and fine.is_contiguous() and coarse.is_contiguous() and coarse.numel() > 0
                and not torch.is_inference_mode_enabled()
                and (coarse.dtype if not torch.is_autocast_enabled(coarse.device.type)
                     else upsample(coarse[:1, :1]).dtype) == fine.dtype)
    del fine
    if not in_place or not sole_reference(levels, index):
        return levels[index] + upsample(coarse)
    fine, levels[index] = levels[index], None
    return UpsampleAddFunction.apply(fine, coarse, upsample)
