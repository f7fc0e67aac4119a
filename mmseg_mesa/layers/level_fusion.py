"""A convolution of upsampled, concatenated feature levels, computed a few samples at a time.

Decode heads fuse feature levels as ``conv(torch.cat([levels[0], *map(upsample, levels[1:])]))``
(UPerHead's FPN bottleneck, SegFormer's fusion conv). The concatenation is the largest tensor of
such a head (Swin-T UPerNet 512x512: 128 MiB per image), and built whole it grows the step peak
by that much per image. ``LevelFusionConvFunction`` builds it for a block of samples at a time
(one sample where one is larger than ``DECODE_CHUNK_BYTES``), convolves the block into its rows
of the output and drops it. Upsampling, concatenation and convolution compute every sample on its
own, so the output is bit-identical to the batched ops' (tests hold it on CPU); a batch-statistics
norm after the conv still sees the whole output.

For backward it keeps each level's codes at the level's own resolution (``FusedCodes``: the three
upsampled levels of an FPN cost 1/4, 1/16 and 1/64 of their upsampled codes). The weight gradient
decodes and upsamples one level a few samples at a time; each level's input gradient is the
conv's input gradient through that level's slice of the weight (an input channel's gradient reads
only its own weights), taken back through the upsampling a block at a time.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..codes import layout_of, rebuild_from
from ..quantizer import ActivationQuantizer, Packed, Refined, sample_range, unpack
from ..saved import load, save
from .autocast import (
    autocast_cast,
    autocast_inputs,
    autocast_off,
    cast,
    no_autocast_backward,
    returns_owned,
)
from .chunking import rows_of, sample_slices, summed

Upsample = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class FusedCodes:
    """A concatenation of upsampled levels, saved as the codes of each level before upsampling.

    Decoding and then upsampling interpolates the rounding errors, so no value is further from
    the exact one than its own codes would put it.
    """

    parts: list[Packed | Refined]  # Refined at ``bits=16``
    shape: torch.Size  # of the concatenation
    dtype: torch.dtype
    upsample: Upsample  # a level to the concatenation's size, as the forward did it

    @property
    def bits(self) -> int:
        return self.parts[0].bits

    @property
    def group_dim(self) -> int:
        return 1

    @property
    def group_size(self) -> int:
        return self.parts[0].group_size

    @property
    def backend(self) -> str:
        return self.parts[0].backend

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for part in self.parts for t in part.tensors())

    def meta(self) -> tuple:
        return (tuple(layout_of(part) for part in self.parts), self.shape, self.dtype,
                self.upsample)

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> FusedCodes:
        layouts, *rest = meta
        parts, start = [], 0
        for layout in layouts:
            parts.append(rebuild_from(tensors[start:start + layout[1]], layout))
            start += layout[1]
        return cls(parts, *rest)

    def sample_range(self, start: int, stop: int) -> FusedCodes | None:
        parts = [sample_range(part, start, stop) for part in self.parts]
        if any(part is None for part in parts):
            return None
        return dataclasses.replace(self, parts=parts,
                                   shape=torch.Size((stop - start, *self.shape[1:])))

    def upsampled(self, piece: torch.Tensor) -> torch.Tensor:
        """A decoded level at the concatenation's size (the first level is at it already)."""
        return piece if piece.shape[2:] == self.shape[2:] else self.upsample(piece)

    def restore(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.float32, device=self.parts[0].data.device)
        start = 0
        for part in self.parts:
            piece = self.upsampled(unpack(part, torch.float32))
            out[:, start:start + piece.shape[1]] = piece
            start += piece.shape[1]
            del piece
        return out.to(dtype or self.dtype)


