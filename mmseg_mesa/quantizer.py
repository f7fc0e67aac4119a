"""The one activation quantizer every Mesa layer uses.

``ActivationQuantizer.pack(x) -> Packed`` and ``unpack(packed) -> x``. Channels along
``group_dim`` are split into groups of ``group_size`` consecutive channels (the last group may be
shorter); each group gets an offset (``lower``) and a ``scale`` derived from running estimates of
its min and range: the first observed training batch is taken as it is, later batches are blended
in with an EMA, as in Mesa. Unlike Mesa, a batch whose values fall outside the running range is
quantized over the running range widened to cover it, instead of being clipped (see
``ema_update``).

Numerics (the CUDA kernels reproduce them exactly under deterministic rounding):
``levels = 2**bits - 1``, ``scale = span / levels`` (1 where ``span == 0``),
``code = clamp(round_half_even((x - lower) / scale), 0, levels)`` in fp32, or
``floor((x - lower) / scale + u)``, ``u ~ U[0, 1)`` for stochastic rounding (unbiased inside the
range),
and ``x_hat = code * scale + lower`` (a multiply, then an add: no fused multiply-add).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from . import _backend
from .bitpack import pack_bits, unpack_bits
from .rounding import reset_rounding_generators, rounding_generator

__all__ = ['ActivationQuantizer', 'Mapped', 'Packed', 'QuantSpec', 'pack',
           'packed_reusing', 'reset_rounding_generators', 'rounding_generator', 'sample_range',
           'unpack']


@dataclass(frozen=True)
class QuantSpec:
    """Static description of one saved activation.

    Args:
        bits: Code width (2, 4 or 8).
        group_dim: Dimension whose channels are grouped (negative counts from the end).
        group_size: Consecutive channels per group; 1 means one group per channel/head.
        stochastic: Stochastic (unbiased) rounding instead of round-to-nearest-even.
        ema_decay: Weight of the previous running estimate.
        backend: ``'auto'``, ``'cuda'`` or ``'torch'`` (see ``MesaConfig``).
    """

    bits: int = 8
    group_dim: int = -1
    group_size: int = 32
    stochastic: bool = True
    ema_decay: float = 0.9
    backend: str = 'auto'

    def num_groups(self, channels: int) -> int:
        return (channels + self.group_size - 1) // self.group_size


@dataclass
class Packed:
    """A quantized activation: codes plus the per-group affine that decodes them."""

    data: torch.Tensor  # uint8; bit-packed and flat when bits < 8, else shaped like the input
    lower: torch.Tensor  # (G,) fp32
    scale: torch.Tensor  # (G,) fp32
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_dim: int  # non-negative
    group_size: int
    backend: str = 'auto'

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.lower, self.scale

    def meta(self) -> tuple:
        return self.shape, self.dtype, self.bits, self.group_dim, self.group_size, self.backend

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Packed:
        return cls(*tensors, *meta)


@dataclass
class Mapped:
    """The codes of ``x`` standing for ``fn(x)``, an element-wise function of it.

    A GELU saves its input's codes for its own backward; the next Linear needs the GELU's output,
    which is ``gelu`` of that input. Saving it as the same codes (``attach_codes``) costs no
    memory; ``restore`` decodes and applies ``fn`` in fp32.
    """

    source: Packed
    fn: Callable[[torch.Tensor], torch.Tensor]  # element-wise, fp32 in and out
    dtype: torch.dtype  # of the tensor it stands for

    # The fields attached_codes checks are the source's.
    shape = property(lambda self: self.source.shape)
    bits = property(lambda self: self.source.bits)
    group_dim = property(lambda self: self.source.group_dim)
    group_size = property(lambda self: self.source.group_size)
    backend = property(lambda self: self.source.backend)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.source.tensors()

    def sample_range(self, start: int, stop: int) -> Mapped | None:
        source = sample_range(self.source, start, stop)
        return None if source is None else replace(self, source=source)

    def meta(self) -> tuple:
        return self.source.meta(), self.fn, self.dtype

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Mapped:
        source_meta, fn, dtype = meta
        return cls(Packed.rebuild(tensors, source_meta), fn, dtype)

    def restore(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.fn(unpack(self.source, torch.float32)).to(dtype or self.dtype)


def channel_view(per_group: torch.Tensor, channels: int, group_size: int, group_dim: int,
                 ndim: int) -> torch.Tensor:
    """Expand a (G,) per-group vector to per-channel values shaped to broadcast along group_dim."""
    per_channel = per_group.repeat_interleave(group_size)[:channels]
    shape = [1] * ndim
    shape[group_dim] = channels
    return per_channel.view(shape)


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
    running range are never clipped (Mesa clips them; on Swin-T / DeiT-S UPerNet that cost up to
    0.2 of gradient cosine in the layers with few values per channel).
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


def scale_from_span(span: torch.Tensor, bits: int) -> torch.Tensor:
    levels = (1 << bits) - 1
    return torch.where(span > 0, span / levels, torch.ones_like(span))


# The torch path works through the tensor in pieces of at most this fraction of its elements
# (and at least PIECE_MIN_ELEMENTS), so its fp32 temporaries (the shifted values, the noise, the
# codes before bit packing) stay a small fixed fraction of the activation being packed instead of
# several copies of it. Pieces are consecutive ranges of the flat (row-major) tensor in order, so
# the codes, the bit layout and the stochastic noise stream (one torch.rand draw per piece, in the
# same flat order as one draw for the whole tensor) are what a single pass would produce.
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


def pack(x: torch.Tensor, spec: QuantSpec, lower: torch.Tensor, span: torch.Tensor) -> Packed:
    """Quantize ``x`` with the given per-group ``lower``/``span`` (no state is touched)."""
    group_dim = spec.group_dim % x.dim()
    scale = scale_from_span(span, spec.bits)
    x = x.contiguous()
    kernel = _backend.kernels_for(x, spec.backend)
    if kernel is not None:
        codes = kernel.quantize(x, lower, scale, spec.bits, group_dim, spec.group_size,
                                spec.stochastic)
        data = codes if spec.bits == 8 else pack_bits(codes, spec.bits)
    else:
        data = quantize_packed_reference(x, lower, scale, spec, group_dim)
    return Packed(data, lower, scale, x.shape, x.dtype, spec.bits, group_dim,
                  spec.group_size, spec.backend)


def unpack(packed: Packed | Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize to the shape that was packed (contiguous), in ``dtype`` or the packed dtype.

    Backward formulas that compute in fp32 ask for fp32 directly, so a bf16 activation is not
    rounded to bf16 once more on the way back. Other compressors' results (``DivisionPacked``)
    decode themselves through their ``restore``, so layers call this one function.
    """
    if not isinstance(packed, Packed):
        return packed.restore(dtype)
    kernel = _backend.kernels_for(packed.data, packed.backend)
    if kernel is None:
        return dequantize_packed_reference(packed, dtype)
    numel = packed.shape.numel()
    codes = packed.data if packed.bits == 8 else unpack_bits(packed.data, packed.bits, numel)
    return kernel.dequantize(codes.view(packed.shape), packed.lower, packed.scale,
                             packed.group_dim, packed.group_size, dtype or packed.dtype)


