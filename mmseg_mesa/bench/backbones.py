"""UPerNet around any backbone mmpretrain builds: mmseg's ``upernet_swin`` model with its backbone
replaced and its heads fitted to what that backbone returns.

The heads' ``in_channels`` / ``in_index`` come from the backbone itself (built alone and run
once without gradients at the size it will be measured at), so a table of backbones needs no
channel lists. Backbones whose maps share one resolution (plain ViTs, isotropic ConvMixer / ViG)
get mmseg's ``MultiLevelNeck``, as mmseg's ViT-UPerNet configs do.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import torch

from .sweep import configs_root

BASE = '_base_/models/upernet_swin.py'
LEVELS = 4  # UPerHead's inputs: the last four maps the backbone returns
NECK_SCALES = (4, 2, 1, 0.5)  # mmseg's ViT-UPerNet: strides 4, 8, 16, 32 from one of 16


def output_maps(backbone: dict, size: int, batch: int = 2) -> list[tuple[int, int, int]]:
    """``(channels, height, width)`` of each map ``backbone`` returns for ``batch`` random
    ``size`` x ``size`` images (in eval mode: batch norms see a 1x1 map in some at 128)."""
    import mmpretrain.models  # noqa: F401  registers the ``mmpretrain.`` types
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    model = MODELS.build(dict(backbone))
    model.eval()  # not chained: some backbones' ``train()`` returns None
    with torch.no_grad():
        outputs = model(torch.randn(batch, 3, size, size))
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    shapes = []
    for i, out in enumerate(outputs):
        if not torch.is_tensor(out) or out.dim() != 4:
            what = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ValueError(f'output {i} is {what}, not an (N, C, H, W) map')
        shapes.append(tuple(out.shape[1:]))
    return shapes


def upernet_config(backbone: dict, size: int, batch: int = 2) -> Any:
    """mmseg's UPerNet (``upernet_swin``'s heads, random weights) around ``backbone``, a model
    config such as ``dict(type='mmpretrain.ConvNeXt', arch='atto', out_indices=(0, 1, 2, 3))``.

    A backbone config with ``img_size`` gets ``size`` (position embeddings, window layouts),
    as a pair where it gave a pair. The decode head reads the last ``LEVELS`` maps, the
    auxiliary head the second-to-last of those (stride 16 in a four-stage backbone, as in the
    base config)."""
    from mmengine.config import Config, ConfigDict
    backbone = dict(backbone)
    if 'img_size' in backbone:  # an int stays an int: LeViT's divides it
        paired = isinstance(backbone['img_size'], (tuple, list))
        backbone['img_size'] = (size, size) if paired else size
    shapes = output_maps(backbone, size, batch)
    cfg = Config.fromfile(osp.join(configs_root(), BASE))
    cfg.custom_imports = dict(imports=['mmpretrain.models'], allow_failed_imports=False)
    model = cfg.model
    model.backbone = ConfigDict(backbone)
    channels = [c for c, _, _ in shapes]
    if len({shape[1:] for shape in shapes}) == 1 and len(shapes) > 1:  # one resolution: a ViT
        scales = list(NECK_SCALES[:len(shapes)])
        model.neck = ConfigDict(type='MultiLevelNeck', in_channels=channels,
                                out_channels=channels[-1], scales=scales)
        channels = [channels[-1]] * len(scales)
    index = list(range(len(channels)))[-LEVELS:]
    model.decode_head.in_channels = [channels[i] for i in index]
    model.decode_head.in_index = index
    aux = index[-2] if len(index) > 1 else index[-1]
    model.auxiliary_head.in_channels = channels[aux]
    model.auxiliary_head.in_index = aux
    return cfg
