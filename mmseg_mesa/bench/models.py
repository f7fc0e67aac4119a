"""A config's model and a random batch for it: what every measurement starts from.

Loads an mmseg config without downloads (``--cfg-options`` merged), builds its model with
seeded random weights (SyncBN reverted, as mmengine does in one process) and a seeded random
batch for its decode head, or a batch of its own training set; with the loss the tools sum and
their JSON writer.
"""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
from dataclasses import dataclass
from typing import Any

import torch


def add_cfg_options(parser: argparse.ArgumentParser) -> None:
    from mmengine.config import DictAction
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help="override config settings, e.g. mesa.bits=4 (the `mesa` mode's "
                             "config) or mesa.division=[conv2d,batchnorm]")


def add_model_arguments(parser: argparse.ArgumentParser, default_config: str, batch: int,
                        device: str = 'cpu') -> None:
    """The arguments of a tool that measures one config: the config (``default_config`` where
    none is given), ``--batch``, ``--size`` (the config's crop by default), ``--device`` and
    ``--cfg-options``."""
    parser.add_argument('config', nargs='?', default=default_config)
    parser.add_argument('--batch', type=int, default=batch)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help="input size; defaults to the config's crop_size")
    parser.add_argument('--device', default=device, choices=['cpu', 'cuda'])
    add_cfg_options(parser)


@dataclass
class ModelSetup:
    """What a one-config tool measures from: the config (options merged), its ``mesa`` setting
    as a ``MesaConfig`` (the default where it has none), the input size and the unconverted
    model on the device."""

    cfg: Any
    mesa_config: Any
    size: tuple[int, int]
    base: torch.nn.Module


def model_setup(args: argparse.Namespace) -> ModelSetup:
    """``ModelSetup`` from ``add_model_arguments``'s arguments."""
    cfg = load_config(args.config, args.cfg_options)
    return ModelSetup(cfg, mesa_config_of(cfg), input_size(args.size, cfg),
                      build_model(cfg, args.device))


def mesa_config_of(cfg: Any) -> Any:
    """The config's ``mesa`` setting as a ``MesaConfig``: the default where it has none (the
    tools measure Mesa on plain mmseg configs too); a bad value fails here."""
    from ..config import MesaConfig
    return MesaConfig.from_cfg(cfg.get('mesa', True)) or MesaConfig()


def load_config(path: str, options: dict | None = None) -> Any:
    """The config with ``--cfg-options`` merged, ready to build without downloads."""
    from mmengine.config import Config
    cfg = Config.fromfile(path)
    if options:
        cfg.merge_from_dict(options)
    cfg.model.pretrained = None  # no downloads: memory does not depend on the weights
    if cfg.model.get('backbone', {}).get('init_cfg') is not None:
        cfg.model.backbone.init_cfg = None
    return cfg


def build_segmentor(cfg: Any, seed: int = 0, init_weights: bool = True) -> torch.nn.Module:
    """The config's model, its weights drawn after ``torch.manual_seed(seed)``, SyncBN reverted.
    ``init_weights=False`` keeps the modules' construction-time values (zero position
    embeddings and class tokens in mmseg's ViTs)."""
    import logging

    from mmengine.logging import MMLogger
    from mmengine.model import revert_sync_batchnorm
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    torch.manual_seed(seed)
    model = revert_sync_batchnorm(MODELS.build(cfg.model))
    if init_weights:
        MMLogger.get_current_instance().setLevel(logging.WARNING)  # it lists every tensor
        model.init_weights()
    return model


def build_model(cfg: Any, device: str) -> torch.nn.Module:
    """The config's model (seed 0, ``init_weights()``) on ``device``, in training mode."""
    return build_segmentor(cfg).to(device).train()


def head_classes(head: Any) -> int:
    """The classes a decode head's config predicts: the last head of a cascade (OCRNet), the
    kernel-generating head of an iterative one (K-Net)."""
    if isinstance(head, list):
        head = head[-1]
    if 'num_classes' not in head and 'kernel_generate_head' in head:
        head = head.kernel_generate_head
    return head.num_classes