def sample_range(packed: Packed | Any, start: int, stop: int) -> Any:
    """The codes of ``x[start:stop]`` (along dim 0) as codes of their own (``Packed``, ``Mapped``),
    sharing its storage, so a backward can decode a large input a few samples at a time.

    None where the samples are no whole-byte range of the data: another compressor's result,
    groups along dim 0, or sub-byte codes whose samples end inside a byte.
    """
    if hasattr(type(packed), 'sample_range'):  # codes built on Packed (Mapped, FusedCodes)
        return packed.sample_range(start, stop)
    if not isinstance(packed, Packed) or packed.group_dim == 0 or len(packed.shape) < 2:
        return None
    per_sample = packed.shape[1:].numel()
    if packed.bits == 8:
        data = packed.data.view(packed.shape)[start:stop]
    elif per_sample * packed.bits % 8 == 0:
        row_bytes = per_sample * packed.bits // 8
        data = packed.data[start * row_bytes:stop * row_bytes]
    else:
        return None
    return replace(packed, data=data, shape=torch.Size((stop - start, *packed.shape[1:])))


def attach_codes(x: torch.Tensor, packed: Packed | Mapped) -> None:
    """Offer ``packed`` (codes that decode to ``x``) to the next layer that saves ``x``.

    An attention map is saved by its softmax and again by ``attn @ v``; a GELU's input is saved by
    the GELU, and its output by the next Linear. With the codes attached to the tensor, one copy
    serves both (``attached_codes``).
    """
    x._mesa_codes = (packed, x._version)  # type: ignore[attr-defined]


def attached_codes(x: torch.Tensor, spec: QuantSpec,
                   dtype: torch.dtype | None = None) -> Packed | Mapped | None:
    """The codes ``attach_codes`` left on ``x`` when they are what ``spec`` would store (same
    bits, groups and backend) and ``x`` has not been modified in place since; else None.

    ``dtype`` is what they decode to (the layer's compute dtype; ``x``'s by default).
    """
    found = getattr(x, '_mesa_codes', None)
    if found is None:
        return None
    packed, version = found
    same = (version == x._version and packed.shape == x.shape and packed.bits == spec.bits
            and packed.group_dim == spec.group_dim % x.dim()
            and packed.group_size == spec.group_size and packed.backend == spec.backend)
    if not same:
        return None
    return packed if dtype in (None, packed.dtype) else replace(packed, dtype=dtype)


