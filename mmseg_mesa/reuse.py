"""Codes one layer offers the next: one 8-bit copy where two layers save the same tensor.

An attention map is saved by its softmax and again by ``attn @ v``; a GELU's input by the GELU
and its output by the next Linear; a LayerNorm's normalized input by the norm and its output (a
per-channel affine of it) by the next Linear. The layer that packs first offers its codes for
the tensor (``attach_codes``, through the hand-off ``handoff.CODES``); a later layer that saves
the same tensor takes them (``packed_reusing``) when they are what its own quantizer would
store, and packs again otherwise.

``count_reuse`` makes that visible: per layer type, how many saves took attached codes (hits),
how many found codes they could not use (misses, with the reason: a preset whose 4-bit norm
codes cannot serve an 8-bit Linear), and how many found none on offer.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .codes import Codes, QuantSpec
from .handoff import CODES
from .state import REUSE_COUNTERS as _COUNTING

__all__ = ['ReuseCounts', 'attach_codes', 'attached_codes', 'count_reuse', 'offers_codes',
           'packed_reusing']


def attach_codes(x: torch.Tensor, packed: Codes) -> None:
    """Offer ``packed`` (codes that decode to ``x``) to the next layer that saves ``x``."""
    CODES.offer(x, packed)


def mismatch(x: torch.Tensor, packed: Codes, spec: QuantSpec) -> str | None:
    """Why codes attached to ``x`` are not what ``spec`` would store (None: they are)."""
    if packed.shape != x.shape:
        return 'other shape'
    if packed.bits != spec.bits:
        return f'{packed.bits}-bit codes, {spec.bits}-bit wanted'
    if packed.group_dim != spec.group_dim % x.dim() or packed.group_size != spec.group_size:
        return 'other groups'
    if packed.backend != spec.backend:
        return 'other backend'
    return None


def attached_codes(x: torch.Tensor, spec: QuantSpec,
                   dtype: torch.dtype | None = None) -> Codes | None:
    """The codes ``attach_codes`` left on ``x`` when they are what ``spec`` would store (same
    bits, groups and backend) and ``x`` has not been modified in place since; else None.

    ``dtype`` is what they decode to (the layer's compute dtype; ``x``'s by default).
    """
    packed = CODES.get(x)
    if packed is None or mismatch(x, packed, spec) is not None:
        return None
    return packed if dtype in (None, packed.dtype) else replace(packed, dtype=dtype)


def offers_codes(x: torch.Tensor) -> bool:
    """Whether a layer offered codes of ``x`` (a softmax's map) that are still current."""
    return CODES.get(x) is not None


@dataclass
class ReuseCounts:
    """Saves by the layer type of the quantizer that made them (``'?'``: not in the model)."""

    hits: Counter = field(default_factory=Counter)
    misses: Counter = field(default_factory=Counter)  # (layer type, reason)
    none_offered: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        lines = []
        for kind in sorted(set(self.hits) | {k for k, _ in self.misses} | set(self.none_offered)):
            missed = {r: n for (k, r), n in self.misses.items() if k == kind}
            lines.append(f'{kind}: {self.hits[kind]} reused, {sum(missed.values())} packed again'
                         + ''.join(f' ({n} x {r})' for r, n in sorted(missed.items()))
                         + f', {self.none_offered[kind]} with nothing on offer')
        return '\n'.join(lines)




@contextlib.contextmanager
def count_reuse(model: nn.Module) -> Iterator[ReuseCounts]:
    """Count, inside the block, the saves of ``model``'s layers that reused attached codes."""
    from .quantizer import ActivationQuantizer
    owners = {}
    for module in model.modules():
        kind = getattr(module, 'mesa_original_type', type(module).__name__)
        sites = getattr(module, 'mesa_sites', {})  # a functional module's call sites
        for child in (*module.children(), *sites.values()):
            if isinstance(child, ActivationQuantizer):
                owners.setdefault(id(child), kind)  # a container of sites comes later
    counts = ReuseCounts()
    _COUNTING.append((counts, owners))
    try:
        yield counts
    finally:
        _COUNTING.remove((counts, owners))


def _record(quantizer: Any, outcome: str, reason: str | None = None) -> None:
    for counts, owners in _COUNTING:
        kind = owners.get(id(quantizer), '?')
        if outcome == 'hit':
            counts.hits[kind] += 1
        elif outcome == 'miss':
            counts.misses[kind, reason] += 1
        else:
            counts.none_offered[kind] += 1


def packed_reusing(x: torch.Tensor, cast: torch.Tensor, quantizer: Any) -> Codes:
    """What a layer saves of its input ``x``: the codes another layer attached to ``x`` when
    ``quantizer`` is an ``ActivationQuantizer`` that would store the same, decoding to ``cast``'s
    dtype; else ``cast`` (``x`` as the layer's op sees it) packed by ``quantizer``."""
    from .quantizer import ActivationQuantizer
    if isinstance(quantizer, ActivationQuantizer):
        found = attached_codes(x, quantizer.spec, cast.dtype)
        if found is not None:
            if _COUNTING:
                _record(quantizer, 'hit')
            return found
        if _COUNTING:
            offered = CODES.get(x)
            if offered is not None:
                _record(quantizer, 'miss', mismatch(x, offered, quantizer.spec))
            elif CODES.stale(x):
                _record(quantizer, 'miss', 'modified in place since')
            else:
                _record(quantizer, 'none')
    return quantizer.pack(cast)
