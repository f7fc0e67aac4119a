"""``torch.einsum`` of two operands, each saved in ``bits`` bits (K-Net's mask-weighted sums)."""
from __future__ import annotations

from typing import Any

import torch

from ..quantizer import ActivationQuantizer
from ..reuse import packed_reusing
from ..saved import save
from .autocast import no_autocast_backward, record_input, returns_owned
from .formulas import operand_gradients


def gradient_equations(equation: str) -> tuple[str, str] | None:
    """The einsum equations of the two operands' gradients, ``(out,b->a, out,a->b)``.

    None for what the two einsums cannot express: no explicit output, an ellipsis, an index
    repeated within one term (a diagonal), or an index of one operand found nowhere else (summed
    out of that operand alone, so its gradient would need a broadcast).
    """
    equation = equation.replace(' ', '')
    if '->' not in equation or '.' in equation:
        return None
    inputs, out = equation.split('->')
    terms = inputs.split(',')
    if len(terms) != 2:
        return None
    a, b = terms
    if not all(t.isalpha() and len(set(t)) == len(t) for t in (a, b, out)):
        return None
    if not (set(a) <= set(b) | set(out) and set(b) <= set(a) | set(out)
            and set(out) <= set(a) | set(b)):
        return None
    return f'{out},{b}->{a}', f'{out},{a}->{b}'


class MesaEinsumFunction(torch.autograd.Function):
    """``torch.einsum(equation, a, b)`` as torch runs it (under the ambient autocast, so the
    forward is bit-identical), saving each operand for the other's gradient: packed by its
    quantizer, or as it is where that is None."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, equation: str, a: torch.Tensor, b: torch.Tensor,
                quant_a: ActivationQuantizer | None, quant_b: ActivationQuantizer | None
                ) -> torch.Tensor:
        record_input(ctx, a)
        ctx.equations = gradient_equations(equation)
        ctx.dtypes = (a.dtype, b.dtype)
        y = torch.einsum(equation, a, b)
        saved = []
        for t, quantizer, needed in ((a, quant_a, ctx.needs_input_grad[2]),
                                     (b, quant_b, ctx.needs_input_grad[1])):
            saved.append(None if not needed else t if quantizer is None else
                         packed_reusing(t, t, quantizer))
        save(ctx, *saved)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (grad_out_b_to_a, grad_out_a_to_b), (dtype_a, dtype_b) = ctx.equations, ctx.dtypes
        return (None, *operand_gradients(
            ctx, grad, 1, lambda g, b: torch.einsum(grad_out_b_to_a, g, b).to(dtype_a),
            lambda g, a: torch.einsum(grad_out_a_to_b, g, a).to(dtype_b)), None, None)