def level_weight_grad(part: Packed, codes: FusedCodes, grad: torch.Tensor,
                      weight_shape: torch.Size, conv_args: tuple) -> torch.Tensor:
    """The weight's gradient for one level's channels (fp32), from that level's codes decoded
    and upsampled (as ``FusedCodes.restore`` does) a few samples at a time."""
    slices = sample_slices(torch.Size((part.shape[0], part.shape[1], *codes.shape[2:])), 4)
    pieces = [(rows, sample_range(part, rows.start, rows.stop)) for rows in slices
              if len(slices) > 1]
    if not pieces or any(piece is None for _, piece in pieces):
        pieces = [(slice(None), part)]
    return summed(torch.nn.grad.conv2d_weight(
        codes.upsampled(unpack(piece, torch.float32)).to(grad.dtype), weight_shape,
        rows_of(grad, rows), *conv_args).float() for rows, piece in pieces)


def upsample_backward(upsample: Upsample, grad: torch.Tensor, shape: torch.Size,
                      dtype: torch.dtype) -> torch.Tensor:
    """The gradient of a level of ``shape`` from the gradient of its upsampling: autograd's own
    backward of ``upsample``. Where the upsampling names that backward op (an ``adjoint(grad,
    shape)`` method, ``integrations.resize.Resize``), it is called directly; otherwise the
    upsampling runs on a probe (only the level's shape matters: the upsampling is linear, so its
    backward reads no value of the probe, which is left unfilled)."""
    adjoint = getattr(upsample, 'adjoint', None)
    if adjoint is not None:
        result = adjoint(grad.to(dtype), shape)
        if result is not None:
            return result
    with torch.enable_grad():
        probe = torch.empty(shape, dtype=dtype, device=grad.device, requires_grad=True)
        out = upsample(probe)
        (result,) = torch.autograd.grad(out, probe, grad.to(out.dtype))
    return result


@dataclass(frozen=True)
class FusionSpec:
    """What ``LevelFusionConvFunction`` needs besides tensors: the upsampling of levels 1.. to
    level 0's size, the conv's (stride, padding, dilation, groups) and one quantizer per level.
    ``owns_output_grad``: the caller vouches that the output's gradient reaches backward as a
    tensor nothing else reads (the output's one reader is a norm whose backward returns a fresh
    gradient); backward then writes level 0's gradient into it when their shapes agree, and the
    two never exist at once. ``output_into_first``: the caller vouches that nothing reads
    level 0 after this op (``ownership.sole_reference``); where the batch is convolved a block
    at a time and the output has level 0's dtype, shape and strides, each block of the output
    overwrites level 0's rows once they are read, and the two never exist at once."""

    upsample: Upsample
    conv_args: tuple
    quantizers: Sequence[ActivationQuantizer]
    owns_output_grad: bool = False
    output_into_first: bool = False


def fusion_blocks(levels: Sequence[torch.Tensor], weight: torch.Tensor, conv_args: tuple
                  ) -> tuple[torch.Size, torch.dtype, list[slice]]:
    """The concatenation's shape and dtype (``torch.cat``'s promotion), and the blocks of samples
    it is built in: one block unless torch convolves a block as it does the whole batch."""
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in levels])
    shape = torch.Size((levels[0].shape[0], sum(t.shape[1] for t in levels),
                        *levels[0].shape[2:]))
    blocks = sample_slices(shape, dtype.itemsize)
    compute = autocast_cast(torch.empty((), dtype=dtype, device=weight.device))[0].dtype
    if len(blocks) > 1 and not same_conv_backend(shape, blocks, weight, conv_args, compute):
        blocks = [slice(None)]
    return shape, dtype, blocks


