"""``F.grid_sample`` saving its input packed (the sampled feature map) and its grid as it is.

Deformable attention (mmcv's ``multi_scale_deformable_attn_pytorch``, Mask2Former's pixel
decoder on CPU) and PointRend's ``point_sample`` call it on whole feature maps. Its input
gradient is linear in the output gradient and reads only the grid, so it stays exact; the grid's
gradient reads the input values, which backward decodes from their codes. The grid is kept
exactly: a sampling position off by an 8-bit step of its range would move every bilinear
weight.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..quantizer import ActivationQuantizer, unpack
from ..saved import load, save
from .autocast import cast, no_autocast_backward, record_input, returns_owned


class MesaGridSampleFunction(torch.autograd.Function):
    """``F.grid_sample(x, grid, mode, padding_mode, align_corners)`` with ``x`` packed."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, grid: torch.Tensor, mode: str, padding_mode: str,
                align_corners: bool | None, quantizer: ActivationQuantizer) -> torch.Tensor:
        record_input(ctx, x)
        ctx.options = (mode, padding_mode, align_corners)
        ctx.grid_dtype = grid.dtype
        ctx.input_shape = x.shape
        y = F.grid_sample(x, grid, mode, padding_mode, align_corners)
        # the input's gradient reads only the grid; the grid's reads the input's values
        save(ctx, quantizer.pack(x) if ctx.needs_input_grad[1] else None, grid)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, grid = load(ctx)
        need_x, need_grid = ctx.needs_input_grad[:2]
        # torch's backward kernel on the decoded input: recomputing the op under autograd gives
        # exactly its gradients (public ops only), in fp32 as autocast runs grid_sample
        x = unpack(packed, torch.float32) if packed is not None else torch.zeros(
            ctx.input_shape, dtype=torch.float32, device=grad.device)
        with torch.enable_grad():
            x = x.detach().requires_grad_(need_x)
            g = cast(grid.detach(), torch.float32).requires_grad_(need_grid)
            y = F.grid_sample(x, g, *ctx.options)
            wanted = [t for t, need in ((x, need_x), (g, need_grid)) if need]
            grads = iter(torch.autograd.grad(y, wanted, cast(grad, y.dtype)))
        grad_x = cast(next(grads), ctx.input_dtype) if need_x else None
        grad_grid = cast(next(grads), ctx.grid_dtype) if need_grid else None
        return grad_x, grad_grid, None, None, None, None
