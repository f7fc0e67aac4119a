"""Parameters a training-mode BatchNorm makes scale-free: their gradient's part along themselves.

A BatchNorm with batch statistics divides out the scale of each channel it normalizes, but for
its epsilon. So wherever the loss reaches a tensor ``y`` only through such a BatchNorm, through
ops that act on each channel alone and scale with it (ReLU, a depthwise convolution without
bias), scaling one channel of ``y`` changes the loss by a term the BatchNorm's backward knows
exactly. With ``g`` the gradient of ``y``, ``x_norm`` the normalized input of the BatchNorm,
``gamma`` its weight and ``var`` its batch variance, per channel ``c``::

    T_c = sum_c(g * y) = gamma_c * sum_c(dout * x_norm) * eps / (var_c + eps)

(the same at every tensor of the chain: ReLU and a depthwise convolution pass it on unchanged).
A layer whose output is ``y`` and whose parameters scale it is a *source*: a convolution
(``<dW_c, W_c> + b_c * sum_c(g) = T_c``) or a BatchNorm's affine part (``gamma_c * dgamma_c +
beta_c * dbeta_c = T_c``). Gradients made from 8-bit codes err along those parameters too, and
where the exact part is a small remainder of cancelling terms (a 1x1 depthwise scale branch:
RepViT, FastViT, MobileOne; a BatchNorm before ReLU and a depthwise convolution: MobileNetV3's
expansions) that error is much of the gradient. The source's backward sets the part along its
parameters to the exact value (``corrected``, ``corrected_affine``); the rest is unchanged.

The layers find each other through the hand-off ``handoff.SCALE_FREE``: a source offers a
``Link`` keyed by its output, a passing op ``carry``s it to its own output, and a BatchNorm that
normalizes that very tensor (unchanged since) claims it. Backward runs the chain the other way:
the BatchNorm leaves ``T`` and the input gradient it returned; each op acts only when the
gradient it receives *is* the one the op after it returned (a second reader of a tensor, a
residual, adds to it and makes another tensor), and a passing op leaves its own input gradient
in turn. The link refers to gradients weakly, so a layer that writes into an incoming gradient
it alone holds (``ownership``) still may.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..handoff import SCALE_FREE

__all__ = ['Link', 'carry', 'carry_back', 'claim', 'corrected', 'corrected_affine', 'leave',
           'offer', 'receives', 'settle', 'target', 'wanted']


@dataclass(eq=False)
class Link:
    """A chain from sources to the BatchNorm that normalizes their (passed-on) output."""

    version: int | None  # the version of the tensor it is offered for (None: not settled)
    claimed: bool = False
    carried: bool = False  # passed on by an op after the source (else a BatchNorm reads it)
    grad: Any = None  # weak reference to the gradient the next op back must receive
    grad_version: int = 0
    target: torch.Tensor | None = None  # per channel, exact sum_c(g * y) (fp32)


def _take(x: torch.Tensor) -> Link | None:
    link = SCALE_FREE.get(x)
    if link is None or link.claimed or link.version != x._version:
        return None
    link.claimed = True
    return link


def carry(ctx: Any, x: torch.Tensor) -> None:
    """A passing op's forward, before it runs (an in-place op changes ``x``): take up the link
    offered for ``x``, if ``x`` is still what its maker returned."""
    ctx.scale_carried = _take(x)
    if ctx.scale_carried is not None:
        ctx.scale_carried.carried = True


def offer(ctx: Any, y: torch.Tensor, source: bool, dirty: bool = False) -> None:
    """At the end of a forward whose output ``y`` has its channels on dim 1: offer the link it
    carried, or a new one where the op is a source (its parameters scale ``y``). ``dirty``:
    ``y`` is an input the forward changed in place (``ctx.mark_dirty``), whose version autograd
    may change again once the forward returns: no one can take the link before the caller of
    ``apply`` has ``settle``d it."""
    link = getattr(ctx, 'scale_carried', None)
    if link is None and source:
        link = Link(y._version)
    ctx.scale_link_out = link if source else None
    if link is not None:
        link.version, link.claimed = (None if dirty else y._version), False
        SCALE_FREE.offer(y, link)


def settle(y: torch.Tensor) -> torch.Tensor:
    """After an in-place ``Function.apply`` that offered ``y``'s link (``dirty``): the link is
    for ``y`` as autograd returned it."""
    link = SCALE_FREE.get(y)
    if link is not None and link.version is None:
        link.version = y._version
    return y


def claim(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None) -> None:
    """A training-mode BatchNorm's forward on ``x`` (channels on dim 1, batch statistics of
    this process): claim the link offered for ``x``, if ``x`` is still what its maker made."""
    ctx.scale_link = _take(x) if weight is not None else None


def wanted(ctx: Any) -> bool:
    """Whether the BatchNorm's backward should compute its weight's gradient for the link (it
    does when the weight needs it anyway)."""
    return getattr(ctx, 'scale_link', None) is not None and ctx.needs_input_grad[0]


def _pass_to(link: Link, grad: torch.Tensor | None) -> None:
    link.grad = None if grad is None else weakref.ref(grad)
    link.grad_version = 0 if grad is None else grad._version


def leave(ctx: Any, grad_x: torch.Tensor | None, grad_weight: torch.Tensor | None,
          weight: torch.Tensor, eps_share: torch.Tensor) -> None:
    """A BatchNorm's backward: leave the exact ``T`` (from its weight, its weight's gradient and
    ``eps_share = eps / (var + eps)`` per channel, fp32) and the input gradient it returns."""
    link = getattr(ctx, 'scale_link', None)
    ctx.scale_link = None
    if link is None or grad_x is None or grad_weight is None:
        return
    link.target = (weight.detach().float() * grad_weight.float()).mul_(eps_share)
    _pass_to(link, grad_x)


def _receives(link: Link | None, grad: torch.Tensor) -> bool:
    return (link is not None and link.grad is not None and link.grad() is grad
            and grad._version == link.grad_version)


def receives(ctx: Any, grad: torch.Tensor) -> bool:
    """A passing op's backward, before it touches ``grad``: whether ``grad`` is the gradient the
    op after it in the chain returned, and nothing else."""
    return _receives(getattr(ctx, 'scale_carried', None), grad)


def carry_back(ctx: Any, received: bool, grad_x: torch.Tensor | None) -> None:
    """A passing op's backward: leave the input gradient it returns for the op before it (where
    it ``received`` the chain's gradient; else break the chain)."""
    link = getattr(ctx, 'scale_carried', None)
    ctx.scale_carried = None
    if link is not None:
        _pass_to(link, grad_x if received else None)


