"""Attention whose maps are never stored: backward recomputes them from 8-bit q, k and v.

``softmax(q k^T [* scale] [+ relative position bias] [+ mask]) [dropout] @ v`` as one autograd
Function. Its forward runs the very ops the attention modules run (same calls, same order, under
the same autocast), so the output is bit-identical. For backward it keeps q, k and v at 8 bits,
one group per head and channel (``H * d`` groups: attention operands have outlier channels that a
per-head range would spread over every channel of the head), the relative position bias *table*
(a Parameter: nothing extra), a mask as 1 bit per element when it holds two values (Swin's
shifted windows, Twins' padding) and the 1-bit keep mask of attention dropout. Mesa itself keeps
an 8-bit copy of every map: ``heads x N x N`` bytes per image and layer, quadratic in the tokens.

Where a replay from the 8-bit q and k would move the logits by more than the quantizers'
``refine_error`` (``MesaConfig.attention_refine_error``) on a few sampled rows (logits that
training has made large: maps sharper than at initialization), q, k and v keep a second 8-bit
pass each (``refined_heads``, ``quantizer.refine``: about 16 bits). The error is measured on
the device at every call; the host decides from the newest measurement it has received without
waiting (``host.LateReading``): the previous call's, but at the first call.

Backward recomputes each map from the decoded q and k and renormalizes it with a softmax of the
recomputed logits, by blocks of rows (``MAP_BLOCK_BYTES`` of fp32 each), so no full map exists
in backward either. Renormalizing matters: the logits' quantization error is exponentiated, and
a forward row statistic (log-sum-exp) applied to recomputed logits leaves rows that do not sum to
one, which on peaked rows costs more than the stored 8-bit map (docs/benchmarks.md, "Attention
maps").
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MesaConfig
from ..host import LateReading, reads_wait
from ..quantizer import ActivationQuantizer, Packed, Refined, refine, sample_range, unpack
from ..saved import PackedMask, load, save
from .autocast import cast, no_autocast_backward, record_input, returns_owned
from .dropout import dropout_with_mask
from .formulas import softmax_backward

# The quantizers of a module that uses the Function (``MesaModule.mesa_quantizers``): q, k and v
# viewed as (B, N, H * d), one group per head and channel.
ATTENTION_QUANTIZERS = {'quant_attn_q': (-1, 1), 'quant_attn_k': (-1, 1),
                        'quant_attn_v': (-1, 1)}
# The same for a module whose q, k and v are views of one (B, N, 3 * H * d) projection (Swin,
# BEiT): one quantizer packs that projection, with the same groups.
FUSED_QKV_QUANTIZERS = {'quant_attn_qkv': (-1, 1)}


def recomputes_maps(config: MesaConfig, mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Whether an attention converted under ``config`` uses ``MesaAttentionFunction`` for this
    call: maps not asked to be stored, attention's matmuls and softmax both compressed, a
    constant mask, a dropout rate that drops something but not everything (or none)."""
    return (config.attention_maps == 'recompute' and {'matmul', 'softmax'} <= config.layers
            and (mask is None or not mask.requires_grad) and 0.0 <= dropout_p < 1.0)


def attention_dropout(dropout: nn.Module, training: bool) -> float | None:
    """The rate of a module's attention dropout in this call (0 when it drops nothing), or
    None when it is not an ``nn.Dropout`` the Function can reproduce."""
    if not isinstance(dropout, nn.Dropout) or dropout.inplace:
        return None
    return dropout.p if training else 0.0