def random_batch(n: int, size: tuple[int, int], classes: int, device: str = 'cpu',
                 seed: int = 0) -> tuple:
    """``n`` random images of ``size`` and random labels in ``range(classes)``, drawn from a
    generator seeded with ``seed``."""
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 3, *size, generator=gen).to(device)
    samples = []
    for _ in range(n):
        sample = SegDataSample()
        labels = torch.randint(0, classes, (1, *size), generator=gen)
        sample.gt_sem_seg = PixelData(data=labels.to(device))
        # the boundary map PIDNet's loss reads; other heads ignore it
        sample.gt_edge_map = PixelData(data=(labels % 2).to(torch.uint8).to(device))
        sample.set_metainfo(dict(img_shape=size, pad_shape=size, ori_shape=size))
        samples.append(sample)
    return inputs, samples


def load_weights(model: torch.nn.Module, path: str) -> None:
    """The weights of an mmengine checkpoint (or of a bare state dict) into ``model``, strictly:
    a missing or unexpected key fails."""
    from ..integrations.checkpoint import allow_mmengine_checkpoints
    allow_mmengine_checkpoints()
    state = torch.load(path, map_location='cpu')
    model.load_state_dict(state.get('state_dict', state))


def with_data_root(dataset: Any, data_root: str) -> Any:
    """A dataset config with its files under ``data_root``: a wrapper's (``RepeatDataset``'s
    ``dataset``, ``ConcatDataset``'s ``datasets``: mmseg's DRIVE and VOC-aug configs) inner
    datasets get it, not the wrapper, which takes no such argument."""
    inner = [dataset['dataset']] if 'dataset' in dataset else list(dataset.get('datasets', ()))
    for part in inner:
        with_data_root(part, data_root)
    if not inner:
        dataset['data_root'] = data_root
    return dataset


def dataset_batch(cfg: Any, model: torch.nn.Module, n: int, data_root: str, first: int = 0
                  ) -> tuple:
    """Samples ``first .. first + n - 1`` of the config's training set (``train_dataloader``'s
    dataset and pipeline, with its files under ``data_root``) through ``model``'s data
    preprocessor, as a training step gets them. A trained model's attention is as sharp as its
    own data makes it, which random images do not show. The pipeline's random transforms draw
    from Python's and NumPy's generators, seeded here, so a batch is the same in every run."""
    import copy
    import random

    import numpy as np
    from mmengine.dataset import pseudo_collate
    from mmengine.utils import import_modules_from_strings
    from mmseg.registry import DATASETS
    from mmseg.utils import register_all_modules
    register_all_modules()
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    dataset = DATASETS.build(with_data_root(copy.deepcopy(cfg.train_dataloader.dataset),
                                            data_root))
    if len(dataset) < first + n:
        raise ValueError(f'dataset_batch: the training set under {data_root} has '
                         f'{len(dataset)} samples; samples {first}..{first + n - 1} asked for')
    random.seed(first)
    np.random.seed(first)
    samples = [dataset[i] for i in range(first, first + n)]
    with torch.no_grad():
        data = model.data_preprocessor(pseudo_collate(samples), True)
    return data['inputs'], data['data_samples']


def make_batch(cfg: Any, batch: int, size: tuple[int, int], device: str) -> tuple:
    """``random_batch`` (seed 0) with the classes of the config's decode head."""
    return random_batch(batch, size, head_classes(cfg.model.decode_head), device)


def input_size(size: list[int] | None, cfg: Any) -> tuple[int, int]:
    """``--size H W`` if given, else the config's ``crop_size`` (512x512 when it has none)."""
    return tuple(size) if size else tuple(cfg.get('crop_size', (512, 512)))


def loss_of(losses: dict) -> torch.Tensor:
    return sum(v for k, v in losses.items() if 'loss' in k)


def write_json(results: dict, path: str | None) -> None:
    if path:
        os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
        with open(path, 'w') as f:
            json.dump(results, f, indent=2)
