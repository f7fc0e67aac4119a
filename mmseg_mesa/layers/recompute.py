"""Exact recomputation of a cheap-to-recompute, expensive-to-save tail of the graph: the loss.

mmseg upsamples the decode head's 1/4-resolution logits to the label size and takes a
cross-entropy there; autograd then keeps the full-resolution log-softmax (150 classes x H x W):
about a fifth of everything Swin-T UPerNet saves. ``RecomputedLoss`` saves only the input logits
and, in backward, runs the same loss code again with grad enabled, so the gradients are those of
the unfused path (same ops in the same order) with no quantization involved.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import returns_owned

LossFn = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def is_differentiable(name: str) -> bool:
    """mmengine sums the entries whose name contains 'loss'; the rest (acc_seg) are metrics."""
    return 'loss' in name


class RecomputedLoss(torch.autograd.Function):
    """``loss_fn(logits)`` (a dict of tensors, mmseg's convention) saving only ``logits``."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, loss_fn: LossFn, names_out: list[str],
                logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device_type = logits.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type),
                        torch.get_autocast_dtype(device_type))
        ctx.loss_fn = loss_fn
        with torch.no_grad():
            result = loss_fn(logits)
        ctx.names = list(result)
        names_out[:] = ctx.names
        ctx.mark_non_differentiable(*[v for k, v in result.items() if not is_differentiable(k)])
        ctx.save_for_backward(logits)
        return tuple(result.values())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        (logits,) = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            leaf = logits.detach().requires_grad_()
            result = ctx.loss_fn(leaf)
        pairs = [(result[name], g) for name, g in zip(ctx.names, grads)
                 if is_differentiable(name) and g is not None and result[name].requires_grad]
        if not pairs:
            return None, None, None
        (grad,) = torch.autograd.grad([o for o, _ in pairs], leaf, [g for _, g in pairs])
        return None, None, grad


def recomputed_losses(loss_fn: LossFn, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss_fn(logits)`` with only ``logits`` saved for backward."""
    names: list[str] = []
    outputs = RecomputedLoss.apply(loss_fn, names, logits)
    return dict(zip(names, outputs))
