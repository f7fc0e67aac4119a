"""Which tensors are feature maps with their channels on dim 1.

A tensor's shape does not say where its channels are: a (B, H, W, C) map of tokens before a
Linear (ConvNeXt's MLP) looks like a (B, C, H, W) one. The layers that make feature maps know:
convolutions, BatchNorm and GroupNorm mark their outputs (the hand-off ``handoff.FEATURE_MAPS``),
and a layer after them may group its codes by channel or keep what suits a map no Linear reads
(GELU keeps its derivative there).
"""
from __future__ import annotations

import torch

from ..handoff import FEATURE_MAPS

__all__ = ['channels_first', 'mark_channels_first']


def mark_channels_first(y: torch.Tensor) -> torch.Tensor:
    """Say that ``y`` (returned by the caller) has its channels on dim 1."""
    FEATURE_MAPS.offer(y, True)
    return y


def channels_first(x: torch.Tensor) -> bool:
    """Whether a layer marked ``x`` as a channels-first feature map and it is unchanged since."""
    return FEATURE_MAPS.get(x) is True
