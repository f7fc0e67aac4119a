"""Building mmseg's own ADE20K models (from its installed configs) and batches for tests."""
from __future__ import annotations

import os.path as osp

import mmseg
import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm
from mmengine.structures import PixelData
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample
from mmseg.utils import register_all_modules

SWIN_T = 'swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
DEIT_S = 'vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py'
VIT_B_MLN = 'vit/vit_vit-b16_mln_upernet_8xb2-80k_ade20k-512x512.py'


def upstream_config(name: str) -> Config:
    """An mmseg config as installed with mmseg (what ``mmseg::NAME`` inherits)."""
    return Config.fromfile(osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs', name))


def build_model(name: str, seed: int = 0, init_weights: bool = True,
                options: dict | None = None) -> torch.nn.Module:
    """The config's model, randomly initialised (no pretrained download), SyncBN reverted as
    mmengine does in single-process runs. ``init_weights=False`` keeps the construction-time
    values (zero position embeddings and class tokens in mmseg's ViTs). ``options`` are merged
    into the config as ``--cfg-options`` are (e.g. a smaller ``model.backbone.img_size``)."""
    register_all_modules()
    cfg = upstream_config(name)
    if options:
        cfg.merge_from_dict(options)
    cfg.model.pretrained = None
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(seed)
    model = revert_sync_batchnorm(MODELS.build(cfg.model))
    if init_weights:
        model.init_weights()
    return model


def batch(size: int, n: int = 2, seed: int = 0, classes: int = 150):
    """Random images and labels; each sample also has the boundary map PIDNet's loss reads
    (``gt_edge_map``), which other heads ignore."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 3, size, size, generator=gen)
    samples = []
    for _ in range(n):
        sample = SegDataSample()
        labels = torch.randint(0, classes, (1, size, size), generator=gen)
        sample.gt_sem_seg = PixelData(data=labels)
        sample.gt_edge_map = PixelData(data=(labels % 2).to(torch.uint8))
        sample.set_metainfo(dict(img_shape=(size, size), pad_shape=(size, size),
                                 ori_shape=(size, size)))
        samples.append(sample)
    return inputs, samples


def total_loss(losses: dict) -> torch.Tensor:
    return sum(v for k, v in losses.items() if k.startswith(('decode', 'aux')) and 'loss' in k)