@dataclass
class CompactMask:
    """An additive attention mask, kept exactly: 1 bit per element when it holds at most two
    values (``low`` where the bit is clear), else the tensor itself (``NO_MASK``: none)."""

    bits: PackedMask | None
    low: torch.Tensor | None
    high: torch.Tensor | None
    full: torch.Tensor | None

    @classmethod
    def of(cls, mask: torch.Tensor) -> CompactMask:
        """A float mask as 1 bit per element where it holds two values. Finding out reads the
        device, so a device keeps the mask itself: masks that are the same for every image
        (Swin's windows: 5 MiB in all for Swin-T at 512x512) cost no more per image, and a
        mask known to hold two values (a boolean one) comes through ``two_valued``."""
        if reads_wait(mask):
            return cls(None, None, None, mask)
        low, high = mask.amin(), mask.amax()
        is_high = mask == high
        if bool((is_high | (mask == low)).all()):
            return cls(PackedMask.of(is_high), low, high, None)
        return cls(None, None, None, mask)

    @classmethod
    def two_valued(cls, is_high: torch.Tensor, low: float, high: float) -> CompactMask:
        """The mask ``where(is_high, high, low)``, from its boolean form (the two values filled
        on the device: ``torch.tensor`` would copy them from the host, which waits)."""
        device = is_high.device
        return cls(PackedMask.of(is_high), torch.full((), low, device=device),
                   torch.full((), high, device=device), None)

    def restore(self) -> torch.Tensor | None:
        if self.bits is None:
            return self.full
        return torch.where(self.bits.unpack(), self.high, self.low)


NO_MASK = CompactMask(None, None, None, None)


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """A ``(B, H, N, d)`` attention operand as the ``(B, N, H * d)`` rows ``pack_heads``
    packs (a copy unless it is laid out so already)."""
    batch, heads, tokens, dim = x.shape
    return x.detach().transpose(1, 2).reshape(batch, tokens, heads * dim)


def pack_heads(x: torch.Tensor, quantizer: ActivationQuantizer) -> Any:
    """Pack a ``(B, H, N, d)`` attention operand with one group per head and channel."""
    return quantizer.pack(head_rows(x))


