"""The pure-PyTorch reference of the quantizer's numerics, worked through a tensor in pieces.

``levels = 2**bits - 1``; ``code = clamp(round_half_even((x - lower) / scale), 0, levels)`` in
fp32, or ``floor((x - lower) / scale + u)``, ``u ~ U[0, 1)`` for stochastic rounding (unbiased
inside the range); NaN gives code 0; ``x_hat = code * scale + lower`` (a multiply, then an add:
no fused multiply-add). The compiled CPU and CUDA kernels (``csrc/mesa_numerics.h``) reproduce
these numerics bit for bit under both roundings, and the tests hold them against this module.

The uniforms ``u`` come from Philox4x32-10 (Salmon et al., SC11; Random123's constants and
round function), a counter-based generator. A call is keyed by a 64-bit ``seed`` and starts at a
64-bit counter ``offset`` (``rounding.rounding_counter`` hands both out and advances the offset
by the call's ``ceil(numel / 4)`` blocks). Element ``i`` (its flat, row-major index) takes word
``i & 3`` of the block whose 128-bit counter is ``(lo32(c), hi32(c), 0, 0)`` with
``c = (offset + (i >> 2)) mod 2**64``, under the key ``(lo32(seed), hi32(seed))``; then
``u = (word >> 8) * 2**-24`` in fp32 (24 random bits, exact). Being a function of the index, the
draws do not depend on how a tensor is split into pieces here or into threads in a kernel.

``Reference`` puts these numerics, the running estimates (``group_min_max`` + ``ema_update``) and
``bitpack``'s masks behind ``_backend.QuantBackend``, the signature the compiled kernels share.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from . import bitpack
from .bitpack import pack_bits, unpack_bits
from .codes import Packed, QuantSpec
from .constants import filled
from .rounding import rounding_counter

# Philox4x32-10's multipliers and Weyl key increments.
PHILOX_M0, PHILOX_M1 = 0xD251_1F53, 0xCD9E_8D57
PHILOX_W0, PHILOX_W1 = 0x9E37_79B9, 0xBB67_AE85
_LOW32 = 0xFFFF_FFFF


def _mul_hi_lo(multiplier: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``multiplier * word`` for int64 tensors holding uint32 values.

    The full product can reach 2**64 and overflow int64, so ``word`` is split into 16-bit limbs:
    each partial product stays below 2**48.
    """
    low = (word & 0xFFFF) * multiplier
    high = (word >> 16) * multiplier
    partial = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (partial >> 32), partial & _LOW32


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[int, int]
                  ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the four counter words (int64 tensors of uint32 values, broadcastable)
    under the two key words; returns the four output words the same way."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for step in range(10):
        if step:
            k0, k1 = (k0 + PHILOX_W0) & _LOW32, (k1 + PHILOX_W1) & _LOW32
        hi0, lo0 = _mul_hi_lo(PHILOX_M0, c0)
        hi1, lo1 = _mul_hi_lo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


# Blocks computed at once: the int64 temporaries of the ten rounds stay under a megabyte.
PHILOX_BLOCKS_AT_ONCE = 1 << 12


def rounding_uniforms(seed: int, offset: int, start: int, count: int,
                      device: torch.device | str) -> torch.Tensor:
    """The fp32 uniforms of elements ``start .. start + count - 1`` of a call keyed by ``seed``
    at counter ``offset`` (see the module docstring)."""
    first, last = start >> 2, (start + count + 3) >> 2
    base = offset & ((1 << 64) - 1)
    base = base - (1 << 64) if base >= 1 << 63 else base  # the same 64 bits as an int64
    key = (seed & _LOW32, (seed >> 32) & _LOW32)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    uniforms = torch.empty(last - first, 4, dtype=torch.float32, device=device)
    for at in range(first, last, PHILOX_BLOCKS_AT_ONCE):
        stop = min(at + PHILOX_BLOCKS_AT_ONCE, last)
        counters = torch.arange(at, stop, dtype=torch.int64, device=device)
        counters += base  # wraps modulo 2**64, as the kernels' uint64 does
        words = philox4x32_10((counters & _LOW32, (counters >> 32) & _LOW32, zero, zero), key)
        for k, word in enumerate(words):
            uniforms[at - first:stop - first, k] = (word >> 8).to(torch.float32)
    return uniforms.view(-1)[start - 4 * first:start - 4 * first + count].mul_(2.0 ** -24)


