"""Hand-offs: what one layer leaves for another layer that will meet the same tensor.

A layer sometimes knows something about a tensor it returns that a later layer needs: the 8-bit
codes it already made of it (so the next layer that saves it stores no second copy), or what a
saved tensor is (for saved-bytes reports). Such facts travel in one kind of object, a
``HandOff``: a map keyed by tensor identity that holds its entry exactly as long as the tensor
lives (torch's
``WeakTensorKeyDictionary``). No attribute is ever set on a tensor, and a layer reads a hand-off
only through the named instance below, so every coupling between layers is listed here.

These maps are process-wide state (``mmseg_mesa.state`` lists it all); each entry dies with its
tensor, so nothing outlives a training step.
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch
from torch.utils.weak import WeakTensorKeyDictionary

V = TypeVar('V')

__all__ = ['ALL', 'CODES', 'FEATURE_MAPS', 'MAPS', 'SAVED_LABEL', 'SCALE_FREE', 'HandOff', 'carry']


class HandOff(Generic[V]):
    """One kind of hand-off: ``offer(t, value)`` by the layer that knows, ``get(t)`` by the
    layer that needs it; the entry lives as long as ``t``. A ``versioned`` hand-off tells of
    ``t``'s values (codes of them, how to rebuild them, their layout): its entry holds only while
    ``t`` is unchanged since the offer (autograd's version counter), and ``get`` gives None
    after an in-place write."""

    def __init__(self, name: str, meaning: str, versioned: bool = False) -> None:
        self.name = name
        self.meaning = meaning
        self.versioned = versioned
        self._entries: Any = WeakTensorKeyDictionary()

    def offer(self, t: torch.Tensor, value: V) -> None:
        self._entries[t] = (value, t._version) if self.versioned else value

    def get(self, t: torch.Tensor) -> V | None:
        found = self._entries.get(t)
        if not self.versioned or found is None:
            return found
        return found[0] if found[1] == t._version else None

    def stale(self, t: torch.Tensor) -> bool:
        """Whether ``t`` has an entry that an in-place write since the offer made void."""
        found = self._entries.get(t)
        return self.versioned and found is not None and found[1] != t._version

    def carry(self, source: torch.Tensor, alias: torch.Tensor) -> None:
        """Offer ``alias`` (the same values as ``source``: its detached alias or copy) what
        ``source`` holds, where that still holds."""
        found = self._entries.get(source)
        if found is None:
            return
        if self.versioned:
            if found[1] != source._version:
                return
            found = found[0]
        self.offer(alias, found)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f'HandOff({self.name!r}: {self.meaning})'


# codes that decode to the tensor, offered by the layer that made them to the next layer that
# saves the same tensor (``reuse``).
CODES: HandOff[Any] = HandOff(
    'codes', 'codes of this tensor another layer may save instead of packing it again',
    versioned=True)
# What a saved tensor is, for saved-bytes reports (``memory.count_saved_tensors``); autograd
# packs a custom Function's saved tensors after its forward returns, so the label cannot be an
# argument of the pack hook.
SAVED_LABEL: HandOff[str] = HandOff('saved label', 'what this saved tensor is, for reports')
# a ``recomputed_map.Recipe``: how to rebuild this tensor in backward from codes a matmul node
# already keeps, offered along attention written op by op (logits, their scaled and biased forms,
# the softmax's map) to the next op that reads it (``recomputed_map``).
MAPS: HandOff[Any] = HandOff(
    'maps', 'how to rebuild this tensor from codes a matmul keeps, instead of saving it',
    versioned=True)
# a ``scale_free.Link``: offered by a layer whose parameters scale its output (a convolution, a
# BatchNorm's affine part), carried on by ops that scale with their input channel by channel
# (ReLU, a depthwise convolution), claimed by the training-mode BatchNorm that normalizes it,
# whose backward leaves there the exact part of those parameters' gradients along themselves
# (``scale_free``).
SCALE_FREE: HandOff[Any] = HandOff(
    'scale free', 'a BatchNorm after this tensor tells the layers that scale it what it knows')
# True: a feature map with its channels on dim 1, as a convolution or a norm over channels made
# it (``layout``).
FEATURE_MAPS: HandOff[bool] = HandOff(
    'feature maps', 'this tensor has its channels on dim 1', versioned=True)

ALL: tuple[HandOff, ...] = (CODES, SAVED_LABEL, MAPS, SCALE_FREE, FEATURE_MAPS)


def carry(source: torch.Tensor, alias: torch.Tensor) -> None:
    """Every hand-off of ``source`` offered to ``alias`` too: a compiled graph hands a Mesa
    module's outputs on as detached aliases of the tensors its layers offered for
    (``opaque``)."""
    for kind in ALL:
        kind.carry(source, alias)