def same_conv_backend(shape: torch.Size, blocks: list[slice], weight: torch.Tensor,
                      conv_args: tuple, dtype: torch.dtype) -> bool:
    """Whether torch picks the same convolution kernel for every block as for the whole batch.

    Kernels compute each sample on its own, but torch chooses among them by shape: on CPU a
    single sample of a small map runs ``slow_conv2d`` where two run oneDNN, which sums in
    another order. The choice is read from torch (``_select_conv_backend``, given tensors of no
    storage); where torch does not say, the batch is not split.
    """
    select = getattr(torch._C, '_select_conv_backend', None)
    if select is None:
        return False
    stride, padding, dilation, groups = conv_args
    w = torch.empty((), dtype=dtype, device=weight.device).expand(weight.shape)

    def backend(samples: int) -> Any:
        x = torch.empty((), dtype=dtype, device=weight.device).expand(samples, *shape[1:])
        return select(x, w, None, list(stride), list(padding), list(dilation), False, [0, 0],
                      groups, None)

    whole = backend(shape[0])
    sizes = {len(range(*rows.indices(shape[0]))) for rows in blocks}
    return all(backend(n) == whole for n in sizes)


def channels_last(t: torch.Tensor) -> bool:
    """A 4-d tensor laid out channels-last only: ``torch.cat`` keeps that layout when every
    piece has it."""
    return (t.dim() == 4 and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last))


