"""Test (and evaluate) a checkpoint with mmseg; works for checkpoints trained with or without Mesa.

Evaluation runs the unmodified torch layers (Mesa only changes what training saves for
backward), so a Mesa config's ``mesa`` key is ignored here and no conversion happens.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out DIR] [--cfg-options ...]
"""
from __future__ import annotations

import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.runner import Runner

from mmseg_mesa.integrations import allow_mmengine_checkpoints


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Test (and eval) a segmentor')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='directory for logs and evaluation metrics')
    parser.add_argument('--out', help='directory to save the segmentation results')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings (key=value)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args()
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main() -> None:
    args = parse_args()
    allow_mmengine_checkpoints()
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    cfg.load_from = args.checkpoint
    if args.tta:
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
    if args.out is not None:
        cfg.test_evaluator['output_dir'] = args.out
        cfg.test_evaluator['keep_results'] = True
    Runner.from_cfg(cfg).test()


if __name__ == '__main__':
    main()