def packed_reusing(x: torch.Tensor, cast: torch.Tensor, quantizer: Any) -> Any:
    """What a layer saves of its input ``x``: the codes another layer attached to ``x`` when
    ``quantizer`` is an ``ActivationQuantizer`` that would store the same, decoding to ``cast``'s
    dtype; else ``cast`` (``x`` as the layer's op sees it) packed by ``quantizer``."""
    if isinstance(quantizer, ActivationQuantizer):
        found = attached_codes(x, quantizer.spec, cast.dtype)
        if found is not None:
            return found
    return quantizer.pack(cast)


class ActivationQuantizer(nn.Module):
    """Holds one saved activation's spec and running estimates.

    The estimates are non-persistent buffers: they move with ``.to()`` but never reach the
    optimizer or the state dict, so converted checkpoints keep the original keys. They are sized
    lazily from the first batch and resized in place, so references taken by wrappers stay valid.
    """

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer('lower', torch.zeros(0), persistent=False)
        self.register_buffer('span', torch.zeros(0), persistent=False)
        self.register_buffer('seen', torch.zeros(0, dtype=torch.bool), persistent=False)

    def extra_repr(self) -> str:
        s = self.spec
        return (f'bits={s.bits}, group_dim={s.group_dim}, group_size={s.group_size}, '
                f'stochastic={s.stochastic}, ema_decay={s.ema_decay}')

    def _ensure_groups(self, groups: int, device: torch.device) -> None:
        if self.lower.numel() == groups and self.lower.device == device:
            return
        for name in ('lower', 'span', 'seen'):
            buf = getattr(self, name)
            if buf.device != device:
                buf = buf.to(device)
                setattr(self, name, buf)
            buf.resize_(groups).zero_()

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        """Update the running estimates with one batch; return this batch's ``(2, G)`` range."""
        group_dim = self.spec.group_dim % x.dim()
        groups = self.spec.num_groups(x.shape[group_dim])
        self._ensure_groups(groups, x.device)
        kernel = _backend.kernels_for(x, self.spec.backend)
        with torch.no_grad():
            if kernel is not None:
                return kernel.observe(x.contiguous(), self.lower, self.span, self.seen,
                                      group_dim, self.spec.group_size, self.spec.ema_decay)
            lo, hi = group_min_max(x.detach(), group_dim, self.spec.group_size)
            return ema_update(self.lower, self.span, self.seen, lo, hi, self.spec.ema_decay)

    def pack(self, x: torch.Tensor) -> Packed:
        """Observe ``x`` (training step) and quantize it over the resulting range."""
        cover = self.observe(x)
        with torch.no_grad():
            # lower gets its own storage: the saved Packed should not pin the span row too
            return pack(x.detach(), self.spec, cover[0].clone(), cover[1])

    def pack_standardized(self, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                          ) -> Packed:
        """``pack((x - mean) * rstd)`` for one ``mean`` and ``rstd > 0`` per group, without
        building that full-size fp32 tensor.

        A per-group affine map commutes with per-group quantization: the range of the
        normalized values is ``x``'s range mapped through it, and ``x`` quantized over that
        range mapped back gives the normalized values' codes. BatchNorm saves its normalized
        input this way; the full-size temporary was the largest tensor at its forward peak.
        """
        group_dim = self.spec.group_dim % x.dim()
        groups = self.spec.num_groups(x.shape[group_dim])
        if self.spec.group_size != 1 or mean.numel() != groups or rstd.numel() != groups:
            raise ValueError(
                f'pack_standardized needs one group per channel of dim {group_dim} and one '
                f'mean and rstd per group; got group_size={self.spec.group_size}, {groups} '
                f'groups, {mean.numel()} means, {rstd.numel()} rstds')
        self._ensure_groups(groups, x.device)
        with torch.no_grad():
            mean, rstd = mean.reshape(-1).float(), rstd.reshape(-1).float()
            lo, hi = group_min_max(x.detach(), group_dim, 1)
            cover = ema_update(self.lower, self.span, self.seen, (lo - mean) * rstd,
                               (hi - mean) * rstd, self.spec.ema_decay)
            lower, span = cover[0].clone(), cover[1]
            packed = pack(x.detach(), self.spec, mean + lower / rstd, span / rstd)
            return replace(packed, lower=lower, scale=scale_from_span(
                span, self.spec.bits), dtype=torch.float32)
