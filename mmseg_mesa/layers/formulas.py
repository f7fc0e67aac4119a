"""Backward formulas several layers share: products of two operands and the weighted layers
(Linear, Conv, ConvTranspose), whose backward reads their input only for the weight gradient."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..codes import Codes
from ..quantizer import unpack
from ..reuse import packed_reusing
from ..saved import load, save
from .autocast import autocast_inputs, autocast_off, cast
from .chunking import FUSED_BACKWARD_BYTES, rows_of, summed_over_samples
from .scale_free import corrected


def restore(saved: torch.Tensor | Codes, dtype: torch.dtype) -> torch.Tensor:
    """What a backward reads of a saved operand: a tensor kept as it is, or decoded codes."""
    return cast(saved, dtype) if isinstance(saved, torch.Tensor) else unpack(saved, dtype)


def operand_gradients(ctx: Any, grad: torch.Tensor, first: int,
                      grad_a: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      grad_b: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of a two-operand product whose operands are the forward's arguments
    ``first`` and ``first + 1`` and whose forward saved ``save(ctx, saved_a, saved_b)``:
    ``grad_a(grad, b)`` where ``a`` needs a gradient, ``grad_b(grad, a)`` where ``b`` does, each
    operand restored in ``grad``'s dtype."""
    saved_a, saved_b = load(ctx)
    need_a, need_b = ctx.needs_input_grad[first:first + 2]
    return (grad_a(grad, restore(saved_b, grad.dtype)) if need_a else None,
            grad_b(grad, restore(saved_a, grad.dtype)) if need_b else None)


def sum_to(grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Reduce a broadcast gradient to the shape and dtype of the input it belongs to."""
    if grad.shape != shape:
        grad = grad.sum_to_size(shape)
    return cast(grad, dtype)


def weighted_forward(ctx: Any, op: Callable[..., torch.Tensor], x: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None, quantizer: Any
                     ) -> torch.Tensor:
    """``op(x, weight, bias)`` as autocast would run it, saving the packed input and the weight.

    The forward of every layer whose backward reads its input only for the weight gradient
    (Linear, Conv2d, ConvTranspose2d; ``weighted_backward`` is their backward): the input is
    packed only when the weight needs a gradient.
    """
    xc, wc, bc = autocast_inputs(ctx, x, weight, bias)
    with autocast_off(ctx.device_type):
        y = op(xc, wc, bc)
    save(ctx, packed_reusing(x, xc, quantizer) if ctx.needs_input_grad[1] else None, weight)
    return y


def weighted_backward(ctx: Any, grad: torch.Tensor,
                      input_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      weight_grad: Callable[[torch.Tensor, torch.Tensor, torch.Size], torch.Tensor],
                      bias_grad: Callable[[torch.Tensor], torch.Tensor],
                      joint: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]],
                                      tuple] | None = None) -> tuple:
    """The backward of ``weighted_forward``, given the layer's three gradient formulas.

    ``input_grad(grad, weight)``, ``weight_grad(x, grad, weight_shape)`` (a sum over samples:
    ``x`` is decoded a few samples at a time when it is large, ``summed_over_samples``) and
    ``bias_grad(grad)`` get the gradient and the weight in the compute dtype. The weight gradient
    comes first, so the decoded input is freed before the input gradient (as large) is made.
    ``joint(x, grad, weight, [input, weight, bias wanted])``, where given, computes all three in
    one call (a convolution's backward kernel shares its work between them); it runs instead
    when the decoded input is at most ``FUSED_BACKWARD_BYTES``, small enough for it and the
    input gradient to be alive together.
    Returns one gradient per forward argument (None past the first three).
    """
    packed, weight = load(ctx)
    bias = getattr(ctx, 'scale_bias', None)  # a convolution's, for its scale_free correction
    received = grad
    grad = cast(grad, ctx.compute_dtype)
    w = cast(weight, ctx.compute_dtype)
    needs = ctx.needs_input_grad
    if (joint is not None and needs[1]
            and packed.shape.numel() * 4 <= FUSED_BACKWARD_BYTES):
        grad_x, grad_w, grad_b = joint(unpack(packed, grad.dtype), grad, w,
                                       [needs[0], True, needs[2]])
        return (None if grad_x is None else cast(grad_x, ctx.input_dtype),
                corrected(ctx, received, cast(grad_w, weight.dtype), weight, bias),
                None if grad_b is None else cast(grad_b, weight.dtype),
                *[None] * (len(needs) - 3))
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[1]:
        grad_w = corrected(ctx, received, cast(summed_over_samples(
            packed, lambda x, rows: weight_grad(x, rows_of(grad, rows), w.shape)), weight.dtype),
            weight, bias)
    if ctx.needs_input_grad[0]:
        grad_x = cast(input_grad(grad, w), ctx.input_dtype)
    if ctx.needs_input_grad[2]:
        grad_b = cast(bias_grad(grad), weight.dtype)
    return (grad_x, grad_w, grad_b, *[None] * (len(ctx.needs_input_grad) - 3))


def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """The input gradient of ``y = softmax(x, dim)``, ``y * (grad - sum(grad * y, dim))``, in
    ``y``'s dtype: torch's own softmax backward kernel, one fused pass with no full-size
    temporary besides its result (every Mesa softmax and recomputed attention map use it)."""
    return torch._softmax_backward_data(grad.to(y.dtype), y, dim, y.dtype)
