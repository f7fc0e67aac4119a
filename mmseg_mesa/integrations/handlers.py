"""Handlers for mmcv / mmseg module types (registered when those packages import)."""
from __future__ import annotations

from ..convert import register_handler
from ..handlers import swap_to


def register_openmmlab_handlers() -> None:
    from mmcv.cnn.bricks.drop import DropPath
    from mmseg.models.backbones.swin import WindowMSA

    from .modules import MesaDropPath, MesaWindowMSA

    register_handler(WindowMSA, 'attention', swap_to(MesaWindowMSA))
    register_handler(DropPath, 'droppath', swap_to(MesaDropPath),
                     lambda m: None if 0.0 < m.drop_prob < 1.0 else
                     f'drop_prob={m.drop_prob} saves no mask')
