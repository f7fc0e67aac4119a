"""What a compressed activation is: the ``Codes`` protocol, the quantizer's containers and spec.

Every compressed activation a Mesa layer saves (``Packed``, ``Refined``, ``Mapped``, ``Affine``,
DIVISION's ``DivisionPacked``, ``MesaUPerHead``'s ``FusedCodes``) satisfies ``Codes``: ``saved``
flattens it into its tensors and rebuilds it in backward, and a weight gradient decodes it a few
samples at a time through ``sample_range``. Decoding is the quantizer's job
(``quantizer.unpack``), so this module holds data and layout only.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, Self, TypeGuard, runtime_checkable

import torch

__all__ = ['Affine', 'Codes', 'Mapped', 'Packed', 'QuantSpec', 'Refined', 'in_memory_order',
           'inverse_order', 'is_codes', 'layout_of', 'rebuild_from', 'sample_range', 'stored_dim']


@runtime_checkable
class Codes(Protocol):
    """A compressed activation, saved through ``ctx.save_for_backward`` as its tensors.

    Every one also has the ``shape`` and ``dtype`` of the activation it stands for. They are not
    members here: a protocol with data members cannot be asked through ``issubclass``, which is
    how ``is_codes`` asks it.
    """

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors to save; ``rebuild`` takes them back with ``meta()``."""
        ...

    def meta(self) -> tuple:
        """Everything else ``rebuild`` needs (no tensors)."""
        ...

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Self:
        """The codes that gave these ``tensors()`` and ``meta()``."""
        ...

    def sample_range(self, start: int, stop: int) -> Codes | None:
        """The codes of ``x[start:stop]`` (along dim 0), sharing storage; None where they are
        no such slice of it (then the activation is decoded whole)."""
        ...


def is_codes(item: object) -> TypeGuard[Codes]:
    """Whether ``item``'s type satisfies ``Codes``.

    Asked of the type, so ``ABCMeta`` answers from its per-class cache: ``isinstance`` against a
    runtime protocol inspects every member on each call (10-25 us on Python 3.11), and ``save``
    asks for every item every layer saves.
    """
    return issubclass(type(item), Codes)


@dataclass(frozen=True)
class QuantSpec:
    """Static description of one saved activation.

    Args:
        bits: Code width (2, 4, 8, or 16: 8-bit codes refined, ``quantizer.REFINED_BITS``).
        group_dim: Dimension whose channels are grouped (negative counts from the end).
        group_size: Consecutive channels per group; 1 means one group per channel/head.
            Defaults to 1, as ``MesaConfig.group_size``.
        stochastic: Stochastic (unbiased) rounding instead of round-to-nearest-even.
        ema_decay: Weight of the previous running estimate.
        backend: ``'auto'``, ``'cuda'`` or ``'torch'`` (see ``MesaConfig``).
        refine_error: Of an attention operand's quantizer: the replay error beyond which the
            operands are refined (``MesaConfig.attention_refine_error``). Defaults to
            ``math.inf``: never, for a spec not made from a config.
        refine_below: Of a BatchNorm's quantizer: batch statistics over fewer values per
            channel than this keep refined codes (``MesaConfig.batchnorm_refine_below``).
            Defaults to 0: never.
    """

    bits: int = 8
    group_dim: int = -1
    group_size: int = 1
    stochastic: bool = True
    ema_decay: float = 0.9
    backend: str = 'auto'
    refine_error: float = math.inf
    refine_below: int = 0

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
    # the dims of ``shape`` in the order the codes hold them (``x.permute(order)`` was packed,
    # a dense tensor in another layout: a channels-last map, transposed tokens); None: as they
    # are
    order: tuple[int, ...] | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.lower, self.scale

    def meta(self) -> tuple:
        return (self.shape, self.dtype, self.bits, self.group_dim, self.group_size, self.backend,
                self.order)

    @property
    def stored_shape(self) -> torch.Size:
        """The shape of the tensor the codes were made of (``shape`` in ``order``)."""
        return self.shape if self.order is None else torch.Size(self.shape[d] for d in self.order)

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Packed:
        return cls(*tensors, *meta)

    def sample_range(self, start: int, stop: int) -> Packed | None:
        """None where the samples are no whole-byte range of the data: groups along dim 0 (the
        per-group affine would need slicing too), samples that are not outermost in the codes
        (``order``) or sub-byte codes whose samples end inside a byte."""
        if self.group_dim == 0 or len(self.shape) < 2 or (self.order or (0,))[0] != 0:
            return None
        per_sample = self.shape[1:].numel()
        if self.bits == 8:
            data = self.data.view(self.stored_shape)[start:stop]
        elif per_sample * self.bits % 8 == 0:
            row_bytes = per_sample * self.bits // 8
            data = self.data[start * row_bytes:stop * row_bytes]
        else:
            return None
        return replace(self, data=data, shape=torch.Size((stop - start, *self.shape[1:])))


