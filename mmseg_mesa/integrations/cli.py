"""What tools/train.py and tools/test.py share: mmseg's launcher flags and config loading."""
from __future__ import annotations

import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """``--work-dir``, ``--cfg-options``, ``--launcher`` and ``--local-rank``, as in mmseg."""
    parser.add_argument('--work-dir', help='the dir to save logs, models and metrics')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. mesa=True or mesa.bits=4')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def parse_runner_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if 'LOCAL_RANK' not in os.environ:  # torch.distributed.launch passes --local-rank instead
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def load_runner_config(args: argparse.Namespace) -> Config:
    """The config with the launcher, ``--cfg-options`` and the work dir applied (CLI first, then
    the config's own ``work_dir``, then ``work_dirs/<config name>``)."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    return cfg