def scale_from_span(span: torch.Tensor, bits: int) -> torch.Tensor:
    """The quantization step of each group: ``span / (2**bits - 1)``, or 1 where the span is
    not positive (a constant or empty group) or NaN."""
    levels = (1 << bits) - 1
    return torch.where(span > 0, span / levels, 1.0)


def group_min_max(x: torch.Tensor, group_dim: int, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max over finite values, fp32, shape (G,); +inf/-inf for empty groups."""
    dims = [d for d in range(x.dim()) if d != group_dim]
    lo = x.amin(dim=dims) if dims else x
    hi = x.amax(dim=dims) if dims else x
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        finite = torch.isfinite(x)
        lo = torch.where(finite, x, float('inf')).amin(dim=dims) if dims else lo
        hi = torch.where(finite, x, float('-inf')).amax(dim=dims) if dims else hi
        lo = torch.where(torch.isfinite(lo), lo, float('inf'))
        hi = torch.where(torch.isfinite(hi), hi, float('-inf'))
    channels = x.shape[group_dim]
    groups = (channels + group_size - 1) // group_size
    pad = groups * group_size - channels
    lo = nn.functional.pad(lo.float(), (0, pad), value=float('inf')).view(groups, group_size)
    hi = nn.functional.pad(hi.float(), (0, pad), value=float('-inf')).view(groups, group_size)
    return lo.amin(dim=1), hi.amax(dim=1)


def ema_update(lower: torch.Tensor, span: torch.Tensor, seen: torch.Tensor, lo: torch.Tensor,
               hi: torch.Tensor, decay: float) -> torch.Tensor:
    """In-place running-estimate update; returns the range to quantize this batch with.

    Groups without finite values keep their estimate. The returned ``(2, G)`` tensor holds
    ``lower`` and ``span`` of the running range widened to cover this batch: values outside the
    running range are never clipped (Mesa clips them; on Swin-T / DeiT-S UPerNet that costs up
    to 0.2 of gradient cosine in the layers with few values per channel).
    """
    valid = torch.isfinite(lo) & torch.isfinite(hi)
    batch_span = hi - lo
    blended_lower = torch.where(seen, decay * lower + (1.0 - decay) * lo, lo)
    blended_span = torch.where(seen, decay * span + (1.0 - decay) * batch_span, batch_span)
    lower.copy_(torch.where(valid, blended_lower, lower))
    span.copy_(torch.where(valid, blended_span, span))
    seen.logical_or_(valid)
    upper = lower + span
    cover_lower = torch.where(valid, torch.minimum(lower, lo), lower)
    cover_span = torch.where(valid, torch.maximum(upper, hi) - cover_lower, span)
    return torch.stack([cover_lower, cover_span])


def channel_view(per_group: torch.Tensor, channels: int, group_size: int, group_dim: int,
                 ndim: int) -> torch.Tensor:
    """Expand a (G,) per-group vector to per-channel values shaped to broadcast along group_dim."""
    per_channel = per_group.repeat_interleave(group_size)[:channels]
    shape = [1] * ndim
    shape[group_dim] = channels
    return per_channel.view(shape)


# The torch path works through the tensor in pieces of at most this fraction of its elements
# (and at least PIECE_MIN_ELEMENTS), so its fp32 temporaries (the shifted values, the noise, the
# codes before bit packing) stay a small fixed fraction of the activation being packed instead of
# several copies of it. Pieces are consecutive ranges of the flat (row-major) tensor in order, so
# the codes, the bit layout and the stochastic noise stream (one torch.rand draw per piece, in the
# same flat order as one draw for the whole tensor) are what a single pass would produce. Measured
# in docs/benchmarks.md ("Quantizer pieces").
PIECE_FRACTION = 64
PIECE_MIN_ELEMENTS = 1 << 17


def _pieces(shape: torch.Size, group_dim: int) -> tuple[tuple[int, int, int], list[tuple]]:
    """Split a contiguous tensor viewed as ``(outer, channels, inner)`` into consecutive pieces.

    Returns the 3-d view's shape and ``(outer_slice, channel_slice)`` pairs whose elements are
    consecutive flat ranges, in order.
    """
    outer = 1
    for size in shape[:group_dim]:
        outer *= size
    channels = shape[group_dim]
    inner = 1
    for size in shape[group_dim + 1:]:
        inner *= size
    numel = outer * channels * inner
    limit = max(-(-numel // PIECE_FRACTION), PIECE_MIN_ELEMENTS)
    row = channels * inner
    pieces: list[tuple] = []
    if row <= limit:
        step = max(1, limit // max(row, 1))
        pieces = [(slice(o, min(o + step, outer)), slice(None)) for o in range(0, outer, step)]
    else:
        step = max(1, limit // max(inner, 1))
        pieces = [(slice(o, o + 1), slice(c, min(c + step, channels)))
                  for o in range(outer) for c in range(0, channels, step)]
    return (outer, channels, inner), pieces


def _channel_vectors(lower: torch.Tensor, scale: torch.Tensor, channels: int,
                     group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel lower and scale shaped ``(1, channels, 1)`` for the 3-d view."""
    return (channel_view(lower, channels, group_size, 1, 3),
            channel_view(scale, channels, group_size, 1, 3))


def _piece_codes(piece: torch.Tensor, lower_c: torch.Tensor, scale_c: torch.Tensor,
                 spec: QuantSpec, counter: tuple[int, int] | None, start: int) -> torch.Tensor:
    """The documented numerics on one piece (flat elements from ``start``), in place on one
    fp32 temporary."""
    v = piece.float() - lower_c
    v.div_(scale_c)
    if spec.stochastic:
        seed, offset = counter
        v.add_(rounding_uniforms(seed, offset, start, v.numel(), v.device).view(v.shape))
        v.floor_()
    else:
        v.round_()
    return v.nan_to_num_(nan=0.0).clamp_(0, (1 << spec.bits) - 1)


def _call_counter(x: torch.Tensor, spec: QuantSpec, counter: tuple[int, int] | None
                  ) -> tuple[int, int] | None:
    """The stream position of one quantize call: ``counter`` if given, else the next one of
    ``x``'s device (stochastic rounding only)."""
    if not spec.stochastic or counter is not None:
        return counter
    return rounding_counter(x.device, x.numel())


def quantize_reference(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                       spec: QuantSpec, group_dim: int,
                       counter: tuple[int, int] | None = None) -> torch.Tensor:
    """Codes (uint8, shaped like x, one per element) with the documented numerics.

    Stochastic rounding draws at ``counter`` (``(seed, offset)``), by default the next position
    of the device's stream (``rounding.rounding_counter``).
    """
    x = x.contiguous()
    counter = _call_counter(x, spec, counter)
    dims, pieces = _pieces(x.shape, group_dim)
    lower_c, scale_c = _channel_vectors(lower, scale, dims[1], spec.group_size)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    x3, codes3 = x.view(dims), codes.view(dims)
    start = 0
    for outer, chans in pieces:
        target = codes3[outer, chans]
        target.copy_(_piece_codes(x3[outer, chans], lower_c[:, chans], scale_c[:, chans], spec,
                                  counter, start))
        start += target.numel()
    return codes


def quantize_packed_reference(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                              spec: QuantSpec, group_dim: int,
                              counter: tuple[int, int] | None = None) -> torch.Tensor:
    """``pack_bits(quantize_reference(...), bits)`` without the full-size uint8 codes."""
    if spec.bits == 8:
        return quantize_reference(x, lower, scale, spec, group_dim, counter)
    x = x.contiguous()
    counter = _call_counter(x, spec, counter)
    dims, pieces = _pieces(x.shape, group_dim)
    lower_c, scale_c = _channel_vectors(lower, scale, dims[1], spec.group_size)
    per_byte = 8 // spec.bits
    data = torch.empty(-(-x.numel() // per_byte), dtype=torch.uint8, device=x.device)
    x3 = x.view(dims)
    written = 0
    carry = torch.empty(0, dtype=torch.uint8, device=x.device)  # codes short of a whole byte
    start = 0
    for outer, chans in pieces:
        codes = _piece_codes(x3[outer, chans], lower_c[:, chans], scale_c[:, chans], spec,
                             counter, start)
        start += codes.numel()
        codes = torch.cat([carry, codes.to(torch.uint8).reshape(-1)])
        whole = codes.numel() - codes.numel() % per_byte
        packed = pack_bits(codes[:whole], spec.bits)
        data[written:written + packed.numel()] = packed
        written += packed.numel()
        carry = codes[whole:]
    if carry.numel():
        data[written:] = pack_bits(carry, spec.bits)
    return data


def _dequantize_pieces(packed: Packed, dtype: torch.dtype,
                       codes_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``codes * scale + lower`` (two roundings) piece by piece into one output tensor.

    ``codes_of(start, stop)`` gives the codes of that flat element range.
    """
    dims, pieces = _pieces(packed.shape, packed.group_dim)
    lower_c, scale_c = _channel_vectors(packed.lower, packed.scale, dims[1], packed.group_size)
    out = torch.empty(packed.shape, dtype=dtype, device=packed.data.device)
    out3 = out.view(dims)
    start = 0
    for outer, chans in pieces:
        target = out3[outer, chans]
        stop = start + target.numel()
        codes = codes_of(start, stop).view(target.shape)
        if dtype == torch.float32:
            values = target.copy_(codes)
        else:
            values = codes.float()
        values.mul_(scale_c[:, chans]).add_(lower_c[:, chans])
        if values is not target:
            target.copy_(values)
        start = stop
    return out


def dequantize_reference(codes: torch.Tensor, packed: Packed,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    flat = codes.reshape(-1)
    return _dequantize_pieces(packed, dtype or packed.dtype, lambda a, b: flat[a:b])


def dequantize_packed_reference(packed: Packed, dtype: torch.dtype | None = None
                                ) -> torch.Tensor:
    """``dequantize_reference`` straight from bit-packed data, unpacking one piece at a time."""
    if packed.bits == 8:
        return dequantize_reference(packed.data, packed, dtype)
    per_byte = 8 // packed.bits

    def codes_of(start: int, stop: int) -> torch.Tensor:
        first, last = start // per_byte, -(-stop // per_byte)
        codes = unpack_bits(packed.data[first:last], packed.bits, (last - first) * per_byte)
        offset = start - first * per_byte
        return codes[offset:offset + stop - start]

    return _dequantize_pieces(packed, dtype or packed.dtype, codes_of)


def fine_grid(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower and step of refined codes' second pass over coarse codes of step ``scale``:
    a step of ``scale / 127`` and a lower of ``-(127 * step)``, rounded as a decode rounds that
    product, so that code 127 decodes to exactly 0."""
    step = scale / 127.0
    return -(step * 127.0), step


def refine_reference(x: torch.Tensor, codes: torch.Tensor, lower: torch.Tensor,
                     scale: torch.Tensor, group_dim: int, group_size: int,
                     mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fine codes of ``x``'s 8-bit ``codes`` (one per element; with ``mean`` and ``rstd``,
    one per group, the codes of ``(x - mean) * rstd``) and the lower and scale that decode
    them: what the codes miss, rounded to nearest over one coarse step either way of each group
    (a step of ``scale / 127`` from ``-127`` steps: code 127 decodes to 0 exactly, so a constant
    group, whose codes miss nothing, gets nothing added)."""
    v = x.float()
    if mean is not None:
        ndim = x.dim()
        channels = x.shape[group_dim]
        v = (v - channel_view(mean, channels, group_size, group_dim, ndim)) * channel_view(
            rstd, channels, group_size, group_dim, ndim)
    coarse = Packed(codes, lower, scale, x.shape, torch.float32, 8, group_dim, group_size)
    residual = v - dequantize_reference(codes, coarse, torch.float32)
    fine_lower, fine_scale = fine_grid(scale)
    spec = QuantSpec(bits=8, group_dim=group_dim, group_size=group_size, stochastic=False)
    return (quantize_reference(residual, fine_lower, fine_scale, spec, group_dim), fine_lower,
            fine_scale)


def dequantize_refined_reference(codes: torch.Tensor, fine: torch.Tensor, lower: torch.Tensor,
                                 scale: torch.Tensor, fine_lower: torch.Tensor,
                                 fine_scale: torch.Tensor, group_dim: int, group_size: int,
                                 dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """Both 8-bit codes of ``shape`` decoded in fp32 and added, in ``dtype``."""
    def decoded(data: torch.Tensor, lo: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
        packed = Packed(data, lo, sc, shape, torch.float32, 8, group_dim, group_size)
        return dequantize_reference(data, packed, torch.float32)

    return decoded(codes, lower, scale).add_(decoded(fine, fine_lower, fine_scale)).to(dtype)


def norm_terms_reference(rstd: torch.Tensor, decoded_invstd: torch.Tensor,
                         weight: torch.Tensor | None, eps: float, reliable: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchNorm's per-channel backward terms (``layers.norm.channel_backward``): the share
    ``eps * rstd**2`` eps takes of the variance, the spread the normalized input had
    (``sqrt(1 - share)`` where that is at least ``reliable``, else the decoded input's own
    ``1 / decoded_invstd``), and the fused backward's weight ``rstd * weight / spread``."""
    eps_share = torch.addcmul(torch.zeros((), device=rstd.device), rstd, rstd, value=eps)
    target = 1.0 - eps_share
    # correctly rounded, as the kernels' (fp64 then fp32 rounds a square root exactly); torch's
    # fp32 sqrt errs by an ulp in some CPU builds
    root = target.double().sqrt().float()
    spread = torch.where(target >= reliable, root, decoded_invstd.reciprocal())
    return eps_share, spread, (rstd if weight is None else rstd * weight) / spread


def observe_then_quantize(observe: Callable[..., torch.Tensor],
                          quantize: Callable[..., torch.Tensor], x: torch.Tensor,
                          lower: torch.Tensor, span: torch.Tensor, seen: torch.Tensor,
                          group_dim: int, group_size: int, decay: float, bits: int,
                          stochastic: bool, pack: bool = False,
                          counter: tuple[int, int] | None = None,
                          mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                          rows: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``observe_quantize`` of a backend as its ``observe`` and ``quantize`` in turn: ``(codes,
    lower, scale)``, the codes and the per-group affine that decodes them.

    With ``rows``, ``mean`` and ``rstd`` hold one value per row of the ``(rows, channels *
    inner)`` view around ``group_dim`` (fp32), and the codes are those of the fp32 tensor
    ``(x - mean) * rstd`` (each operation rounded once), observed and quantized as any tensor.

    With ``mean`` and ``rstd`` (fp32, one per group, ``rstd > 0``) the range is observed in
    ``(x - mean) * rstd`` and ``x`` is quantized over that range mapped back: a per-group affine
    map commutes with per-group quantization, so these are the codes of the standardized tensor
    without building it. That range comes from ``group_min_max`` of ``x`` mapped through the
    affine (no kernel but the fused CPU one observes standardized values).
    """
    if rows:
        if mean is None or rstd is None:
            raise ValueError('observe_quantize: rows=True needs a mean and an rstd per row')
        row_len = math.prod(x.shape[group_dim % x.dim():]) if x.dim() else 1
        count = x.numel() // row_len if row_len else 0
        if mean.numel() != count or rstd.numel() != count:
            raise ValueError(f'observe_quantize: rows=True needs one mean and rstd per row '
                             f'({count}), got {mean.numel()} and {rstd.numel()}')
        row_view = x.reshape(count, row_len).float()
        x = ((row_view - mean.view(-1, 1)) * rstd.view(-1, 1)).view(x.shape)
        mean = rstd = None
    if mean is None and rstd is None:
        cover = observe(x, lower, span, seen, group_dim, group_size, decay)
        # lower gets its own storage: the saved codes should not pin the span row too
        used_lower = cover[0].clone()
        scale = scale_from_span(cover[1], bits)
        codes = quantize(x, used_lower, scale, bits, group_dim, group_size, stochastic, counter,
                         pack)
        return codes, used_lower, scale
    if mean is None or rstd is None:
        raise ValueError('observe_quantize: mean and rstd are given together')
    lo, hi = group_min_max(x, group_dim, group_size)
    cover = ema_update(lower, span, seen, (lo - mean) * rstd, (hi - mean) * rstd, decay)
    used_lower, used_span = cover[0].clone(), cover[1]
    codes = quantize(x, mean + used_lower / rstd, scale_from_span(used_span / rstd, bits), bits,
                     group_dim, group_size, stochastic, counter, pack)
    return codes, used_lower, scale_from_span(used_span, bits)


class Reference:
    """The pure-PyTorch backend: every device torch runs and every floating dtype, with the
    numerics documented above (the compiled kernels' results are held to these bit for bit).

    Slower than the kernels: the quantizer's small ops each cost a call, and the full-size work
    is done piece by piece to bound its temporaries. ``_backend.select_backend`` picks it for
    ``backend='torch'``, and for ``'auto'`` where no kernel runs the tensor.
    """

    name = 'torch'
    SUPPORTED_DEVICES = None  # every device

    @staticmethod
    def not_supported_reasons(device: torch.device) -> list[str]:
        return []

    @staticmethod
    def observe(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor, seen: torch.Tensor,
                group_dim: int, group_size: int, decay: float) -> torch.Tensor:
        lo, hi = group_min_max(x, group_dim, group_size)
        return ema_update(lower, span, seen, lo, hi, decay)

    @staticmethod
    def quantize(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, bits: int,
                 group_dim: int, group_size: int, stochastic: bool,
                 counter: tuple[int, int] | None = None, pack: bool = False) -> torch.Tensor:
        spec = QuantSpec(bits=bits, group_dim=group_dim, group_size=group_size,
                         stochastic=stochastic)
        if pack:
            return quantize_packed_reference(x, lower, scale, spec, group_dim, counter)
        return quantize_reference(x, lower, scale, spec, group_dim, counter)

    @staticmethod
    def dequantize(codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                   group_dim: int, group_size: int, dtype: torch.dtype, bits: int = 8,
                   shape: torch.Size | None = None, divisor: torch.Tensor | None = None
                   ) -> torch.Tensor:
        if shape is None:
            if bits != 8:
                raise ValueError('dequantize: bit-packed codes need the shape they were packed '
                                 'from')
            shape = codes.shape
        packed = Packed(codes, lower, scale, shape, dtype, bits, group_dim, group_size)
        if divisor is None:
            return dequantize_packed_reference(packed, dtype)
        values = dequantize_packed_reference(packed, torch.float32)
        return values.view(divisor.numel(), -1).div_(divisor.view(-1, 1)).view(shape).to(dtype)

    def observe_quantize(self, x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor,
                         seen: torch.Tensor, group_dim: int, group_size: int, decay: float,
                         bits: int, stochastic: bool, pack: bool = False,
                         counter: tuple[int, int] | None = None,
                         mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                         rows: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return observe_then_quantize(self.observe, self.quantize, x, lower, span, seen,
                                     group_dim, group_size, decay, bits, stochastic, pack,
                                     counter, mean, rstd, rows)

    refine = staticmethod(refine_reference)
    dequantize_refined = staticmethod(dequantize_refined_reference)
    norm_terms = staticmethod(norm_terms_reference)
    pack_mask = staticmethod(bitpack.pack_mask)
    unpack_mask = staticmethod(bitpack.unpack_mask)

    @staticmethod
    def pack_positive(x: torch.Tensor) -> torch.Tensor:
        return bitpack.pack_mask(x > 0)

    @staticmethod
    def mask_select(values: torch.Tensor, data: torch.Tensor, shape: torch.Size
                    ) -> torch.Tensor:
        return torch.where(bitpack.unpack_mask(data, shape), values, 0)

    @staticmethod
    def mask_select_(values: torch.Tensor, data: torch.Tensor,
                     shape: torch.Size | None = None) -> torch.Tensor:
        """``mask_select`` into ``values``; ``data`` packed bits of ``shape``, or the bool
        mask itself (``shape`` None)."""
        mask = data if shape is None else bitpack.unpack_mask(data, shape)
        return torch.where(mask, values, filled(0.0, (), values, values.dtype), out=values)


REFERENCE = Reference()
