"""Saving packed activations through ``ctx.save_for_backward``.

Every tensor a Mesa layer keeps for backward goes through ``ctx.save_for_backward`` (so autograd's
saved-tensor hooks, version checks and memory accounting see it). Compressed activations
(``codes.Codes``: ``Packed``, ``Mapped``, ``DivisionPacked``, ``FusedCodes``) and bit masks are
flattened into their tensors here and rebuilt in backward; layers never see the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from . import _backend
from .bitpack import pack_mask, unpack_mask
from .codes import Codes, is_codes
from .handoff import SAVED_LABEL


def _mask_kernels(t: torch.Tensor) -> ModuleType | None:
    """The compiled kernels for a mask on ``t``'s device: CPU only, when the extension is
    loaded (one call, where ``bitpack``'s torch ops take a dozen: most of what a small mask
    costs to pack)."""
    if not t.is_cpu:
        return None
    return _backend.load_extension()[0]


@dataclass
class PackedMask:
    """A boolean tensor stored as 1 bit per element (``bitpack``'s layout)."""

    data: torch.Tensor
    shape: torch.Size

    @classmethod
    def of(cls, mask: torch.Tensor) -> PackedMask:
        kernels = _mask_kernels(mask)
        if kernels is None or mask.dtype != torch.bool:
            return cls(pack_mask(mask), mask.shape)
        return cls(kernels.pack_mask(mask.contiguous()), mask.shape)

    @classmethod
    def positive(cls, x: torch.Tensor) -> PackedMask:
        """The mask of ``x > 0`` (a ReLU's output), packed without the bool tensor on CPU."""
        kernels = _mask_kernels(x)
        if kernels is None or not x.is_floating_point():
            return cls.of(x > 0)
        return cls(kernels.pack_positive(x.contiguous()), x.shape)

    def unpack(self) -> torch.Tensor:
        kernels = _mask_kernels(self.data)
        if kernels is None:
            return unpack_mask(self.data, self.shape)
        return kernels.unpack_mask(self.data.contiguous(), self.shape)

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` where the mask is set, else 0 (``values`` shaped like the mask): one pass
        over the packed bits on CPU, where unpacking and ``torch.where`` took ten times as
        long as torch's own ReLU backward."""
        kernels = _mask_kernels(values)
        if kernels is None or not values.is_floating_point() or values.shape != self.shape:
            return torch.where(self.unpack(), values, 0)
        return kernels.mask_select(values.contiguous(), self.data.contiguous())


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
            layout.append(('mask', 1, item.shape))
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
            items.append(PackedMask(chunk[0], meta))
        else:
            items.append(chunk[0])
    return items
