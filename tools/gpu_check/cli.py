"""The command line of ``tools/gpu_check.py`` (its docstring says what each step does): the
options, checked, and the entry point that runs the steps or one child probe."""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import sys
from pathlib import Path

from .probes import load_check, report_env
from .runner import Check
from .settings import DRY_BUDGET_S, FILE_LIMIT_MIB, GPU_BUDGET_S, GPU_WORK
from .steps import run_steps


def parse_args(argv: list[str] | None = None, description: str | None = None
               ) -> argparse.Namespace:
    """The options of ``argv``; ``description`` heads ``--help``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--dry-run', action='store_true',
                        help='CPU, tiny sizes, nothing installed or built (what the test runs)')
    parser.add_argument('--out', default=os.environ.get('OUT'),
                        help='where results go (default: $OUT)')
    parser.add_argument('--work', default=None,
                        help=f'scratch folder (default: {GPU_WORK}, or OUT/../gpu_check_work '
                             'in a dry run); never inside OUT, which holds only the results')
    parser.add_argument('--budget', type=float, default=None,
                        help=f'seconds for the whole run (default: {GPU_BUDGET_S:g} on the GPU '
                             f'machine, {DRY_BUDGET_S:g} in a dry run: its steps are short, '
                             'unless the CPU is shared)')
    parser.add_argument('--wheels', default='.gpu-wheels', help='carried wheels and sdists')
    parser.add_argument('--cuda-arch', default=None, metavar='X.Y[;X.Y]',
                        help="TORCH_CUDA_ARCH_LIST of the extension's build (default: the "
                             "visible GPUs', torch's own choice)")
    parser.add_argument('--build-jobs', type=int, default=os.cpu_count() or 1,
                        help="MAX_JOBS of the extension's build (default: every core)")
    parser.add_argument('--file-limit-mib', type=float, default=FILE_LIMIT_MIB,
                        help='the largest file copied into OUT besides the results (a built '
                             'mmcv wheel; default: no limit), for a machine that returns only '
                             'small files')
    parser.add_argument('--python', default=sys.executable,
                        help='the Python every step runs (default: this one)')
    parser.add_argument('--only', type=lambda v: v.split(','), default=None,
                        metavar='STEP,...', help='run only these of the steps after the set-up '
                        '(tests, tests_cuda_default, kernels, syncs, train, memory_b2, memory_b8, '
                        'memory_presets_b2, ...; memory or memory_presets: both batches): a '
                        'rerun; env, install, mmcv and build_ext always run (quick once done)')
    parser.add_argument('--mmcv-build-s', type=float, default=0, metavar='SECONDS',
                        help="build mmcv's CPU ops from the carried sdist, in the background, "
                        'for at most this long before the stand-in is used instead (about '
                        '2,800 core-seconds: some 4 minutes on 12 cores, which the first '
                        'memory step waits for). Default: 0, the stand-in at once: Mesa, Swin '
                        'and UPerNet call no mmcv op')
    parser.add_argument('--report-env', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--load-check', nargs=2, metavar=('CONFIG', 'CHECKPOINT'),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report_env or args.load_check:
        return args
    if not args.out:
        parser.error('give --out DIR (or set OUT)')
    if args.budget is None:
        args.budget = DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S
    if args.work is None:
        args.work = (osp.join(osp.dirname(osp.abspath(args.out)), 'gpu_check_work')
                     if args.dry_run else GPU_WORK)
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    if work == out or out in work.parents:
        parser.error('--work must not be inside --out (OUT holds only the results)')
    return args


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """Run the steps, or print one child probe's JSON line; the exit status."""
    args = parse_args(argv, description)
    if args.report_env:
        print(json.dumps(report_env(), default=str))
        return 0
    if args.load_check:
        print(json.dumps(load_check(*args.load_check)))
        return 0
    return run_steps(Check(args))