def decoded_heads(packed: Any, heads: int) -> torch.Tensor:
    """The fp32 ``(B, H, N, d)`` operand ``pack_heads`` packed, as a view of its rows."""
    rows = unpack(packed, torch.float32)
    batch, tokens, channels = rows.shape
    return rows.view(batch, tokens, heads, channels // heads).transpose(1, 2)


def unpack_heads(packed: Any, heads: int) -> torch.Tensor:
    """``decoded_heads``, laid out for backward's matmuls: as decoded where its batch and head
    dims fold into one without a copy (codes of tokens-first operands, as
    ``nn.MultiheadAttention`` makes them), else contiguous (each matmul would copy it again)."""
    x = decoded_heads(packed, heads)
    return x if batched_matmul_view(x) else x.contiguous()


def batched_matmul_view(x: torch.Tensor) -> bool:
    """Whether ``torch.matmul`` reads a ``(B, H, N, d)`` operand as a batch of matrices without
    copying it: ``B`` and ``H`` fold into one strided dim, and each matrix has a unit stride."""
    batch, heads = x.shape[:2]
    folds = batch == 1 or heads == 1 or x.stride(0) == x.stride(1) * heads
    return folds and min(x.stride(2), x.stride(3)) == 1


def decoded_qkv(packed: Any, heads: int) -> torch.Tensor:
    """The fp32 ``(3, B, H, N, d)`` q, k and v of a packed ``(B, N, 3 * H * d)`` projection,
    as a view of its rows (q not multiplied by the module's scale)."""
    rows = unpack(packed, torch.float32)
    batch, tokens, channels = rows.shape
    return rows.view(batch, tokens, 3, heads, channels // (3 * heads)).permute(2, 0, 3, 1, 4)


def unpack_qkv(packed: Any, heads: int, q_scale: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``decoded_qkv``, q multiplied by ``q_scale`` as the module does; each contiguous, from
    one copy."""
    q, k, v = decoded_qkv(packed, heads).contiguous()
    return q.mul_(q_scale), k, v


# Rows of the logits (of the first image, every head) on which a replay's error is measured.
SAMPLED_ROWS = 8


def first_image(codes: Any, batch: int) -> Any:
    """The codes of the first image of a batch of ``batch`` where they slice so, else all."""
    part = (sample_range(codes, 0, 1)
            if batch > 1 and len(codes.shape) > 2 and codes.shape[0] == batch else None)
    return codes if part is None else part


def sampled_error(a_hat: torch.Tensor, b_hat: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  a_hat_scale: float = 1.0, scale: float = 1.0) -> torch.Tensor:
    """The largest difference between the replayed product ``a_hat @ b_hat`` (decoded, fp32;
    times ``a_hat_scale``) and the forward's ``a @ b`` on the first ``SAMPLED_ROWS`` rows of
    ``a``, times ``|scale|`` (0-d, on the device): the one measure of how far a replay from
    codes strays, which every caller applies to its first image alone. The factors act on the
    sampled rows only."""
    rows = slice(0, SAMPLED_ROWS)
    replayed = a_hat[..., rows, :] @ b_hat
    exact = a[..., rows, :].float() @ b.float()
    if a_hat_scale != 1.0:
        replayed.mul_(a_hat_scale)
    error = torch.linalg.vector_norm(replayed.sub_(exact), math.inf)
    return error if abs(scale) == 1.0 else error.mul_(abs(scale))


# The replay errors of the operands packed by compressors that are no ActivationQuantizer.
_READINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replay_reading(quantizer: Any, name: str = 'replay_error') -> LateReading:
    """Where the replay errors of the operands ``quantizer`` packs are received: the
    quantizer's own (``ActivationQuantizer.replay_error``, or ``map_error`` for the map a
    softmax makes of them; kept in the training state)."""
    reading = getattr(quantizer, name, None)
    if reading is None:
        reading = _READINGS.setdefault(quantizer, {}).setdefault(name, LateReading())
    return reading


def replay_error(q_hat: torch.Tensor, k_hat: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 q_hat_scale: float = 1.0, scale: float = 1.0) -> torch.Tensor:
    """``sampled_error`` of the logits ``q @ k^T`` of the first image, every head: ``(B, H, N,
    d)`` operands (decoded ones in fp32, of the first image at least; k's heads may divide q's,
    as grouped queries do)."""
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k_hat, k = (t[:1].repeat_interleave(repeats, 1) for t in (k_hat, k))
    return sampled_error(q_hat[:1], k_hat[:1].transpose(-2, -1), q[:1], k[:1].transpose(-2, -1),
                         q_hat_scale, scale)


def coarse_codes(codes: Any) -> Any:
    """The 8-bit codes of ``codes``: a ``Refined``'s first pass, any other codes as they are.

    How far a replay from 8-bit codes strays says how sharp a map is, whatever is kept: a
    quantizer that keeps refined codes by the calibration's choice (``keep_refined``) measures
    and decides as at 8 bits, so that refining never turns a map that the rules leave to torch
    (``recomputed_map.exact_map``) into one replayed from codes."""
    return codes.coarse if isinstance(codes, Refined) else codes


def heads_error(q: torch.Tensor, k: torch.Tensor, codes_q: Any, codes_k: Any, scale: float
                ) -> torch.Tensor:
    """``replay_error`` of the logits ``q @ k^T * scale`` from the 8-bit codes
    (``coarse_codes``) of q's and k's ``pack_heads`` codes."""
    batch = q.shape[0]
    return replay_error(decoded_heads(first_image(coarse_codes(codes_q), batch), q.shape[1]),
                        decoded_heads(first_image(coarse_codes(codes_k), batch), k.shape[1]),
                        q, k, scale=scale)


def refine_limit(quantizer: Any) -> float:
    """The replay error beyond which the operands a quantizer packs are refined: its spec's
    ``refine_error``; ``math.inf`` for a compressor without one (DIVISION's)."""
    return getattr(getattr(quantizer, 'spec', None), 'refine_error', math.inf)


def refine_heads(codes: Any, x: torch.Tensor) -> Any:
    """``pack_heads`` codes of ``x`` refined to about 16 bits (``quantizer.refine``)."""
    return refine(codes, head_rows(x))


class HeadCodes(NamedTuple):
    """What ``refined_heads`` keeps of q and k, and how far a replay from their 8-bit codes
    strays (how sharp the map is, whatever is kept; None where nothing could be refined, so
    nothing was measured; as received, ``replay_reading``)."""

    q: Any
    k: Any
    refined: bool
    coarse_error: float | None


def refined_heads(q: torch.Tensor, k: torch.Tensor, codes_q: Any, codes_k: Any, scale: float,
                  quantizer: Any) -> HeadCodes:
    """``pack_heads`` codes of q and k, refined to about 16 bits where a replay of the logits
    ``q @ k^T * scale`` from them strays by more than the ``refine_limit`` of ``quantizer``
    (q's: ``MesaConfig.attention_refine_error``), as last received (``replay_reading``).
    Where they are, the caller refines v's too: a map sharp enough for this passes v's rounding
    on to the gradient (DeiT-S UPerNet's above measured 0.019 and 0.036 with only q and k
    refined). Codes refined already (``ActivationQuantizer.keep_refined``) are measured by their
    8-bit pass (``coarse_codes``). Nothing is measured (no decode) where nothing could be
    refined: an infinite limit, or codes of another compressor."""
    limit = refine_limit(quantizer)
    if limit == math.inf or not (isinstance(coarse_codes(codes_q), Packed)
                                 and isinstance(coarse_codes(codes_k), Packed)):
        return HeadCodes(codes_q, codes_k, False, None)
    error = replay_reading(quantizer).update(
        lambda: heads_error(q, k, codes_q, codes_k, scale))
    if error <= limit:
        return HeadCodes(codes_q, codes_k, False, error)
    return HeadCodes(refine_heads(codes_q, q), refine_heads(codes_k, k), True, error)


def refined_qkv(qkv: torch.Tensor, codes: Any, q: torch.Tensor, k: torch.Tensor,
                q_scale: float, scale: float, quantizer: Any) -> Any:
    """The codes of a ``(B, N, 3 * H * d)`` projection, refined as ``refined_heads`` refines
    q's and k's (v with them: they are one tensor's codes)."""
    limit = refine_limit(quantizer)
    if limit == math.inf or not isinstance(codes, Packed):
        return codes

    def measure() -> torch.Tensor:
        # views: only the sampled rows are multiplied by q_scale
        q_hat, k_hat, _ = decoded_qkv(first_image(codes, q.shape[0]), q.shape[1])
        return replay_error(q_hat, k_hat, q, k, q_scale, scale)

    if replay_reading(quantizer).update(measure) <= limit:
        return codes
    return refine(codes, qkv)


def relative_bias(table: torch.Tensor, index: torch.Tensor, queries: int, keys: int
                  ) -> torch.Tensor:
    """``table[index].view(N, M, H).permute(2, 0, 1)``: Swin's and BEiT's per-head bias."""
    return table[index.view(-1)].view(queries, keys, -1).permute(2, 0, 1)


def add_mask(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scores`` (B, H, N, M) plus a mask of shape (Bb, Hb, N, M) whose batch index is
    ``b % Bb`` (Swin's windows, Twins' groups), as the modules add it."""
    batch, heads, queries, keys = scores.shape
    groups = mask.shape[0]
    return (scores.view(batch // groups, groups, heads, queries, keys)
            + mask.unsqueeze(0)).view(batch, heads, queries, keys)


# The fp32 bytes of one block of recomputed map rows. Backward holds about three such blocks at
# once (the logits turned map, the map's gradient, the logits' gradient): blocks of a whole
# ViT-S map at 512x512 made the last block's backward the peak of DeiT-S UPerNet's step, blocks
# of this size keep it below the optimizer step's (docs/benchmarks.md). Smaller blocks only add
# matmul calls.
MAP_BLOCK_BYTES = 8 << 20


def _row_blocks(batch: int, heads: int, queries: int, keys: int) -> list[tuple[slice, slice]]:
    """Blocks of (images, query rows) whose fp32 map slice stays under ``MAP_BLOCK_BYTES``."""
    per_image = heads * queries * keys * 4
    if per_image <= MAP_BLOCK_BYTES:
        step = max(1, MAP_BLOCK_BYTES // per_image)
        return [(slice(b, min(b + step, batch)), slice(None)) for b in range(0, batch, step)]
    rows = max(1, MAP_BLOCK_BYTES // (heads * keys * 4))
    return [(slice(b, b + 1), slice(r, min(r + rows, queries)))
            for b in range(batch) for r in range(0, queries, rows)]


class MesaAttentionFunction(torch.autograd.Function):
    """``(softmax(q @ k^T [* score_scale] [+ bias] [+ mask]) [dropout]) @ v``.

    Args (of ``apply``):
        q, k, v: ``(B, H, N, d)``, ``(B, H, M, d)``, ``(B, H, M, dv)`` (any strides); q as the
            module scales it before the product, if it does.
        qkv, q_scale: the ``(B, N, 3 * H * d)`` projection q, k and v are views of (q times
            ``q_scale``), or None. Given, backward keeps that projection's codes (one pack,
            no copy: it is contiguous) instead of packing q, k and v one by one.
        table, index: the relative position bias table ``(T, H)`` and its index buffer
            (``N * M`` entries), or None.
        mask: a constant additive mask ``(Bb, Hb, N, M)`` (see ``add_mask``), or None.
        score_scale: a factor the module applies to ``q @ k^T`` (Twins), or None.
        dropout_p: attention dropout in a training step (0 for none).
        need_map: also return the (dropped-out) map, as ``nn.MultiheadAttention`` does.
        quantizers: the three ``ActivationQuantizer`` of q, k and v, or with ``qkv`` the one of
            the projection.
        mask_values: ``(low, high)`` where the mask is known to hold no other values (made from
            a boolean one): kept as 1 bit per element without reading it (``CompactMask``).
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                table: torch.Tensor | None, index: torch.Tensor | None,
                mask: torch.Tensor | None, score_scale: float | None, dropout_p: float,
                need_map: bool, quantizers: tuple[ActivationQuantizer, ...],
                qkv: torch.Tensor | None = None, q_scale: float = 1.0,
                mask_values: tuple[float, float] | None = None) -> Any:
        record_input(ctx, q)
        ctx.set_materialize_grads(False)
        queries, keys = q.shape[-2], k.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1))
        if score_scale is not None:
            scores = scores * score_scale
        if table is not None:
            scores = scores + relative_bias(table, index, queries, keys).unsqueeze(0)
        if mask is not None:
            scores = add_mask(scores, mask)
        attn = F.softmax(scores, dim=-1)
        del scores
        keep = None
        if dropout_p > 0.0:
            attn, keep = dropout_with_mask(attn, dropout_p)
        out = torch.matmul(attn, v)
        ctx.meta = (q.dtype, k.dtype, v.dtype, table.dtype if table is not None else None,
                    q.shape[1], score_scale, dropout_p, queries, keys,
                    None if qkv is None else q_scale)
        scale = 1.0 if score_scale is None else score_scale
        if qkv is None:
            packed = [pack_heads(x, quant) for x, quant in zip((q, k, v), quantizers)]
            codes = refined_heads(q, k, packed[0], packed[1], scale, quantizers[0])
            if codes.refined:
                packed = [codes.q, codes.k, refine_heads(packed[2], v)]
        else:
            if qkv.shape != (q.shape[0], queries, 3 * q.shape[1] * q.shape[3]):
                raise ValueError(f'MesaAttentionFunction: qkv of shape {tuple(qkv.shape)} is '
                                 f'not the projection of q {tuple(q.shape)}')
            packed = [refined_qkv(qkv.detach(), quantizers[0].pack(qkv.detach()), q, k,
                                  q_scale, scale, quantizers[0])]
        if mask is None:
            compact = NO_MASK
        elif mask_values is not None:
            compact = CompactMask.two_valued(mask.detach() == mask_values[1], *mask_values)
        else:
            compact = CompactMask.of(mask.detach())
        save(ctx, *packed, table, index, compact.bits, compact.low, compact.high, compact.full,
             PackedMask.of(keep) if keep is not None else None)
        if not need_map:
            return out
        return out, attn

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_map: torch.Tensor | None = None
                 ) -> tuple:
        (q_dtype, k_dtype, v_dtype, table_dtype, heads, score_scale, dropout_p, queries, keys,
         q_scale) = ctx.meta
        *packed, table, index, bits, low, high, full, keep = load(ctx)
        if q_scale is None:
            q, k, v = (unpack_heads(p, heads) for p in packed)
        else:
            q, k, v = unpack_qkv(packed[0], heads, q_scale)
        grad_q, grad_k, grad_v, grad_table, _ = recompute_gradients(
            q, k, v, grad_out, ctx.needs_input_grad[:4], score_scale=score_scale, table=table,
            index=index, mask=CompactMask(bits, low, high, full).restore(),
            keep=keep.unpack() if keep is not None else None, dropout_p=dropout_p,
            grad_map=grad_map)
        return (cast(grad_q, q_dtype) if grad_q is not None else None,
                cast(grad_k, k_dtype) if grad_k is not None else None,
                cast(grad_v, v_dtype) if grad_v is not None else None,
                cast(grad_table, table_dtype) if grad_table is not None else None,
                None, None, None, None, None, None, None, None, None)


