"""Train a segmentor with mmseg, with Mesa when the config sets ``mesa`` (same CLI as mmseg's).

    python tools/train.py configs/swin/mesa_swin-tiny_upernet_8xb2-160k_ade20k-512x512.py
    python tools/train.py ANY_MMSEG_CONFIG.py --cfg-options mesa=True
    python tools/train.py CONFIG --compile    # the training forward through torch.compile
"""
from __future__ import annotations

import argparse
import logging

from mmengine.config import Config
from mmengine.logging import print_log
from mmengine.runner import Runner
from mmseg.registry import RUNNERS

from mmseg_mesa.integrations import enable_mesa_in_config
from mmseg_mesa.integrations.cli import add_runner_arguments, load_runner_config, parse_runner_args
from mmseg_mesa.integrations.runner import add_hook


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a segmentor (with Mesa if configured)')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--resume', action='store_true', default=False,
                        help='resume from the latest checkpoint in the work_dir automatically')
    parser.add_argument('--amp', action='store_true', default=False,
                        help='enable automatic-mixed-precision training')
    parser.add_argument('--compile', action='store_true', default=False,
                        help='compile the training forward with torch.compile after the first '
                             'iteration (CompileHook; baseline and Mesa alike)')
    add_runner_arguments(parser)
    return parse_runner_args(parser)


def build_config(args: argparse.Namespace) -> Config:
    cfg = load_runner_config(args)
    if args.amp:
        if cfg.optim_wrapper.type == 'AmpOptimWrapper':
            print_log('AMP training is already enabled in your config.', logger='current',
                      level=logging.WARNING)
        elif cfg.optim_wrapper.type != 'OptimWrapper':
            raise ValueError('--amp is only supported when the optimizer wrapper type is '
                             f'OptimWrapper, got {cfg.optim_wrapper.type}')
        else:
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'
    cfg.resume = args.resume
    if args.compile:
        add_hook(cfg, 'CompileHook')
    enable_mesa_in_config(cfg)  # validates `mesa` before anything is built
    return cfg


def main() -> None:
    cfg = build_config(parse_args())
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    runner.train()


if __name__ == '__main__':
    main()
