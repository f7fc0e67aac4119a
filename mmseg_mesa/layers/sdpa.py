"""``F.scaled_dot_product_attention`` keeping 8-bit q, k and v for backward.

timm's and mmpretrain's attention modules call torch's fused attention (SDPA) in their own
forward. Its autograd node keeps q, k and v at their own precision (16 or 32 bits) and, for the
fused kernels, the output and the log-sum-exp of every row as well.

``MesaSDPAFunction``'s forward calls ``F.scaled_dot_product_attention`` itself, with the
caller's arguments and with grad mode on as the caller had it (torch picks its kernel partly by
whether the inputs need gradients), so the output is torch's to the bit whichever kernel torch
picks, and under autocast as torch casts. For backward it keeps q, k and v as 8-bit codes, one
group per head and channel (``attention_core.pack_heads``: attention operands have outlier
channels a per-head range would spread over every channel of the head; refined to about 16 bits
where 8-bit q and k would replay the logits too loosely, ``attention_core.refined_heads``), a
Parameter operand as
it is, a mask at 1 bit per element when it holds two values (a boolean mask, an additive
``0 / -inf`` one; broadcast dimensions are kept at size 1), any other mask as it is, and nothing
for ``is_causal``. Backward recomputes each map from the decoded operands by blocks of rows and
renormalizes it with a softmax of the recomputed logits (``attention_core.recompute_gradients``,
shared with ``MesaAttentionFunction``): no map exists in full in backward either. Rows a mask
hides entirely get a zero map and zero gradients, as torch's SDPA gives them. Keys and values of
fewer heads (``enable_gqa``) are repeated for the recomputation and their gradients summed back.

``config.attention_maps`` does not apply: torch's SDPA keeps no map, so there is none to store.

Left to torch's own node (``left_to_torch`` gives the reason, ``MesaFunctional`` counts them in
``mesa_left_to_torch``):

- ``dropout_p > 0``: SDPA draws its dropout mask inside the kernel and returns neither the mask
  nor the generator state it used, so backward could not apply the same mask;
- a mask that requires grad and is an expanded view (stride 0 where its size is above 1): its
  gradient would be one map per copy (a learned bias of broadcast shape is taken: its gradient
  is the scores' gradient summed over the broadcast dimensions);
- operands that are not ``(B, H, N, d)`` tensors of one batch size, or nested tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..host import reads_wait
from ..quantizer import ActivationQuantizer
from ..saved import load, save
from .attention_core import (
    CompactMask,
    pack_heads,
    recompute_gradients,
    refine_heads,
    refined_heads,
    unpack_heads,
)
from .autocast import cast, no_autocast_backward, record_input, returns_owned

# What a TorchFunctionMode sees for ``F.scaled_dot_product_attention``: the builtin itself.
SDPA_FUNCTIONS = frozenset({F.scaled_dot_product_attention,
                            torch._C._nn.scaled_dot_product_attention})

# The roles of the quantizers of one call: q, k and v viewed as (B, N, H * d), one group per head
# and channel (as ``attention_core.ATTENTION_QUANTIZERS``).
SDPA_ROLES = {'q': (-1, 1), 'k': (-1, 1), 'v': (-1, 1)}

_ARGUMENTS = ('query', 'key', 'value', 'attn_mask', 'dropout_p', 'is_causal', 'scale',
              'enable_gqa')


@dataclass(frozen=True)
class SDPACall:
    """The arguments of one ``F.scaled_dot_product_attention`` call, by name."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @classmethod
    def bind(cls, args: tuple, kwargs: dict) -> SDPACall | None:
        """The call's arguments, or None where they are not SDPA's (torch will say why)."""
        if len(args) > len(_ARGUMENTS) or set(kwargs) - set(_ARGUMENTS[len(args):]):
            return None
        call = cls(**dict(zip(_ARGUMENTS, args)), **kwargs)
        if not all(isinstance(t, torch.Tensor) for t in call.operands()):
            return None
        return call

    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query, self.key, self.value

    def needs_grad(self) -> bool:
        return any(t.requires_grad for t in self.operands())


def left_to_torch(call: SDPACall) -> str | None:
    """Why ``MesaSDPAFunction`` does not take this call (torch's node does), or None."""
    if call.dropout_p > 0.0:
        return ('dropout_p > 0: SDPA returns neither its dropout mask nor the generator state, '
                'so backward cannot reproduce the mask')
    mask = call.attn_mask
    if mask is not None and mask.requires_grad and any(
            stride == 0 and size > 1 for stride, size in zip(mask.stride(), mask.shape)):
        return ('attn_mask requires grad and is an expanded view: its gradient would be one '
                'map per expanded copy')
    operands = call.operands()
    if any(t.is_nested for t in operands):
        return 'nested tensors'
    if any(t.dim() < 4 for t in operands) or len({t.shape[0] for t in operands}) != 1:
        return 'q, k and v are not (B, H, N, d) of one batch size'
    if any(t.dim() > 4 for t in operands) and (
            len({t.shape[:-2] for t in operands}) != 1 or mask is not None or call.enable_gqa):
        return ('q, k and v with several head dimensions differ in them, or come with a mask '
                'or grouped heads')
    if mask is not None and mask.dim() > 4:
        return 'attn_mask has more than 4 dimensions'
    return None


def compact_mask(mask: torch.Tensor) -> CompactMask:
    """``mask`` as backward keeps it: 4-d (``(Bb, Hb, Nb, Mb)``, each the full size or 1, the
    size of any broadcast (stride 0) dimension 1), boolean masks as their additive form."""
    mask = mask.detach()[(None,) * (4 - mask.dim())]
    for dim in range(4):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    if mask.dtype == torch.bool:  # True: attends (0), False: hidden (-inf)
        return CompactMask.two_valued(mask, float('-inf'), 0.0)
    return CompactMask.of(mask)


