"""SegFormer's head with its fusion conv run a block of samples at a time.

mmseg's ``SegformerHead.forward`` upsamples every level's 1x1 conv output to the first level's
size and concatenates them (MiT-B0 512x512: 64 MiB per image) before ``fusion_conv``. Where that
conv is a converted one, ``MesaSegformerHead`` builds the concatenation a block of samples at a
time (``fusion.fused_conv_module``) and saves the levels' codes before upsampling. The first
level is resized to its own size in mmseg, which returns it unchanged (tests hold the forward
bit-identical); it is concatenated as it is.
"""
from __future__ import annotations

import torch
from mmseg.models.decode_heads.segformer_head import SegformerHead

from ..config import MesaConfig
from .fusion import classified, fused_conv_module, fusion_quantizers, level_quantizers
from .modules import MesaDecodeHead
from .resize import Resize


class MesaSegformerHead(MesaDecodeHead, SegformerHead):
    """``SegformerHead`` with the banded loss of ``MesaDecodeHead`` and a lean fusion."""

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        self.mesa_fused_quantizers = level_quantizers(config, len(getattr(self, 'convs', ())))

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if not self.mesa_active(*inputs):
            return super().forward(inputs)
        inputs = self._transform_inputs(inputs)
        upsample = Resize(tuple(inputs[0].shape[2:]), self.interpolate_mode, self.align_corners)
        outs = [conv(x) for conv, x in zip(self.convs, inputs)]
        del inputs
        quantizers = fusion_quantizers(self.fusion_conv, self.mesa_fused_quantizers, outs)
        if quantizers is None:
            out = self.fusion_conv(torch.cat([upsample(x) for x in outs], dim=1))
        else:
            out = fused_conv_module(self.fusion_conv, quantizers, outs, upsample)
        return classified(self, [out])
