"""The one activation quantizer every Mesa layer uses.

``ActivationQuantizer.pack(x) -> Packed`` and ``unpack(packed) -> x``. Channels along
``group_dim`` are split into groups of ``group_size`` consecutive channels (the last group may be
shorter); each group gets an offset (``lower``) and a ``scale = span / (2**bits - 1)`` (1 where
``span == 0``) derived from running estimates of its min and range: the first observed training
batch is taken as it is, later batches are blended in with an EMA, as in Mesa. Unlike Mesa, a
batch whose values fall outside the running range is quantized over the running range widened
to cover it, instead of being clipped (see ``ema_update``). The codes' numerics are those of
``reference``; ``pack`` and ``unpack`` run the compiled kernels (CPU or CUDA, one call each,
bit packing included; on CPU ``pack`` observes and quantizes in one call) instead where the
backend says so, with bit-identical results.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn

from . import _backend
from .codes import Codes, Mapped, Packed, QuantSpec, sample_range
from .reference import dequantize_packed_reference, quantize_packed_reference, scale_from_span
from .rounding import reset_rounding_generators, rounding_counter

__all__ = ['ActivationQuantizer', 'Mapped', 'Packed', 'QuantSpec', 'pack',
           'reset_rounding_generators', 'rounding_counter', 'sample_range', 'scale_from_span',
           'unpack']


def without_grad() -> contextlib.AbstractContextManager:
    """``torch.no_grad()``, or nothing where grad mode is off already (inside an autograd
    Function's forward, where every layer packs; entering it costs a few us per call)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


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


def pack(x: torch.Tensor, spec: QuantSpec, lower: torch.Tensor, span: torch.Tensor) -> Packed:
    """Quantize ``x`` with the given per-group ``lower``/``span`` (no state is touched)."""
    group_dim = spec.group_dim % x.dim()
    scale = scale_from_span(span, spec.bits)
    x = x.contiguous()
    kernel = _backend.kernels_for(x, spec.backend)
    if kernel is not None:
        data = kernel.quantize(x, lower, scale, spec.bits, group_dim, spec.group_size,
                               spec.stochastic, pack=True)
    else:
        data = quantize_packed_reference(x, lower, scale, spec, group_dim)
    return Packed(data, lower, scale, x.shape, x.dtype, spec.bits, group_dim,
                  spec.group_size, spec.backend)


def unpack(packed: Codes, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize to the shape that was packed (contiguous), in ``dtype`` or the packed dtype.

    Backward formulas that compute in fp32 ask for fp32 directly, so a bf16 activation is not
    rounded to bf16 once more on the way back. ``Mapped`` codes are their source decoded in fp32
    through their function; other compressors' codes (``DivisionPacked``, ``FusedCodes``) decode
    themselves through their ``restore``, so layers call this one function.
    """
    if isinstance(packed, Mapped):
        return packed.fn(unpack(packed.source, torch.float32)).to(dtype or packed.dtype)
    if not isinstance(packed, Packed):
        return packed.restore(dtype)
    kernel = _backend.kernels_for(packed.data, packed.backend)
    if kernel is None:
        return dequantize_packed_reference(packed, dtype)
    return kernel.dequantize(packed.data.contiguous(), packed.lower, packed.scale,
                             packed.group_dim, packed.group_size, dtype or packed.dtype,
                             bits=packed.bits, shape=packed.shape)


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

    def _ensure_groups(self, groups: int, x: torch.Tensor) -> None:
        """Size the estimates for ``groups`` groups on ``x``'s device (kept when they are)."""
        lower = self._buffers['lower']  # not Module.__getattr__: every pack asks
        # is_cpu first: building device objects costs a few us per pack
        if lower.numel() == groups and ((lower.is_cpu and x.is_cpu) or lower.device == x.device):
            return
        device = x.device
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
        self._ensure_groups(groups, x)
        kernel = _backend.kernels_for(x, self.spec.backend)
        with without_grad():
            if kernel is not None:
                return kernel.observe(x.contiguous(), self.lower, self.span, self.seen,
                                      group_dim, self.spec.group_size, self.spec.ema_decay)
            lo, hi = group_min_max(x.detach(), group_dim, self.spec.group_size)
            return ema_update(self.lower, self.span, self.seen, lo, hi, self.spec.ema_decay)

    def pack(self, x: torch.Tensor) -> Packed:
        """Observe ``x`` (training step) and quantize it over the resulting range."""
        spec = self.spec
        kernel = _backend.kernels_for(x, spec.backend)
        if kernel is None:
            cover = self.observe(x)
            with without_grad():
                # lower gets its own storage: the saved Packed should not pin the span row too
                return pack(x.detach(), spec, cover[0].clone(), cover[1])
        group_dim = spec.group_dim % x.dim()
        self._ensure_groups(spec.num_groups(x.shape[group_dim]), x)
        buffers = self._buffers
        data, lower, scale = kernel.observe_quantize(
            x.detach().contiguous(), buffers['lower'], buffers['span'], buffers['seen'],
            group_dim, spec.group_size, spec.ema_decay, spec.bits, spec.stochastic, pack=True)
        return Packed(data, lower, scale, x.shape, x.dtype, spec.bits, group_dim,
                      spec.group_size, spec.backend)

    def pack_standardized(self, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                          ) -> Packed:
        """``pack((x - mean) * rstd)`` for one ``mean`` and ``rstd > 0`` per group, without
        building that full-size fp32 tensor.

        A per-group affine map commutes with per-group quantization: the range of the
        normalized values is ``x``'s range mapped through it, and ``x`` quantized over that
        range mapped back gives the normalized values' codes. BatchNorm saves its normalized
        input this way: the full-size temporary would be the largest tensor at its forward peak
        (docs/benchmarks.md).
        """
        group_dim = self.spec.group_dim % x.dim()
        groups = self.spec.num_groups(x.shape[group_dim])
        if self.spec.group_size != 1 or mean.numel() != groups or rstd.numel() != groups:
            raise ValueError(
                f'pack_standardized needs one group per channel of dim {group_dim} and one '
                f'mean and rstd per group; got group_size={self.spec.group_size}, {groups} '
                f'groups, {mean.numel()} means, {rstd.numel()} rstds')
        self._ensure_groups(groups, x)
        mean, rstd = mean.detach().reshape(-1).float(), rstd.detach().reshape(-1).float()
        kernel = _backend.kernels_for(x, self.spec.backend)
        if kernel is not None and kernel.fuses(x):
            data, lower, scale = kernel.observe_quantize(
                x.detach().contiguous(), self.lower, self.span, self.seen, group_dim, 1,
                self.spec.ema_decay, self.spec.bits, self.spec.stochastic, pack=True,
                mean=mean.contiguous(), rstd=rstd.contiguous())
            return Packed(data, lower, scale, x.shape, torch.float32, self.spec.bits,
                          group_dim, 1, self.spec.backend)
        with without_grad():
            lo, hi = group_min_max(x.detach(), group_dim, 1)
            cover = ema_update(self.lower, self.span, self.seen, (lo - mean) * rstd,
                               (hi - mean) * rstd, self.spec.ema_decay)
            lower, span = cover[0].clone(), cover[1]
            packed = pack(x.detach(), self.spec, mean + lower / rstd, span / rstd)
            return replace(packed, lower=lower, scale=scale_from_span(
                span, self.spec.bits), dtype=torch.float32)
