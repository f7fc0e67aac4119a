"""The pure-PyTorch reference of the quantizer's numerics, worked through a tensor in pieces.

``levels = 2**bits - 1``; ``code = clamp(round_half_even((x - lower) / scale), 0, levels)`` in
fp32, or ``floor((x - lower) / scale + u)``, ``u ~ U[0, 1)`` for stochastic rounding (unbiased
inside the range); ``x_hat = code * scale + lower`` (a multiply, then an add: no fused
multiply-add). The CUDA kernels reproduce these numerics exactly under deterministic rounding,
and the tests hold them against this module.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .bitpack import pack_bits, unpack_bits
from .codes import Packed, QuantSpec
from .rounding import rounding_generator


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
                 spec: QuantSpec) -> torch.Tensor:
    """The documented numerics on one piece, in place on one fp32 temporary."""
    v = piece.float() - lower_c
    v.div_(scale_c)
    if spec.stochastic:
        v.add_(torch.rand(v.shape, generator=rounding_generator(v.device), device=v.device))
        v.floor_()
    else:
        v.round_()
    return v.nan_to_num_(nan=0.0).clamp_(0, (1 << spec.bits) - 1)


def quantize_reference(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                       spec: QuantSpec, group_dim: int) -> torch.Tensor:
    """Codes (uint8, shaped like x, one per element) with the documented numerics."""
    x = x.contiguous()
    dims, pieces = _pieces(x.shape, group_dim)
    lower_c, scale_c = _channel_vectors(lower, scale, dims[1], spec.group_size)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    x3, codes3 = x.view(dims), codes.view(dims)
    for outer, chans in pieces:
        codes3[outer, chans].copy_(
            _piece_codes(x3[outer, chans], lower_c[:, chans], scale_c[:, chans], spec))
    return codes


def quantize_packed_reference(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                              spec: QuantSpec, group_dim: int) -> torch.Tensor:
    """``pack_bits(quantize_reference(...), bits)`` without the full-size uint8 codes."""
    if spec.bits == 8:
        return quantize_reference(x, lower, scale, spec, group_dim)
    x = x.contiguous()
    dims, pieces = _pieces(x.shape, group_dim)
    lower_c, scale_c = _channel_vectors(lower, scale, dims[1], spec.group_size)
    per_byte = 8 // spec.bits
    data = torch.empty(-(-x.numel() // per_byte), dtype=torch.uint8, device=x.device)
    x3 = x.view(dims)
    written = 0
    carry = torch.empty(0, dtype=torch.uint8, device=x.device)  # codes short of a whole byte
    for outer, chans in pieces:
        codes = _piece_codes(x3[outer, chans], lower_c[:, chans], scale_c[:, chans], spec)
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

