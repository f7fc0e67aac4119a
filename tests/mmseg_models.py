"""mmseg's own ADE20K models (from its installed configs) and batches for tests, by config name,
through ``mmseg_mesa.bench.models``."""
from __future__ import annotations

import os.path as osp

import mmseg
import torch
from mmengine.config import Config

from mmseg_mesa.bench.models import build_segmentor, load_config, random_batch

SWIN_T = 'swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
DEIT_S = 'vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py'
VIT_B_MLN = 'vit/vit_vit-b16_mln_upernet_8xb2-80k_ade20k-512x512.py'


def upstream_path(name: str) -> str:
    return osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs', name)


def upstream_config(name: str) -> Config:
    """An mmseg config as installed with mmseg (what ``mmseg::NAME`` inherits)."""
    return Config.fromfile(upstream_path(name))


def build_model(name: str, seed: int = 0, init_weights: bool = True,
                options: dict | None = None) -> torch.nn.Module:
    """The config's model, randomly initialised (no pretrained download), SyncBN reverted as
    mmengine does in single-process runs. ``init_weights=False`` keeps the construction-time
    values (zero position embeddings and class tokens in mmseg's ViTs). ``options`` are merged
    into the config as ``--cfg-options`` are (e.g. a smaller ``model.backbone.img_size``)."""
    cfg = load_config(upstream_path(name), options)
    cfg.model.backbone.init_cfg = None  # also where the config leaves it to the backbone
    return build_segmentor(cfg, seed=seed, init_weights=init_weights)


def batch(size: int, n: int = 2, seed: int = 0, classes: int = 150):
    """Random images and labels; each sample also has the boundary map PIDNet's loss reads
    (``gt_edge_map``), which other heads ignore."""
    return random_batch(n, (size, size), classes, seed=seed)


def total_loss(losses: dict) -> torch.Tensor:
    return sum(v for k, v in losses.items() if k.startswith(('decode', 'aux')) and 'loss' in k)
