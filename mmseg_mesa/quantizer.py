"""The one activation quantizer every Mesa layer uses.

``ActivationQuantizer.pack(x) -> Packed`` and ``unpack(packed) -> x``. Channels along
``group_dim`` are split into groups of ``group_size`` consecutive channels (the last group may be
shorter); each group gets an offset (``lower``) and a ``scale = span / (2**bits - 1)`` (1 where
``span == 0``) derived from running estimates of its min and range: the first observed training
batch is taken as it is, later batches are blended in with an EMA, as in Mesa. Unlike Mesa, a
batch whose values fall outside the running range is quantized over the running range widened
to cover it, instead of being clipped (see ``reference.ema_update``). The arithmetic runs in a
``_backend.QuantBackend``: the compiled kernels (CPU or CUDA, one call each, bit packing
included; on CPU ``pack`` observes and quantizes in one call) or the pure-PyTorch reference,
with bit-identical results; ``_backend.select_backend`` picks it from the spec's ``backend``.
``refine(packed, x)`` adds a second 8-bit pass over what ``packed`` misses (``Refined``, about
16 bits), through the same kernels; a spec of ``REFINED_BITS`` (16) packs that way.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn

from ._backend import QuantBackend, select_backend
from .codes import (
    Affine,
    Codes,
    Mapped,
    Packed,
    QuantSpec,
    Refined,
    in_memory_order,
    inverse_order,
    sample_range,
    stored_dim,
)
from .host import LateReading
from .reference import ema_update, fine_grid, group_min_max, scale_from_span
from .rounding import reset_rounding_generators, rounding_counter

__all__ = ['REFINED_BITS', 'ActivationQuantizer', 'Mapped', 'Packed', 'QuantSpec', 'Refined',
           'coded_bits', 'ema_update', 'group_min_max', 'pack', 'refine',
           'reset_rounding_generators', 'rounding_counter', 'sample_range', 'scale_from_span',
           'unpack', 'unpack_divided']


def without_grad() -> contextlib.AbstractContextManager:
    """``torch.no_grad()``, or nothing where grad mode is off already (inside an autograd
    Function's forward, where every layer packs; entering it costs a few us per call)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


# ``bits=16``: 8-bit codes and a second 8-bit pass over what they miss (``refine``); the kernels
# see 8 bits only.
REFINED_BITS = 16


def coded_bits(spec: QuantSpec) -> int:
    """The width the kernels quantize at for ``spec``: 8 for ``REFINED_BITS``."""
    return 8 if spec.bits == REFINED_BITS else spec.bits


def pack(x: torch.Tensor, spec: QuantSpec, lower: torch.Tensor, span: torch.Tensor
         ) -> Packed | Refined:
    """Quantize ``x`` with the given per-group ``lower``/``span`` (no state is touched)."""
    packed = quantized(x, spec, lower, scale_from_span(span, coded_bits(spec)))
    return refine(packed, x) if spec.bits == REFINED_BITS else packed


def quantized(x: torch.Tensor, spec: QuantSpec, lower: torch.Tensor, scale: torch.Tensor
              ) -> Packed:
    """``x``'s ``coded_bits(spec)``-bit codes over the given per-group ``lower`` and step."""
    group_dim = spec.group_dim % x.dim()
    bits = coded_bits(spec)
    stored, order = in_memory_order(x)
    data = select_backend(x, spec.backend).quantize(
        stored, lower, scale, bits, stored_dim(group_dim, order), spec.group_size,
        spec.stochastic, pack=True)
    return Packed(data, lower, scale, x.shape, x.dtype, bits, group_dim, spec.group_size,
                  spec.backend, order)


def refine(packed: Packed | Refined, x: torch.Tensor, mean: torch.Tensor | None = None,
           rstd: torch.Tensor | None = None) -> Refined:
    """``x``'s 8-bit codes ``packed`` with a second 8-bit pass over what they miss: about 16
    bits (``Refined``; codes refined already, a 16-bit layer's, are returned as they are). The
    second pass rounds to nearest over one coarse step either way of each group, so it draws
    nothing from the rounding stream: later layers' codes stay those of a run without it. With
    ``mean`` and ``rstd`` (one per group), ``packed`` holds the codes of ``(x - mean) * rstd``
    (``ActivationQuantizer.pack_standardized``). One backend call (``refine_reference``), made
    in the layout the codes were made in."""
    if isinstance(packed, Refined):
        return packed
    if packed.bits != 8:  # bit-packed codes: the same numerics through torch's ops
        return Refined(packed, _fine_codes(packed, x, mean, rstd))
    order = packed.order
    stored = x.detach() if order is None else x.detach().permute(order)
    fine, lower, scale = select_backend(x, packed.backend).refine(
        stored.contiguous(), packed.data, packed.lower, packed.scale,
        stored_dim(packed.group_dim, order), packed.group_size, mean, rstd)
    return Refined(packed, Packed(fine, lower, scale, packed.shape, torch.float32, 8,
                                  packed.group_dim, packed.group_size, packed.backend, order))


def _fine_codes(packed: Packed, x: torch.Tensor, mean: torch.Tensor | None,
                rstd: torch.Tensor | None) -> Packed:
    """``refine``'s second pass over codes of fewer than 8 bits, which the kernels' one call
    does not read."""
    value = x.detach().float()
    if mean is not None:
        shape = [1] * x.dim()
        shape[packed.group_dim] = -1
        value = (value - mean.view(shape)) * rstd.view(shape)
    spec = QuantSpec(bits=8, group_dim=packed.group_dim, group_size=packed.group_size,
                     stochastic=False, backend=packed.backend)
    return quantized(value - unpack(packed, torch.float32), spec, *fine_grid(packed.scale))


def unpack(packed: Codes, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize to the shape that was packed, in ``dtype`` or the packed dtype: contiguous, or
    in the layout of a dense tensor that was packed in its own (``Packed.order``).

    Backward formulas that compute in fp32 ask for fp32 directly, so a bf16 activation is not
    rounded to bf16 once more on the way back. ``Mapped`` codes are their source decoded in fp32
    through their function; ``Affine`` codes their source through the composed per-channel
    affine (``x * scale + lower``, then ``* weight + bias``: one per-channel affine); other
    compressors' codes (``DivisionPacked``, ``FusedCodes``) decode themselves through their
    ``restore``, so layers call this one function.
    """
    if isinstance(packed, Affine):
        source = packed.source
        lower, scale = source.lower, source.scale
        bias = None if packed.bias is None else packed.bias.detach().float()
        if packed.weight is not None:
            weight = packed.weight.detach().float()
            scale = scale * weight
            lower = lower * weight if bias is None else torch.addcmul(bias, lower, weight)
        elif bias is not None:
            lower = lower + bias
        return unpack(replace(source, lower=lower, scale=scale), dtype or packed.dtype)
    if isinstance(packed, Mapped):
        return packed.fn(unpack(packed.source, torch.float32)).to(dtype or packed.dtype)
    if isinstance(packed, Refined) and packed.coarse.bits != 8:
        coarse = unpack(packed.coarse, torch.float32)
        return coarse.add_(unpack(packed.fine, torch.float32)).to(dtype or packed.dtype)
    if isinstance(packed, Refined):
        coarse, fine = packed.coarse, packed.fine
        order = coarse.order
        out = select_backend(coarse.data, coarse.backend).dequantize_refined(
            coarse.data.contiguous(), fine.data.contiguous(), coarse.lower, coarse.scale,
            fine.lower, fine.scale, stored_dim(coarse.group_dim, order), coarse.group_size,
            dtype or packed.dtype, coarse.stored_shape)
        return out if order is None else out.permute(inverse_order(order))
    if not isinstance(packed, Packed):
        return packed.restore(dtype)
    data, order = packed.data, packed.order
    out = select_backend(data, packed.backend).dequantize(
        data.contiguous(), packed.lower, packed.scale, stored_dim(packed.group_dim, order),
        packed.group_size, dtype or packed.dtype, packed.bits, packed.stored_shape)
    return out if order is None else out.permute(inverse_order(order))


def unpack_divided(packed: Codes, divisor: torch.Tensor, dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """``unpack(packed)`` with each row's values divided by its value of ``divisor`` (fp32,
    one per row of the contiguous tensor: LayerNorm's 1/std per token), in fp32 before the cast:
    one backend call for plain codes in their own order, where dividing after took a pass."""
    divisor = divisor.detach().reshape(-1).float().contiguous()
    if isinstance(packed, Packed) and packed.order is None:
        return select_backend(packed.data, packed.backend).dequantize(
            packed.data.contiguous(), packed.lower, packed.scale, packed.group_dim,
            packed.group_size, dtype or packed.dtype, packed.bits, packed.shape, divisor)
    values = unpack(packed, torch.float32).contiguous()
    return values.view(divisor.numel(), -1).div_(divisor.view(-1, 1)).view(
        packed.shape).to(dtype or packed.dtype)


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
        # the backend of each device it has run on ('cpu' for CPU: see backend_for)
        self._backends: dict[str | torch.device, QuantBackend] = {}
        # how far a replay of attention logits from the codes it packs strays, and of the
        # scaled logits a softmax takes, as the host has received them
        # (``attention_core.refined_heads``, ``recomputed_map.replays``; training state)
        self.replay_error = LateReading()
        self.map_error = LateReading()
        # refine at every pack, as chosen from the gradient (``calibration``; training state)
        self.keep_refined = False

    def __getstate__(self) -> dict:
        # copies and pickles choose again where they run (that may be without the extension)
        state = super().__getstate__()
        state['_backends'] = {}
        return state

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

    def backend_for(self, x: torch.Tensor) -> QuantBackend:
        """The backend that runs ``x``: ``select_backend``'s choice for ``x``'s device under the
        spec's ``backend``, made once per device (CPU asked first, of the tensor: a device
        object costs a few us, and every pack asks)."""
        key = 'cpu' if x.is_cpu else x.device
        backend = self._backends.get(key)
        if backend is None:
            backend = self._backends[key] = select_backend(x, self.spec.backend)
        return backend

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        """Update the running estimates with one batch; return this batch's ``(2, G)`` range."""
        spec = self.spec
        group_dim = spec.group_dim % x.dim()
        self._ensure_groups(spec.num_groups(x.shape[group_dim]), x)
        return self.backend_for(x).observe(x.detach().contiguous(), self.lower, self.span,
                                           self.seen, group_dim, spec.group_size,
                                           spec.ema_decay)

    def pack(self, x: torch.Tensor, refined: bool = False,
             row_moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> Packed | Refined:
        """Observe ``x`` (training step) and quantize it over the resulting range (refined to
        about 16 bits where the spec says ``REFINED_BITS`` or the caller asks).

        With ``row_moments = (mean, rstd)`` (a LayerNorm's moments per token: fp32 or wider,
        kept dims, broadcasting over ``x``), the packed tensor is ``(x - mean) * rstd`` (fp32):
        where the moments are one per row of the last dim, the groups run along it and the codes
        are not refined, the kernels standardize each value as they read it (``rows``), so that
        the normalized tensor is never built and a LayerNorm runs its norm once; otherwise it
        is built and packed.
        """
        refined = refined or self.keep_refined
        spec = self.spec
        backend = self.backend_for(x)
        group_dim = spec.group_dim % x.dim()
        if row_moments is not None:
            mean, rstd = (m.detach().reshape(-1).float().contiguous() for m in row_moments)
            if (refined or spec.bits == REFINED_BITS or group_dim != x.dim() - 1
                    or mean.numel() * x.shape[-1] != x.numel()):
                x = (x.detach() - row_moments[0]).mul_(row_moments[1])
                row_moments = None
        self._ensure_groups(spec.num_groups(x.shape[group_dim]), x)
        buffers = self._buffers  # not Module.__getattr__: every pack asks
        bits = coded_bits(spec)
        if row_moments is not None:
            x = x.detach().contiguous()  # its rows are the moments' rows
            data, lower, scale = backend.observe_quantize(
                x, buffers['lower'], buffers['span'], buffers['seen'], group_dim,
                spec.group_size, spec.ema_decay, bits, spec.stochastic, pack=True, mean=mean,
                rstd=rstd, rows=True)
            wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # as promoted
            return Packed(data, lower, scale, x.shape, wide, bits, group_dim, spec.group_size,
                          spec.backend, None)
        stored, order = in_memory_order(x.detach())
        data, lower, scale = backend.observe_quantize(
            stored, buffers['lower'], buffers['span'], buffers['seen'],
            stored_dim(group_dim, order), spec.group_size, spec.ema_decay, bits, spec.stochastic,
            pack=True)
        packed = Packed(data, lower, scale, x.shape, x.dtype, bits, group_dim, spec.group_size,
                        spec.backend, order)
        return refine(packed, x) if refined or spec.bits == REFINED_BITS else packed

    def pack_standardized(self, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                          refined: bool = False) -> Packed | Refined:
        """``pack((x - mean) * rstd, refined)`` for one ``mean`` and ``rstd > 0`` per group,
        without building that full-size fp32 tensor (but to refine it).

        A per-group affine map commutes with per-group quantization: the range of the
        normalized values is ``x``'s range mapped through it, and ``x`` quantized over that
        range mapped back gives the normalized values' codes. BatchNorm saves its normalized
        input this way: the full-size temporary would be the largest tensor at its forward peak
        (docs/benchmarks.md).
        """
        refined = refined or self.keep_refined
        group_dim = self.spec.group_dim % x.dim()
        groups = self.spec.num_groups(x.shape[group_dim])
        if self.spec.group_size != 1 or mean.numel() != groups or rstd.numel() != groups:
            raise ValueError(
                f'pack_standardized needs one group per channel of dim {group_dim} and one '
                f'mean and rstd per group; got group_size={self.spec.group_size}, {groups} '
                f'groups, {mean.numel()} means, {rstd.numel()} rstds')
        self._ensure_groups(groups, x)
        spec = self.spec
        buffers = self._buffers
        bits = coded_bits(spec)
        mean = mean.detach().reshape(-1).float().contiguous()
        rstd = rstd.detach().reshape(-1).float().contiguous()
        stored, order = in_memory_order(x.detach())
        data, lower, scale = self.backend_for(x).observe_quantize(
            stored, buffers['lower'], buffers['span'], buffers['seen'],
            stored_dim(group_dim, order), 1, spec.ema_decay, bits, spec.stochastic, pack=True,
            mean=mean, rstd=rstd)
        packed = Packed(data, lower, scale, x.shape, torch.float32, bits, group_dim, 1,
                        spec.backend, order)
        if not refined and spec.bits != REFINED_BITS:
            return packed
        return refine(packed, x, mean, rstd)
