"""Training-step time of one mmseg config with and without Mesa, the modes interleaved.

    python tools/benchmark_speed.py [CONFIG] [--modes baseline mesa mesa:paper ...] [--batch 8]
        [--size 64 64] [--device cpu|cuda] [--iters 7] [--warmup 2] [--json PATH]
        [--profile MODE] [--count] [--cfg-options KEY=VALUE ...]

Every mode's model is built from the same weights (``mmseg_mesa.bench``'s builders and
modes) and takes one training step (forward, backward, the config's optimizer step) in turn,
``--iters`` rounds after ``--warmup`` rounds, so that a slow spell of a shared machine falls on
every mode alike. Prints the median step time per mode and its ratio to ``baseline``: the
median over rounds of the mode's step time over the baseline's in the same round, which a
machine whose speed drifts from round to round (a virtual machine's neighbours) shifts less
than the ratio of the two medians (also recorded, as ``ratio_of_medians``).
``--profile MODE`` also records one forward + backward step of that mode with torch.profiler and
prints the operators that take the most self time. ``--count`` also counts, per mode, the kernel
ops and host synchronisations of one forward + backward (``mmseg_mesa.bench.dispatch``: what a
GPU launches and waits for, with the CPU on a device's branches), and the syncs a mode adds to
the baseline's with where they are called. ``mmseg_mesa`` is imported as installed (or
from ``PYTHONPATH``), so the same command measures another checkout.
"""
from __future__ import annotations

import argparse
import os.path as osp

import torch

from mmseg_mesa.bench.memory import build_optimizer, prepare
from mmseg_mesa.bench.models import (
    add_model_arguments,
    make_batch,
    model_setup,
    write_json,
)
from mmseg_mesa.bench.speed import (
    dispatch_counts,
    format_counts,
    interleaved_times,
    profile_step,
    step_times,
)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO_CONFIG = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_model_arguments(parser, DEMO_CONFIG, batch=8)
    parser.add_argument('--modes', nargs='+', default=['baseline', 'mesa'])
    parser.add_argument('--iters', type=int, default=7, help='timed rounds (median of these)')
    parser.add_argument('--warmup', type=int, default=2, help='untimed rounds first')
    parser.add_argument('--json', default=None)
    parser.add_argument('--profile', default=None, metavar='MODE',
                        help='profile one forward + backward step of this mode')
    parser.add_argument('--count', action='store_true',
                        help='count kernel ops and host syncs of one forward + backward')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = model_setup(args)
    size = setup.size
    batch = make_batch(setup.cfg, args.batch, size, args.device)
    models = {mode: prepare(setup.base, mode, setup.mesa_config) for mode in args.modes}
    optimizers = {mode: build_optimizer(model, setup.cfg) for mode, model in models.items()}
    times = interleaved_times(models, optimizers, batch, args.device, args.warmup, args.iters)
    results = dict(config=osp.relpath(args.config, ROOT), device=args.device, batch=args.batch,
                   size=list(size), iters=args.iters, warmup=args.warmup,
                   threads=torch.get_num_threads(), torch=torch.__version__,
                   modes=step_times(times))
    print(f'{results["config"]}: batch {args.batch}, {size[0]}x{size[1]}, {args.device}, '
          f'{torch.get_num_threads()} threads, median of {args.iters} steps')
    for mode, entry in results['modes'].items():
        ratio = f'{entry["ratio"]:.2f}x' if entry['ratio'] is not None else '-'
        print(f'  {mode:<24} {entry["step_time_s"] * 1e3:9.1f} ms  {ratio}')
    if args.profile:
        print(profile_step(models[args.profile], batch, args.profile, args.device))
    if args.count:
        results['counts'] = dispatch_counts(models, batch, args.device)
        print(format_counts(results['counts']))
    write_json(results, args.json)
    return results


if __name__ == '__main__':
    main()
