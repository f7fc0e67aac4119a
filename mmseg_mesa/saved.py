"""Saving packed activations through ``ctx.save_for_backward``.

Every tensor a Mesa layer keeps for backward goes through ``ctx.save_for_backward`` (so autograd's
saved-tensor hooks, version checks and memory accounting see it). Compressed activations
(``codes.Codes``: ``Packed``, ``Mapped``, ``DivisionPacked``, ``FusedCodes``) and bit masks are
flattened into their tensors here and rebuilt in backward; layers never see the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._backend import QuantBackend, select_backend
from .codes import Codes, in_memory_order, inverse_order, is_codes
from .constants import filled
from .handoff import SAVED_LABEL


def _mask_backend(t: torch.Tensor) -> QuantBackend:
    """The backend for a mask on ``t``'s device, as ``backend='auto'`` picks it: on CPU the
    compiled kernels where the extension loads (one call, where ``bitpack``'s torch ops take a
    dozen: most of what a small mask costs to pack); elsewhere ``bitpack``'s torch ops."""
    return select_backend(t, 'auto')


@dataclass
class PackedMask:
    """A boolean tensor stored as 1 bit per element (``bitpack``'s layout), in the order of its
    dims in memory where it was a dense tensor in another layout (``Packed.order``)."""

    data: torch.Tensor
    shape: torch.Size
    order: tuple[int, ...] | None = None

    @classmethod
    def of(cls, mask: torch.Tensor) -> PackedMask:
        stored, order = in_memory_order(mask)
        return cls(_mask_backend(mask).pack_mask(stored), mask.shape, order)

    @classmethod
    def positive(cls, x: torch.Tensor) -> PackedMask:
        """The mask of ``x > 0`` (a ReLU's output), packed without the bool tensor on CPU."""
        stored, order = in_memory_order(x)
        return cls(_mask_backend(x).pack_positive(stored), x.shape, order)

    def _stored_shape(self) -> torch.Size:
        return self.shape if self.order is None else torch.Size(self.shape[d] for d in self.order)

    def unpack(self) -> torch.Tensor:
        mask = _mask_backend(self.data).unpack_mask(self.data, self._stored_shape())
        return mask if self.order is None else mask.permute(inverse_order(self.order))

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` where the mask is set, else 0 (``values`` shaped like the mask, or
        broadcasting against it)."""
        if self.order is None:
            return _mask_backend(values).mask_select(values, self.data, self.shape)
        stored = values.permute(self.order) if values.shape == self.shape else None
        if stored is None or not stored.is_contiguous():  # not laid out as the mask
            return torch.where(self.unpack(), values, filled(0.0, (), values, values.dtype))
        return _mask_backend(values).mask_select(stored, self.data, stored.shape).permute(
            inverse_order(self.order))

    def select_(self, values: torch.Tensor) -> torch.Tensor:
        """``select`` written into ``values`` (shaped like the mask): one bool per element
        besides it, where ``select`` makes a second tensor of ``values``' size."""
        stored = values if self.order is None else values.permute(self.order)
        if not stored.is_contiguous():  # not laid out as the mask
            return torch.where(self.unpack(), values, filled(0.0, (), values, values.dtype),
                               out=values)
        _mask_backend(values).mask_select_(stored, self.data, stored.shape)
        return values


Saveable = torch.Tensor | Codes | PackedMask | None


SOFTMAX_OUTPUT = 'softmax output'  # attention maps, among others


def saved_label(t: torch.Tensor) -> str | None:
    """The label ``save`` gave ``t`` (what it is, for saved-bytes reports), or None."""
    return SAVED_LABEL.get(t)


def save(ctx: Any, *items: Saveable, label: str | None = None) -> None:
    """``ctx.save_for_backward`` for tensors, compressed activations, masks and None;
    ``label`` names what they are for saved-bytes reports (``memory.count_saved_tensors``)."""
    flat: list[torch.Tensor | None] = []
    layout: list[tuple] = []
    for item in items:
        if is_codes(item):
            tensors = item.tensors()
            layout.append((type(item), len(tensors), item.meta()))
            flat.extend(tensors)
        elif isinstance(item, PackedMask):
            layout.append(('mask', 1, (item.shape, item.order)))
            flat.append(item.data)
        else:
            layout.append(('tensor', 1, None))
            flat.append(item)
    if label is not None:
        for t in flat:
            if t is not None:
                SAVED_LABEL.offer(t, label)
    ctx.save_for_backward(*flat)
    ctx.mesa_layout = layout


def load(ctx: Any) -> list[Saveable]:
    """The items given to :func:`save`, in order."""
    flat = ctx.saved_tensors
    items: list[Saveable] = []
    pos = 0
    for kind, count, meta in ctx.mesa_layout:
        chunk = flat[pos:pos + count]
        pos += count
        if isinstance(kind, type):
            items.append(kind.rebuild(tuple(chunk), meta))
        elif kind == 'mask':
            items.append(PackedMask(chunk[0], *meta))
        else:
            items.append(chunk[0])
    return items
