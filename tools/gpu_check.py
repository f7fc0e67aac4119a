"""The GPU run in one command: install what a bare GPU machine lacks, build the CUDA extension,
test it, measure it, and leave every result under OUT as it goes.

    bash tools/gpu_check.sh --out DIR                # on a GPU machine (or OUT=DIR)
    bash tools/gpu_check.sh --budget 510 --file-limit-mib 16 --cuda-arch 9.0   # a tighter one
    bash tools/gpu_check.sh --dry-run --out DIR      # here, on CPU, with .venv (the test runs it)

Steps, in order of value; each has its own timeout and all end within ``--budget`` seconds:

  env                 python, torch, CUDA, GPU, nvcc and which imports are missing (env.json)
  install             the carried wheels (.gpu-wheels/, tools/setup/prepare_gpu_wheels.sh)
                      into a --target folder on PYTHONPATH
  mmcv                mmcv 2.1.0: a carried wheel with ops if it loads; else, by default,
                      mmcv's Python part from the carried sdist with a stand-in for its compiled
                      ops (mmseg imports mmcv.ops at start; Mesa, Swin and UPerNet call no
                      mmcv op). --mmcv-build-s N builds the CPU ops in the background instead
                      (GPU hidden: CUDA ops would take far longer), with the stand-in if that
                      fails or takes longer than N seconds
  build_ext           mmseg_mesa._C (CPU kernels and CUDA for the visible GPUs, or
                      --cuda-arch; ``pip install --no-build-isolation -e .``)
  tests               tests/test_extension.py: kernel == reference bit for bit (CPU and CUDA
                      kernels), CUDA-kernel codes == CPU-kernel codes under both roundings
                      (summary.json's `cpu_cuda_codes`), DIVISION through the CUDA quantizer;
                      no test may skip on the GPU machine (tests.xml)
  tests_cuda_default  the layer / DIVISION / quantizer tests with torch's default device set to
                      the GPU, so their modules and tensors live there and backend='auto' takes
                      the kernels (less CPU autocast's; tests.xml)
  kernels             tools/benchmark_kernels.py (kernels.json)
  memory_bN           tools/benchmark_memory.py on Swin-T UPerNet 512x512: baseline and the
                      default preset in fp32 and AMP, batch 2 before the training run and 8
                      after it (memory.json; the ratios and their limits in summary.json)
  train               tools/train.py --amp on the demo config (fp16 with dynamic loss scale,
                      then bf16), finite losses, then the checkpoint in the plain config: a
                      strict state-dict load and tools/test.py (train.json)
  memory_presets_bN   the other presets in fp32 and AMP at both batches (into memory.json)

summary.json is rewritten at every step's start and end, gpu_check.log gets every line as it
comes, so a run killed at its limit still leaves what it did. OUT gets these 7 files and the
mmcv wheel when one was built there (carry it next time: put it in .gpu-wheels/; --file-limit-mib
leaves out a larger one, for a machine that returns only small files).

The code is the package gpu_check/ beside this file: settings.py holds the defaults (paths,
versions, cores, limits, timeouts) and the sizes of both runs.

The dry run is the same code on CPU with tiny sizes. It installs and builds nothing (the .venv
has it all and is shared), runs three tests of test_extension.py (their CPU cases run, their
CUDA cases skip) and one quantizer test through the default-device plugin, expects
benchmark_kernels.py to refuse without a GPU, runs tools/benchmark_memory.py on CPU on the demo
model (64x64, batch 2, three modes), trains without --amp (mmengine's AmpOptimWrapper needs a
GPU) and loads the checkpoint into the plain model but does not run tools/test.py.
"""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import sys
from pathlib import Path

from gpu_check.probes import load_check, report_env  # the package beside this file
from gpu_check.runner import Check
from gpu_check.settings import DRY_BUDGET_S, FILE_LIMIT_MIB, GPU_BUDGET_S, GPU_WORK
from gpu_check.steps import run_steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
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
                        '(tests, tests_cuda_default, kernels, train, memory_b2, memory_b8, '
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_env:
        print(json.dumps(report_env(), default=str))
        return 0
    if args.load_check:
        print(json.dumps(load_check(*args.load_check)))
        return 0
    return run_steps(Check(args))


if __name__ == '__main__':
    sys.exit(main())