def target(ctx: Any, grad: torch.Tensor) -> torch.Tensor | None:
    """A source's backward, before it touches ``grad``: the exact ``T`` where ``grad`` (its
    output's gradient, as received) is the chain's; else None."""
    link = getattr(ctx, 'scale_link_out', None)
    ctx.scale_link_out = None
    if not _receives(link, grad) or link.target is None:
        return None
    return link.target


def _project(d: torch.Tensor, p: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``d`` (fp32, a row per channel) with its part along ``p`` set to ``target``. A row of
    ``p`` that is all zero leaves its row of ``d`` as it is: its shift, finite for any
    target below 3e8, multiplies zeros."""
    # two row-wise dot products: a batch of matrix-vector products (bmm) over a stacked copy
    # took 7x as long on CPU for a 512x4608 convolution weight
    along, norms = torch.linalg.vecdot(p, d), torch.linalg.vecdot(p, p)
    shift = (target - along).div_(norms.clamp_min(1e-30))
    return d.addcmul_(p, shift[:, None])


def corrected(ctx: Any, grad: torch.Tensor, grad_weight: torch.Tensor | None,
              weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A convolution's weight gradient with each output channel's part along its weights set
    to ``T_c - b_c * sum_c(grad)``, where ``grad`` (the output's gradient, as received) is the
    chain's; else ``grad_weight`` as it is. (Where a BatchNorm reads the output itself,
    ``sum_c(grad)`` is zero but for rounding, which a near-zero weight would magnify.)"""
    link = getattr(ctx, 'scale_link_out', None)
    exact = target(ctx, grad)
    if exact is None or grad_weight is None:
        return grad_weight
    if bias is not None and link.carried:
        dims = [0, *range(2, grad.dim())]
        exact = exact - bias.detach().float() * grad.float().sum(dims)
    w = weight.detach().float().reshape(weight.shape[0], -1)
    d = _project(grad_weight.float().reshape(w.shape), w, exact)
    return d.reshape(grad_weight.shape).to(grad_weight.dtype)


def corrected_affine(exact: torch.Tensor | None, grad_weight: torch.Tensor | None,
                     grad_bias: torch.Tensor | None, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A BatchNorm's ``(dgamma, dbeta)`` with each channel's part along ``(gamma, beta)`` set
    to ``exact`` (``target``'s), where it is known."""
    if exact is None or grad_weight is None or (bias is not None and grad_bias is None):
        return grad_weight, grad_bias
    p = [weight.detach().float()] + ([] if bias is None else [bias.detach().float()])
    d = [grad_weight.float()] + ([] if grad_bias is None else [grad_bias.float()])
    out = _project(torch.stack(d, 1), torch.stack(p, 1), exact)
    return (out[:, 0].to(grad_weight.dtype),
            None if grad_bias is None else out[:, 1].to(grad_bias.dtype))
