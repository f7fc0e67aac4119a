"""Test (and evaluate) a checkpoint with mmseg; works for checkpoints trained with or without Mesa.

Evaluation runs the unmodified torch layers (Mesa only changes what training saves for
backward), so a Mesa config's ``mesa`` key is ignored here and no conversion happens.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out DIR] [--cfg-options ...]
"""
from __future__ import annotations

import argparse

from mmengine.runner import Runner

from mmseg_mesa.integrations import allow_mmengine_checkpoints
from mmseg_mesa.integrations.cli import add_runner_arguments, load_runner_config, parse_runner_args


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Test (and eval) a segmentor')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out', help='directory to save the segmentation results')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation')
    add_runner_arguments(parser)
    return parse_runner_args(parser)


def main() -> None:
    args = parse_args()
    allow_mmengine_checkpoints()
    cfg = load_runner_config(args)
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
