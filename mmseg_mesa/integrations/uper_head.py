"""UPerHead whose FPN fusion never holds its concatenated features for the whole batch.

mmseg's ``UPerHead._forward_feature`` keeps the ``laterals`` list alive through the bottleneck
and builds the list of upsampled FPN outputs next to their concatenation: on Swin-T UPerNet that
concatenation alone is 128 MiB per image, most of what the step peak grows by per image
(docs/benchmarks.md). ``MesaUPerHead`` runs the same modules and ops in the same order, drops the
laterals once they are used and adds each top-down level into the finer lateral's storage, a block
of samples upsampled at a time (``layers.upsample_add``). Where the bottleneck is a converted conv
it builds the concatenation and convolves it a block of samples at a time
(``layers.level_fusion``), saving the FPN outputs' codes before upsampling; otherwise it writes
each FPN output into its channel slice of one buffer as soon as it exists (``concat_channels``),
freed once the conv has run (``releasing_input``). Either way forward is bit-identical. Given a
``FeatureList`` (``MesaEncoderDecoder``), it also drops each input level once its lateral conv has
read it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from mmseg.models.decode_heads.uper_head import UPerHead

from ..config import MesaConfig
from ..layers.autocast import returns_owned
from ..layers.level_fusion import channels_last
from ..layers.upsample_add import upsample_add
from .fusion import (
    classified,
    fused_conv_module,
    fusion_quantizers,
    level_quantizers,
    releasing_input,
)
from .modules import MesaDecodeHead
from .resize import Resize
from .segmentor import FeatureList


class WriteChannels(torch.autograd.Function):
    """``buffer[:, start:start + piece.shape[1]] = piece`` in place: one step of a concatenation.

    Backward passes ``grad`` on unchanged (every other piece reads only its own slice) and gives
    ``piece`` a copy of its slice. ``copy_`` into a view would record ``CopySlices``, which clones
    the whole gradient once per piece; a view of the slice would keep the whole gradient alive
    until the last piece's backward has run (the first FPN output's, after its whole branch).
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, buffer: torch.Tensor, piece: torch.Tensor, start: int
                ) -> torch.Tensor:
        ctx.start, ctx.stop, ctx.piece_dtype = start, start + piece.shape[1], piece.dtype
        buffer[:, start:ctx.stop].copy_(piece)
        ctx.mark_dirty(buffer)
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_piece = grad[:, ctx.start:ctx.stop].to(ctx.piece_dtype, copy=True)
        return (grad if ctx.needs_input_grad[0] else None), grad_piece, None


def cat_memory_format(pieces: list[torch.Tensor]) -> torch.memory_format:
    """The layout ``torch.cat`` gives 4-d inputs: channels-last only if all of them are."""
    if all(channels_last(p) for p in pieces):
        return torch.channels_last
    return torch.contiguous_format


def concat_channels(pieces: list[torch.Tensor | None],
                    upsample: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``torch.cat([pieces[0], *map(upsample, pieces[1:])], dim=1)`` with only one upsampled
    piece alive at a time: each is upsampled just before it is written, last first (mmseg's
    order), into one buffer of ``pieces[0]``'s spatial size.

    ``pieces`` is emptied as it goes (its entries are the only references the caller keeps).
    Dtype, layout and values are ``torch.cat``'s: the buffer has the promoted dtype of all pieces.
    """
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in pieces])
    channels = [p.shape[1] for p in pieces]
    first = pieces[0]
    buffer = torch.empty((first.shape[0], sum(channels), *first.shape[2:]), dtype=dtype,
                         device=first.device, memory_format=cat_memory_format(pieces))
    del first  # the first piece is freed once written
    starts = [sum(channels[:i]) for i in range(len(pieces))]
    for i in [0, *range(len(pieces) - 1, 0, -1)]:
        piece = pieces[i]
        pieces[i] = None
        if i:
            piece = upsample(piece)
        buffer = WriteChannels.apply(buffer, piece, starts[i])
        del piece
    return buffer


class MesaUPerHead(MesaDecodeHead, UPerHead):
    """``UPerHead`` with the banded loss of ``MesaDecodeHead`` and a lean FPN fusion."""

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        # the codes of the bottleneck's input, one FPN level each (FusedCodes)
        self.mesa_fused_quantizers = level_quantizers(
            config, len(getattr(self, 'lateral_convs', ())) + 1)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if not self.mesa_active(*inputs):
            return super().forward(inputs)
        return classified(self, [self._forward_feature(inputs)])

    def _forward_feature(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if not self.mesa_active(*inputs):
            return super()._forward_feature(inputs)
        # The steps of UPerHead._forward_feature (mmseg 1.2.2), in its order.
        features = self._transform_inputs(inputs)
        if isinstance(inputs, FeatureList):
            inputs.release(self.in_index)  # ours now hold them, and let go of each once read
        del inputs
        laterals = []
        for i, conv in enumerate(self.lateral_convs):
            laterals.append(conv(features[i]))
            features[i] = None
        laterals.append(self.psp_forward(features))
        del features
        levels = len(laterals)
        for i in range(levels - 1, 0, -1):
            laterals[i - 1] = upsample_add(laterals, i - 1, laterals[i], Resize(
                tuple(laterals[i - 1].shape[2:]), 'bilinear', self.align_corners))
        fpn_outs: list[torch.Tensor | None] = []
        for i in range(levels - 1):
            holder = [laterals[i]]
            laterals[i] = None  # used only here, and freed once the conv has read it
            fpn_outs.append(releasing_input(self.fpn_convs[i], holder))
        fpn_outs.append(laterals.pop())
        del laterals
        upsample = Resize(tuple(fpn_outs[0].shape[2:]), 'bilinear', self.align_corners)
        quantizers = fusion_quantizers(self.fpn_bottleneck, self.mesa_fused_quantizers, fpn_outs)
        if quantizers is not None:
            return fused_conv_module(self.fpn_bottleneck, quantizers, fpn_outs, upsample)
        fused = [concat_channels(fpn_outs, upsample)]  # the only reference: freed
        return releasing_input(self.fpn_bottleneck, fused)