def _drop(_: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError('MesaSDPAFunction: the forward graph of torch SDPA is not for backward')


def torch_sdpa(call: SDPACall) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``call`` with grad mode on, keeping nothing.

    Inside an autograd Function's forward grad mode is off, and torch picks SDPA's kernel partly
    by whether the inputs need gradients (on CUDA: flash attention with head dims above 192 on
    sm86 / sm89 only without them); so the call runs as the caller's would, and its node's saves
    are dropped (the node dies with the graph, which nothing else refers to).
    """
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never):
        out = F.scaled_dot_product_attention(
            call.query, call.key, call.value, attn_mask=call.attn_mask, dropout_p=call.dropout_p,
            is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa)
    return out.detach()


class MesaSDPAFunction(torch.autograd.Function):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)``.

    Args (of ``apply``):
        q, k, v: ``(B, H, N, d)``, ``(B, Hkv, M, d)``, ``(B, Hkv, M, dv)``; ``Hkv`` divides
            ``H`` with ``enable_gqa``, else equals it. Several head dimensions of one shape
            (``(B, H, W, N, d)``) are taken as one, without mask or grouped heads.
        mask: a boolean or additive mask broadcastable to ``(B, H, N, M)``, or None. An
            additive one may need a gradient (a learned position bias: timm's TinyViT, MaxViT,
            CoAtNet): the scores' gradient, summed over its broadcast dimensions.
        is_causal, scale, enable_gqa: as torch's.
        quantizers: an ``ActivationQuantizer`` for each of q, k and v, or None to keep that
            operand as it is (a Parameter: kept anyway).
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                enable_gqa: bool, quantizers: tuple[ActivationQuantizer | None, ...]
                ) -> torch.Tensor:
        record_input(ctx, q)
        ctx.set_materialize_grads(False)
        out = torch_sdpa(SDPACall(q, k, v, mask, 0.0, is_causal, scale, enable_gqa))
        # several head dimensions (Hiera's (B, heads, windows, N, d)) are one for backward
        ctx.shapes = tuple(x.shape for x in (q, k, v))
        q, k, v = (x.flatten(1, -3) for x in (q, k, v))
        ctx.meta = (q.dtype, k.dtype, v.dtype, q.shape[1], k.shape[1], is_causal,
                    scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        ctx.kept = tuple(quant is None for quant in quantizers)
        ctx.mask_shape = mask.shape if mask is not None else None
        ctx.mask_dtype = mask.dtype if mask is not None else None
        saved = [x.detach() if quant is None else pack_heads(x, quant)
                 for x, quant in zip((q, k, v), quantizers)]
        if not (ctx.kept[0] or ctx.kept[1]):
            codes = refined_heads(q, k, saved[0], saved[1], ctx.meta[-1], quantizers[0])
            if codes.refined:
                saved[:2] = codes.q, codes.k
                if not ctx.kept[2]:
                    saved[2] = refine_heads(saved[2], v)
        compact = compact_mask(mask) if mask is not None else CompactMask(None, None, None, None)
        save(ctx, *saved, compact.bits, compact.low, compact.high, compact.full)
        return out

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad_out: torch.Tensor | None) -> tuple:
        if grad_out is None:
            return (None,) * 8
        q_dtype, k_dtype, v_dtype, heads, kv_heads, is_causal, score_scale = ctx.meta
        *saved, bits, low, high, full = load(ctx)
        q, k, v = (cast(x, torch.float32).contiguous() if kept else unpack_heads(x, h)
                   for x, kept, h in zip(saved, ctx.kept, (heads, kv_heads, kv_heads)))
        repeats = heads // kv_heads
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
        mask = CompactMask(bits, low, high, full).restore()
        # rows the mask hides entirely: on a device assumed (asking would wait), which costs a
        # pass that changes no row that is not empty
        empty_rows = mask is not None and (
            reads_wait(mask) or bool((mask == float('-inf')).all(-1).any()))
        grad_q, grad_k, grad_v, _, grad_mask = recompute_gradients(
            q, k, v, grad_out.flatten(1, -3), (*ctx.needs_input_grad[:3], False),
            score_scale=score_scale, mask=mask, causal=is_causal, empty_rows=empty_rows,
            need_mask=ctx.needs_input_grad[3])
        if grad_mask is not None:
            grad_mask = cast(grad_mask.reshape(ctx.mask_shape), ctx.mask_dtype)

        if repeats > 1:
            grad_k, grad_v = (None if g is None else g.unflatten(1, (kv_heads, repeats)).sum(2)
                              for g in (grad_k, grad_v))
        grad_q, grad_k, grad_v = (None if g is None else g.reshape(shape)
                                  for g, shape in zip((grad_q, grad_k, grad_v), ctx.shapes))
        return (cast(grad_q, q_dtype) if grad_q is not None else None,
                cast(grad_k, k_dtype) if grad_k is not None else None,
                cast(grad_v, v_dtype) if grad_v is not None else None,
                grad_mask, None, None, None, None)


def mesa_sdpa(call: SDPACall, quantizers: tuple[ActivationQuantizer | None, ...]
              ) -> torch.Tensor:
    """``call`` through ``MesaSDPAFunction``; ``left_to_torch(call)`` must be None."""
    return MesaSDPAFunction.apply(*call.operands(), call.attn_mask, call.is_causal, call.scale,
                                  call.enable_gqa, quantizers)


def packs(t: torch.Tensor) -> bool:
    """Whether an operand is packed: an activation, not a Parameter (which is kept anyway)."""
    return not isinstance(t, nn.Parameter)
