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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _backend
from .bitpack import pack_bits, unpack_bits


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


_ROUNDING_GENERATORS: dict[torch.device, tuple[int, torch.Generator]] = {}


def rounding_generator(device: torch.device) -> torch.Generator:
    """The generator for stochastic rounding on ``device``.

    It is separate from the default generator so that compressing activations never shifts the
    model's own random stream (dropout, drop path): the forward stays bit-identical. It is seeded
    from the default generator's seed when first used and whenever that seed changes, so a run
    that starts with ``torch.manual_seed`` (as mmengine does) is reproducible. Re-seeding with the
    same seed inside one process does not restart it; ``reset_rounding_generators`` does.
    """
    device = torch.device(device)
    seed = torch.cuda.initial_seed() if device.type == 'cuda' else torch.initial_seed()
    cached = _ROUNDING_GENERATORS.get(device)
    if cached is None or cached[0] != seed:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed ^ 0x5EED_3E5A)
        cached = (seed, generator)
        _ROUNDING_GENERATORS[device] = cached
    return cached[1]


def reset_rounding_generators() -> None:
    """Restart stochastic rounding streams at the next use (from the current torch seed)."""
    _ROUNDING_GENERATORS.clear()


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


def quantize_reference(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                       spec: QuantSpec, group_dim: int) -> torch.Tensor:
    """Codes (uint8, shaped like x, one per element) with the documented numerics."""
    channels = x.shape[group_dim]
    lower_c = channel_view(lower, channels, spec.group_size, group_dim, x.dim())
    scale_c = channel_view(scale, channels, spec.group_size, group_dim, x.dim())
    v = (x.float() - lower_c) / scale_c
    if spec.stochastic:
        noise = torch.rand(v.shape, generator=rounding_generator(v.device), device=v.device)
        v = torch.floor(v + noise)
    else:
        v = torch.round(v)
    levels = (1 << spec.bits) - 1
    return v.nan_to_num_(nan=0.0).clamp_(0, levels).to(torch.uint8)


def dequantize_reference(codes: torch.Tensor, packed: Packed,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    channels = packed.shape[packed.group_dim]
    ndim = len(packed.shape)
    lower_c = channel_view(packed.lower, channels, packed.group_size, packed.group_dim, ndim)
    scale_c = channel_view(packed.scale, channels, packed.group_size, packed.group_dim, ndim)
    return (codes.view(packed.shape).float() * scale_c + lower_c).to(dtype or packed.dtype)


def pack(x: torch.Tensor, spec: QuantSpec, lower: torch.Tensor, span: torch.Tensor) -> Packed:
    """Quantize ``x`` with the given per-group ``lower``/``span`` (no state is touched)."""
    group_dim = spec.group_dim % x.dim()
    scale = scale_from_span(span, spec.bits)
    x = x.contiguous()
    kernel = _backend.kernels_for(x, spec.backend)
    if kernel is not None:
        codes = kernel.quantize(x, lower, scale, spec.bits, group_dim, spec.group_size,
                                spec.stochastic)
    else:
        codes = quantize_reference(x, lower, scale, spec, group_dim)
    data = codes if spec.bits == 8 else pack_bits(codes, spec.bits)
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
    numel = packed.shape.numel()
    kernel = _backend.kernels_for(packed.data, packed.backend)
    codes = packed.data if packed.bits == 8 else unpack_bits(packed.data, packed.bits, numel)
    if kernel is not None:
        return kernel.dequantize(codes.view(packed.shape), packed.lower, packed.scale,
                                 packed.group_dim, packed.group_size, dtype or packed.dtype)
    return dequantize_reference(codes, packed, dtype)


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