@dataclass
class Refined:
    """An activation kept to about 16 bits as two 8-bit codes of the same groups: ``coarse``,
    its own, and ``fine``, those of what ``coarse`` misses (one coarse step either way at most,
    so each fine step is 2/255 of a coarse one). ``quantizer.refine`` makes them: attention
    operands whose 8-bit replay would move the logits too far keep these."""

    coarse: Packed
    fine: Packed

    shape = property(lambda self: self.coarse.shape)
    dtype = property(lambda self: self.coarse.dtype)
    bits = property(lambda self: 16)
    group_dim = property(lambda self: self.coarse.group_dim)
    group_size = property(lambda self: self.coarse.group_size)
    backend = property(lambda self: self.coarse.backend)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.coarse.tensors(), *self.fine.tensors())

    def meta(self) -> tuple:
        return self.coarse.meta(), self.fine.meta()

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Refined:
        return cls(Packed.rebuild(tensors[:3], meta[0]), Packed.rebuild(tensors[3:], meta[1]))

    def sample_range(self, start: int, stop: int) -> Refined | None:
        coarse = self.coarse.sample_range(start, stop)
        fine = self.fine.sample_range(start, stop)
        return None if coarse is None or fine is None else Refined(coarse, fine)


class OfSource:
    """Codes that stand for a function of their ``source`` codes: the fields
    ``attached_codes`` checks are the source's."""

    shape = property(lambda self: self.source.shape)
    bits = property(lambda self: self.source.bits)
    group_dim = property(lambda self: self.source.group_dim)
    group_size = property(lambda self: self.source.group_size)
    backend = property(lambda self: self.source.backend)


@dataclass
class Mapped(OfSource):
    """The codes of ``x`` standing for ``fn(x)``, an element-wise function of it.

    A GELU saves its input's codes for its own backward; the next Linear needs the GELU's output,
    which is ``gelu`` of that input. Saving it as the same codes (``attach_codes``) costs no
    memory; ``quantizer.unpack`` decodes the source and applies ``fn`` in fp32.
    """

    source: Packed | Refined
    fn: Callable[[torch.Tensor], torch.Tensor]  # element-wise, fp32 in and out
    dtype: torch.dtype  # of the tensor it stands for

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.source.tensors()

    def meta(self) -> tuple:
        return layout_of(self.source), self.fn, self.dtype

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Mapped:
        source_layout, fn, dtype = meta
        return cls(rebuild_from(tensors, source_layout), fn, dtype)

    def sample_range(self, start: int, stop: int) -> Mapped | None:
        source = self.source.sample_range(start, stop)
        return None if source is None else replace(self, source=source)


@dataclass
class Affine(OfSource):
    """The codes of ``x`` standing for ``x * weight + bias``, one weight and bias (each
    optional) per channel of ``x``'s one-channel groups: a LayerNorm's output as the codes of
    its normalized input (``layers.norm.affine_codes``).

    Decoding folds the affine into the codes' own per-group one (``quantizer.unpack``), so it
    costs two per-channel ops and no pass over the tensor. The weight and bias are the layer's
    own tensors, saved with the codes: autograd's version check guards them against an in-place
    update before backward, as it guards the LayerNorm's own saved weight.
    """

    source: Packed
    weight: torch.Tensor | None  # (C,), along the source's group dim
    bias: torch.Tensor | None  # (C,)
    dtype: torch.dtype  # of the tensor it stands for

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (*self.source.tensors(), self.weight, self.bias)

    def meta(self) -> tuple:
        return self.source.meta(), self.dtype

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> Affine:
        source_meta, dtype = meta
        return cls(Packed.rebuild(tensors[:3], source_meta), tensors[3], tensors[4], dtype)

    def sample_range(self, start: int, stop: int) -> Affine | None:
        source = self.source.sample_range(start, stop)
        return None if source is None else replace(self, source=source)


def in_memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``x`` as the kernels read it, contiguous, and the order of its dims there: a dense
    tensor in another layout (a channels-last map, transposed tokens) is read in its own
    (``x.permute(order)``, no copy); any other, copied (``order`` None)."""
    if not x.is_contiguous():
        order = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
        stored = x.permute(order)
        if stored.is_contiguous():
            return stored, order
    return x.contiguous(), None


def inverse_order(order: tuple[int, ...]) -> list[int]:
    """The permutation that takes ``x.permute(order)`` back to ``x``."""
    return sorted(range(len(order)), key=order.__getitem__)


def stored_dim(dim: int, order: tuple[int, ...] | None) -> int:
    """Where dim ``dim`` of a tensor is in the tensor its codes were made of."""
    return dim if order is None else order.index(dim)


def layout_of(codes: Any) -> tuple[type, int, Any]:
    """What rebuilds ``codes`` inside codes that hold others (``Mapped``'s source, a fused
    concatenation's parts), whatever their kind: its type, how many tensors it saves, its
    ``meta()``."""
    return type(codes), len(codes.tensors()), codes.meta()


def rebuild_from(tensors: tuple[torch.Tensor, ...], layout: tuple[type, int, Any]) -> Any:
    """The codes ``layout_of`` described, from their tensors."""
    kind, _, meta = layout
    return kind.rebuild(tuple(tensors), meta)


def sample_range(codes: Codes | Any, start: int, stop: int) -> Codes | None:
    """``codes.sample_range(start, stop)``; None for anything that is not ``Codes``.

    A backward uses it to decode a large input a few samples at a time.
    """
    return codes.sample_range(start, stop) if is_codes(codes) else None