def concatenated(levels: Sequence[torch.Tensor], upsample: Upsample, rows: slice,
                 shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``torch.cat([levels[0], *map(upsample, levels[1:])], dim=1)`` of samples ``rows``, each
    upsampled level written into its channel slice as soon as it exists (one alive at a time);
    layout as ``torch.cat`` gives it (channels-last only if every piece is)."""
    first = rows_of(levels[0], rows)
    out = torch.empty((first.shape[0], *shape[1:]), dtype=dtype, device=first.device,
                      memory_format=torch.contiguous_format)
    start, all_channels_last = 0, True
    for i, level in enumerate(levels):
        piece = first if i == 0 else upsample(rows_of(level, rows))
        all_channels_last &= channels_last(piece)
        out[:, start:start + piece.shape[1]] = piece
        start += piece.shape[1]
        del piece
    return out.contiguous(memory_format=torch.channels_last) if all_channels_last else out


def laid_out_as(t: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                memory_format: torch.memory_format) -> bool:
    """Whether ``t`` has the shape and dtype of ``torch.empty(shape, dtype=dtype,
    memory_format=memory_format)`` and is dense in that layout, so that results written into
    it are laid out as in a new tensor. (Not by comparing with an empty tensor on the meta
    device: memory trackers count its bytes.)"""
    return (t.shape == shape and t.dtype == dtype and t.storage_offset() == 0
            and t.is_contiguous(memory_format=memory_format))


def fused_codes(ctx: Any, spec: FusionSpec, levels: Sequence[torch.Tensor], shape: torch.Size,
                dtype: torch.dtype, first: Packed | None = None) -> FusedCodes | None:
    """The levels' codes, where the weight's gradient needs them; level 0's are ``first``
    where given (packed before level 0 was overwritten)."""
    if not ctx.needs_input_grad[1]:
        return None
    parts = [first if i == 0 and first is not None else q.pack(t)
             for i, (q, t) in enumerate(zip(spec.quantizers, levels))]
    return FusedCodes(parts, shape, dtype, spec.upsample)


class LevelFusionConvFunction(torch.autograd.Function):
    """``F.conv2d(cat([levels[0], *map(upsample, levels[1:])], 1), weight, bias, *conv_args)``,
    the concatenation built a block of samples at a time; saves each level's codes."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, spec: FusionSpec, weight: torch.Tensor, bias: torch.Tensor | None,
                *levels: torch.Tensor) -> torch.Tensor:
        shape, dtype, blocks = fusion_blocks(levels, weight, spec.conv_args)
        ctx.conv_args = spec.conv_args
        ctx.level_meta = [(t.shape, t.dtype) for t in levels]
        ctx.blocks = blocks
        overwrite = spec.output_into_first and len(blocks) > 1
        # level 0's codes before it may be overwritten, the others' once the concatenation is
        # gone (the same codes: quantizers pack in level order either way)
        first = spec.quantizers[0].pack(levels[0]) if overwrite and ctx.needs_input_grad[1] \
            else None
        out = wc = bc = None
        for rows in blocks:
            x = concatenated(levels, spec.upsample, rows, shape, dtype)
            if wc is None:  # the weight cast once, for every block
                xc, wc, bc = autocast_inputs(ctx, x, weight, bias)
            else:
                (xc,) = autocast_cast(x)
            del x
            with autocast_off(ctx.device_type):
                y = F.conv2d(xc, wc, bc, *spec.conv_args)
            del xc
            if len(blocks) == 1:
                out = y
                break
            if out is None:
                fmt = torch.channels_last if channels_last(y) else torch.contiguous_format
                out_shape = torch.Size((shape[0], *y.shape[1:]))
                if overwrite and laid_out_as(levels[0], out_shape, y.dtype, fmt):
                    # level 0's rows of this block are read (copied into the concatenation);
                    # later blocks read only their own rows
                    out = levels[0]
                    ctx.mark_dirty(out)
                else:
                    out = torch.empty(out_shape, dtype=y.dtype, device=y.device,
                                      memory_format=fmt)
            out[rows] = y
            del y
        ctx.input_dtype = dtype
        codes = fused_codes(ctx, spec, levels, shape, dtype, first)
        save(ctx, codes, weight)
        ctx.upsample = spec.upsample
        ctx.owns_output_grad = spec.owns_output_grad
        return out

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        codes, weight = load(ctx)
        grad = cast(grad, ctx.compute_dtype)
        w = cast(weight, ctx.compute_dtype)
        needs = ctx.needs_input_grad
        starts = [0]
        for level_shape, _ in ctx.level_meta:
            starts.append(starts[-1] + level_shape[1])
        grad_w = grad_b = None
        if needs[1]:
            grad_w = cast(torch.cat([
                level_weight_grad(part, codes, grad, w[:, a:b].shape, ctx.conv_args)
                for part, a, b in zip(codes.parts, starts, starts[1:])], dim=1), weight.dtype)
        if needs[2]:
            grad_b = cast(grad.sum((0, 2, 3)), weight.dtype)
        needs_levels = needs[3:]
        in_place = (ctx.owns_output_grad and needs_levels[0] and grad.is_contiguous()
                    and (grad.dtype, grad.shape) == (ctx.level_meta[0][1], ctx.level_meta[0][0]))
        level_grads: list[torch.Tensor | None] = [None] * len(needs_levels)
        # level 0 last: where it may overwrite the output's gradient, every other use of it is
        # done by then
        for i in [*range(1, len(needs_levels)), 0]:
            if needs_levels[i]:
                a, b = starts[i], starts[i + 1]
                level_grads[i] = level_input_grad(ctx, grad, w[:, a:b], ctx.level_meta[i],
                                                  upsampled=i > 0,
                                                  into=grad if i == 0 and in_place else None)
        return (None, grad_w, grad_b, *level_grads)


def level_input_grad(ctx: Any, grad: torch.Tensor, weight: torch.Tensor,
                     meta: tuple[torch.Size, torch.dtype], upsampled: bool,
                     into: torch.Tensor | None = None) -> torch.Tensor:
    """One level's gradient: the conv's input gradient through the level's slice of the weight,
    then back through its upsampling, a block of samples at a time; written into ``into`` (the
    output's gradient itself, each block after it is read) where given."""
    shape, dtype = meta
    out = into
    for rows in ctx.blocks:
        g = rows_of(grad, rows)
        piece = torch.nn.grad.conv2d_input((g.shape[0], weight.shape[1], *ctx.level_meta[0][0][2:]),
                                           weight, g, *ctx.conv_args)
        if upsampled:
            piece = upsample_backward(ctx.upsample, piece, (g.shape[0], *shape[1:]), dtype)
        piece = cast(piece, dtype)
        if out is None and len(ctx.blocks) == 1:
            return piece
        if out is None:
            out = piece.new_empty(shape)
        out[rows] = piece
        del piece
    return out
