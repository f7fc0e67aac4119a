"""EncoderDecoder whose training forward lets a decode head drop feature levels it has used.

mmseg's ``EncoderDecoder.loss`` holds the neck's outputs until every head has run. The decode
head reads most of them once, at its start, and keeps only their compressed codes for backward,
yet the full-precision maps stay alive through the rest of the head, where a training step's
forward peaks (BEiT-B UPerNet's 160x160 and 80x80 levels, held through UPerHead's fusion).
``MesaEncoderDecoder`` hands the heads a ``FeatureList``, the one container of those maps, from
which a head may release the levels that no auxiliary head reads. The modules and ops run as
before and in the same order; only references are dropped.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from mmseg.models.segmentors.encoder_decoder import EncoderDecoder
from torch import nn

from ..layers.base import MesaModule


def head_levels(head: nn.Module, levels: int) -> set[int]:
    """The feature levels a decode head reads (``BaseDecodeHead._transform_inputs``), as
    indices in ``range(levels)``."""
    index = head.in_index
    indices = index if isinstance(index, Sequence) else [index]
    return {int(i) % levels for i in indices}


class FeatureList(list):
    """Feature maps handed down a segmentor's training forward, some of which may be dropped.

    The list is the only container of the maps: each head receives this very object, so a level
    set to None here is freed once the head drops its own reference. ``keep`` holds the levels
    a later head reads; they are never released.
    """

    def __init__(self, features: Iterable[torch.Tensor], keep: Iterable[int]) -> None:
        super().__init__(features)
        self.keep = frozenset(int(i) % len(self) for i in keep) if len(self) else frozenset()

    def release(self, levels: Iterable[int]) -> None:
        """Drop ``levels`` (indices, negative ones too) unless a later head reads them."""
        for i in levels:
            i = int(i) % len(self)
            if i not in self.keep:
                self[i] = None


class MesaEncoderDecoder(MesaModule, EncoderDecoder):
    """``EncoderDecoder`` whose training forward gives its heads a ``FeatureList`` that keeps
    the auxiliary heads' levels."""

    def mesa_active(self, *tensors: torch.Tensor | None) -> bool:
        # The images need no gradient; what matters is that a training step saves activations.
        # Under torch.compile the unconverted steps run (``MesaModule.mesa_active``).
        return bool(not torch.compiler.is_compiling() and self.training
                    and self.mesa_config.enabled and torch.is_grad_enabled())

    def auxiliary_levels(self, levels: int) -> set[int]:
        """The levels the auxiliary heads read: the decode head must leave them."""
        if not self.with_auxiliary_head:
            return set()
        heads = (self.auxiliary_head if isinstance(self.auxiliary_head, nn.ModuleList)
                 else [self.auxiliary_head])
        return set().union(*(head_levels(head, levels) for head in heads))

    def loss(self, inputs: torch.Tensor, data_samples: list) -> dict:
        if not self.mesa_active():
            return super().loss(inputs, data_samples)
        # The steps of EncoderDecoder.loss (mmseg 1.2.2), with the features in a FeatureList.
        x = self.extract_feat(inputs)
        features = FeatureList(x, keep=self.auxiliary_levels(len(x)))
        del x
        losses = dict()
        losses.update(self._decode_head_forward_train(features, data_samples))
        if self.with_auxiliary_head:
            losses.update(self._auxiliary_head_forward_train(features, data_samples))
        return losses
