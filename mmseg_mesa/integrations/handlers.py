"""Handlers for mmcv / mmseg module types (registered when those packages import)."""
from __future__ import annotations

from ..convert import register_handler
from ..handlers import swap_to


def register_openmmlab_handlers() -> None:
    from mmcv.cnn.bricks.drop import DropPath
    from mmseg.models.backbones.swin import WindowMSA
    from mmseg.models.decode_heads.decode_head import BaseDecodeHead

    from .modules import MesaDecodeHead, MesaDropPath, MesaWindowMSA, decode_head_check

    register_handler(WindowMSA, 'attention', swap_to(MesaWindowMSA))
    register_handler(DropPath, 'droppath', swap_to(MesaDropPath),
                     lambda m: None if 0.0 < m.drop_prob < 1.0 else
                     f'drop_prob={m.drop_prob} saves no mask')
    register_handler(BaseDecodeHead, 'loss', swap_to(MesaDecodeHead), decode_head_check)
