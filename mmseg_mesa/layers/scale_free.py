"""Weights a training-mode BatchNorm makes scale-free: their gradient's part along themselves.

A convolution whose output only a batch-statistics BatchNorm reads cannot change the loss by
scaling one output channel's weights: the BatchNorm divides the scale out, but for its epsilon.
So each output channel's weight gradient is orthogonal to its weights up to a term the
BatchNorm's backward knows exactly. With ``y = conv(x, W) + b``, ``g`` the gradient of ``y``,
``x_norm`` the normalized ``y``, ``gamma`` the BatchNorm's weight and ``var`` its batch variance::

    <dW_c, W_c> = sum_c(g * (y - b)) = gamma_c * sum_c(dout * x_norm) * eps / (var_c + eps)

(``sum_c(g) = 0``). A weight gradient made from 8-bit inputs errs along ``W_c`` too, and where an
output channel has a single weight (a 1x1 depthwise convolution: the scale branch of RepVGG-style
blocks in RepViT, FastViT, MobileOne) that error is all the gradient there is: its cosine with
the exact one can be anything. The convolution's backward sets the part along ``W_c`` to the
exact value (``corrected``); the rest of the gradient is unchanged.

The BatchNorm tells the convolution through the hand-off ``handoff.SCALE_FREE``: the convolution
offers a ``Link`` keyed by its output, a BatchNorm that normalizes that very tensor (unchanged
since) claims it, and its backward leaves the exact part and the input gradient it returns. The
convolution's backward corrects only when the gradient it receives *is* that input gradient: a
second reader of the output (a residual, another branch) adds to it and makes another tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..handoff import SCALE_FREE

__all__ = ['Link', 'claim', 'corrected', 'leave', 'offer']


@dataclass(eq=False)
class Link:
    """Between a convolution and the BatchNorm that normalizes its output."""

    version: int  # the output's version when offered
    claimed: bool = False
    grad: torch.Tensor | None = None  # the BatchNorm's input gradient, as it returned it
    grad_version: int = 0
    along_weight: torch.Tensor | None = None  # per output channel, exact <dW_c, W_c> (fp32)


def offer(ctx: Any, y: torch.Tensor) -> None:
    """A convolution's forward (output channels on dim 1): let a BatchNorm of ``y`` claim it,
    where the convolution's weight needs a gradient."""
    ctx.scale_link = Link(y._version) if ctx.needs_input_grad[1] else None
    if ctx.scale_link is not None:
        SCALE_FREE.offer(y, ctx.scale_link)


def claim(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None) -> None:
    """A training-mode BatchNorm's forward on ``x`` (channels on dim 1, batch statistics of
    this process): claim the link its maker offered, if ``x`` is still what it made."""
    link = SCALE_FREE.get(x)
    ctx.scale_link = None
    if link is None or link.claimed or link.version != x._version or weight is None:
        return
    link.claimed = True
    ctx.scale_link = link


def wanted(ctx: Any) -> bool:
    """Whether the BatchNorm's backward should compute its weight's gradient for the link (it
    does when the weight needs it anyway)."""
    return getattr(ctx, 'scale_link', None) is not None and ctx.needs_input_grad[0]


def leave(ctx: Any, grad_x: torch.Tensor | None, grad_weight: torch.Tensor | None,
          weight: torch.Tensor, invstd: torch.Tensor, eps: float) -> None:
    """A BatchNorm's backward: leave the exact ``<dW_c, W_c>`` (from its weight, its weight's
    gradient and its 1/std) and the input gradient it returns for the convolution."""
    link = getattr(ctx, 'scale_link', None)
    ctx.scale_link = None
    if link is None or grad_x is None or grad_weight is None:
        return
    rstd = invstd.reshape(-1).float()
    link.along_weight = weight.detach().float() * grad_weight.float() * (eps * rstd * rstd)
    link.grad, link.grad_version = grad_x, grad_x._version


def corrected(ctx: Any, grad: torch.Tensor, grad_weight: torch.Tensor | None,
              weight: torch.Tensor) -> torch.Tensor | None:
    """A convolution's weight gradient with each output channel's part along its weights set to
    what the BatchNorm left, where ``grad`` (the output's gradient, as received) is the
    BatchNorm's input gradient and nothing else; else ``grad_weight`` as it is."""
    link = getattr(ctx, 'scale_link', None)
    if link is None:
        return grad_weight
    ctx.scale_link = None
    left, along = link.grad, link.along_weight
    link.grad = link.along_weight = None
    if (grad_weight is None or left is None or grad is not left
            or grad._version != link.grad_version):
        return grad_weight
    w = weight.detach().float().reshape(weight.shape[0], -1)
    d = grad_weight.float().reshape(w.shape)
    norms = (w * w).sum(1)
    shift = torch.where(norms > 0, (along - (d * w).sum(1)) / norms.clamp_min(1e-30), 0.0)
    return d.add_(w * shift[:, None]).reshape(grad_weight.shape).to(grad_weight.dtype)