def recompute_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        grad_out: torch.Tensor | None, needs: tuple[bool, ...], *,
                        score_scale: float | None = None, table: torch.Tensor | None = None,
                        index: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                        causal: bool = False, empty_rows: bool = False,
                        keep: torch.Tensor | None = None, dropout_p: float = 0.0,
                        grad_map: torch.Tensor | None = None, need_mask: bool = False
                        ) -> tuple[torch.Tensor | None, ...]:
    """The fp32 gradients of ``(softmax(q @ k^T [* score_scale] [+ bias] [+ mask] [causal])
    [dropout]) @ v`` for q, k, v and the bias table, each map recomputed by blocks of rows
    (``_row_blocks``) from the decoded operands and renormalized by a softmax.

    Args:
        q, k, v: fp32 ``(B, H, N, d)``, ``(B, H, M, d)``, ``(B, H, M, dv)``, contiguous.
        grad_out: the output's gradient, or None (only the map's).
        needs: whether q, k, v and the table need a gradient (``ctx.needs_input_grad``).
        score_scale: a factor on ``q @ k^T``, or None.
        table, index: the relative position bias table ``(T, H)`` and its ``N * M`` indices.
        mask: an additive mask ``(Bb, Hb, Nb, Mb)``: ``Bb`` divides B (image ``b`` reads mask
            ``b % Bb``), ``Hb``, ``Nb`` and ``Mb`` are the full size or 1.
        causal: query ``i`` sees keys ``j <= i`` only (``is_causal`` of torch's SDPA).
        empty_rows: rows the mask hides entirely get a zero map, as torch's SDPA gives them,
            instead of the NaNs of a softmax of nothing.
        keep, dropout_p: the dropout keep mask of the map and its rate.
        grad_map: the map's gradient, where the map was returned.
        need_mask: whether the additive mask needs a gradient (a learned bias passed as the
            mask): the scores' gradient, summed over the mask's size-1 dimensions.

    Returns:
        ``(grad_q, grad_k, grad_v, grad_table, grad_mask)``, None where not needed;
        ``grad_mask`` in the mask's 4-d shape.
    """
    batch, heads, queries, _ = q.shape
    keys = k.shape[-2]
    need_q, need_k, need_v, need_table = needs
    blocks = _row_blocks(batch, heads, queries, keys)
    # One block (small maps): its products are the gradients. Else every block writes its
    # rows of grad_q once and adds to grad_k / grad_v, which need zeros only where an
    # image's rows span several blocks.
    whole = len(blocks) == 1
    split_rows = any(rows != slice(None) for _, rows in blocks)

    def buffer(like: torch.Tensor, needed: bool, accumulated: bool) -> torch.Tensor | None:
        if not needed or whole:
            return None
        make = torch.zeros if accumulated else torch.empty
        return make(like.shape, dtype=torch.float32, device=like.device)

    grad_q = buffer(q, need_q, False)
    grad_k = buffer(k, need_k, split_rows)
    grad_v = buffer(v, need_v and grad_out is not None, split_rows)
    grad_table = None
    if table is not None:
        index = index.view(queries, keys)
        if need_table:
            grad_table = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    grad_mask = None
    if mask is not None:
        mask = mask.float()
        if need_mask:
            grad_mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    g = cast(grad_out, torch.float32) if grad_out is not None else None
    if g is not None and whole:  # read by two matmuls, each of which would copy it
        g = g.contiguous()
    key_ids = torch.arange(keys, device=q.device) if causal else None

    def put(total: torch.Tensor | None, part: torch.Tensor, images: slice,
            rows: slice | None) -> torch.Tensor:
        """``part`` as the block's share of a gradient: the gradient itself for one block,
        else written (``rows``) or added (``rows`` None) into ``total``."""
        if whole:
            return part
        if rows is not None:
            total[images, :, rows] = part
        elif split_rows:
            total[images] += part
        else:
            total[images] = part
        return total

    for images, rows in blocks:
        q_rows = q if whole else q[images, :, rows]
        k_block = k if whole else k[images]
        scores = torch.matmul(q_rows, k_block.transpose(-2, -1))
        if score_scale is not None:
            scores.mul_(score_scale)
        if table is not None:
            scores.add_(table[index[rows]].permute(2, 0, 1).float())
        if mask is not None:
            groups, count = mask.shape[0], images.stop - images.start
            if images.start % groups == 0 and count % groups == 0:  # as add_mask: no gather
                part = mask if mask.shape[2] == 1 else mask[:, :, rows]
                scores.view(count // groups, groups, *scores.shape[1:]).add_(part.unsqueeze(0))
            else:
                ids = torch.arange(images.start, images.stop, device=mask.device) % groups
                part = mask[ids]
                scores.add_(part if part.shape[2] == 1 else part[:, :, rows])
        if key_ids is not None:
            first, last = rows.indices(queries)[:2]
            query_ids = torch.arange(first, last, device=q.device)
            scores.masked_fill_(key_ids > query_ids[:, None], float('-inf'))
        attn = torch.softmax(scores, dim=-1)
        del scores
        if empty_rows:
            attn.nan_to_num_(0.0)
        g_rows = None if g is None else (g if whole else g[images, :, rows])
        if g_rows is not None:
            grad_attn = torch.matmul(g_rows, (v if whole else v[images]).transpose(-2, -1))
        else:
            grad_attn = torch.zeros_like(attn)
        if grad_map is not None:
            grad_attn.add_(grad_map[images, :, rows].float())
        dropped = attn
        if keep is not None:
            scale = keep[images, :, rows].float().div_(1.0 - dropout_p)
            dropped = attn * scale
            grad_attn.mul_(scale)
            del scale
        if need_v and g_rows is not None:
            grad_v = put(grad_v, torch.matmul(dropped.transpose(-2, -1), g_rows), images,
                         None)
        del dropped
        grad_scores = softmax_backward(grad_attn, attn, -1)
        del attn, grad_attn
        if grad_table is not None:
            grad_table.index_add_(0, index[rows].reshape(-1),
                                  grad_scores.sum(0).permute(1, 2, 0).reshape(-1, heads))
        if grad_mask is not None:
            _add_mask_gradient(grad_mask, grad_scores, images, rows)
        if score_scale is not None:
            grad_scores.mul_(score_scale)
        if need_q:
            grad_q = put(grad_q, torch.matmul(grad_scores, k_block), images, rows)
        if need_k:
            grad_k = put(grad_k, torch.matmul(grad_scores.transpose(-2, -1), q_rows),
                         images, None)
        del grad_scores
    return grad_q, grad_k, grad_v, grad_table, grad_mask


def _add_mask_gradient(total: torch.Tensor, grad_scores: torch.Tensor, images: slice,
                       rows: slice) -> None:
    """Add one block's score gradient to the mask's: summed over the mask's size-1 heads,
    rows and keys, and over the images that read the same mask (image ``b`` reads
    ``b % total.shape[0]``)."""
    part = grad_scores
    for dim in (1, 3):
        if total.shape[dim] == 1:
            part = part.sum(dim, keepdim=True)
    if total.shape[2] == 1:
        part, target = part.sum(2, keepdim=True), total
    else:
        target = total[:, :, rows]
    ids = torch.arange(images.start or 0, (images.start or 0) + part.shape[0],
                       device=total.device) % total.shape[0]
    target.index_add_(0, ids, part)
