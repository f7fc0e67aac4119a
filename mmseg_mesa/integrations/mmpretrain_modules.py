"""mmpretrain's modules: those in mmseg's ConvNeXt and PoolFormer configs, and its attention.

``LayerNorm2d`` subclasses ``nn.LayerNorm`` but has a forward of its own (channels first, or
last when the caller says so), so the LayerNorm handler leaves it; ``MesaLayerNorm2d`` runs the
same two layouts through Mesa's LayerNorm. ConvNeXt's and PoolFormer's blocks scale their branch
with a layer-scale vector of their own, which ``MesaFunctional`` packs (``functional_types``).
"""
from __future__ import annotations

import torch

from ..layers.base import MesaModule
from ..layers.norm import MesaLayerNormFunction


def layer_norm_2d_class() -> dict[type, type]:
    """mmpretrain's ``LayerNorm2d`` -> its Mesa class; empty without mmpretrain."""
    try:
        from mmpretrain.models.utils.norm import LayerNorm2d
    except ImportError:
        return {}

    class MesaLayerNorm2d(MesaModule, LayerNorm2d):
        """mmpretrain ``LayerNorm2d`` saving its normalized input as 8-bit codes per channel."""

        mesa_quantizers = {'quant_input': (-1, None)}

        def forward(self, x: torch.Tensor, data_format: str = 'channel_first') -> torch.Tensor:
            if not self.mesa_active(x, self.weight, self.bias) or x.dim() != 4 \
                    or data_format not in ('channel_first', 'channel_last'):
                return super().forward(x, data_format)
            channels_first = data_format == 'channel_first'
            if channels_first:
                x = x.permute(0, 2, 3, 1)
            x = MesaLayerNormFunction.apply(x, tuple(self.normalized_shape), self.weight,
                                            self.bias, self.eps, self.quant_input)
            return x.permute(0, 3, 1, 2).contiguous() if channels_first else x

    MesaLayerNorm2d.__module__ = __name__
    return {LayerNorm2d: MesaLayerNorm2d}


def layer_scale_block_types() -> tuple[type, ...]:
    """ConvNeXt's and PoolFormer's blocks (``x * gamma`` on their branch), where installed."""
    try:
        from mmpretrain.models.backbones.convnext import ConvNeXtBlock
        from mmpretrain.models.backbones.poolformer import PoolFormerBlock
    except ImportError:
        return ()
    return (ConvNeXtBlock, PoolFormerBlock)


def attention_types() -> tuple[type, ...]:
    """mmpretrain's ``MultiheadAttention`` (its ViTs, DeiT, ...), where installed: its forward
    calls ``F.scaled_dot_product_attention``, which ``MesaFunctional`` routes (``layers.sdpa``)."""
    try:
        from mmpretrain.models.utils.attention import MultiheadAttention
    except ImportError:
        return ()
    return (MultiheadAttention,)
