"""Training-step time of one mmseg config with and without Mesa, the modes interleaved.

    python tools/benchmark_speed.py [CONFIG] [--modes baseline mesa mesa:paper ...] [--batch 8]
        [--size 64 64] [--device cpu|cuda] [--iters 7] [--warmup 2] [--json PATH]
        [--profile MODE] [--cfg-options KEY=VALUE ...]

Every mode's model is built from the same weights (tools/benchmark_memory.py's builders and
modes) and takes one training step (forward, backward, the config's optimizer step) in turn,
``--iters`` rounds after ``--warmup`` rounds, so that a slow spell of a shared machine falls on
every mode alike. Prints the median step time per mode and its ratio to ``baseline``: the
median over rounds of the mode's step time over the baseline's in the same round, which a
machine whose speed drifts from round to round (a virtual machine's neighbours) shifts less
than the ratio of the two medians (also recorded, as ``ratio_of_medians``).
``--profile MODE`` also records one forward + backward step of that mode with torch.profiler and
prints the operators that take the most self time. ``mmseg_mesa`` is imported as installed (or
from ``PYTHONPATH``), so the same command measures another checkout.
"""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import statistics
import sys
import time

import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'tools'))
DEMO_CONFIG = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmark_memory import add_cfg_options
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', nargs='?', default=DEMO_CONFIG)
    parser.add_argument('--modes', nargs='+', default=['baseline', 'mesa'])
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'))
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--iters', type=int, default=7, help='timed rounds (median of these)')
    parser.add_argument('--warmup', type=int, default=2, help='untimed rounds first')
    parser.add_argument('--json', default=None)
    parser.add_argument('--profile', default=None, metavar='MODE',
                        help='profile one forward + backward step of this mode')
    add_cfg_options(parser)
    return parser.parse_args(argv)


def profile_step(model: torch.nn.Module, batch: tuple, mode: str, device: str,
                 rows: int = 15) -> str:
    """torch.profiler's table of one forward + backward step, by self time."""
    from benchmark_memory import forward_loss
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == 'cuda' else [])
    with profile(activities=activities) as prof:
        forward_loss(model, batch, mode, device).backward()
    model.zero_grad(set_to_none=True)
    key = 'self_cuda_time_total' if device == 'cuda' else 'self_cpu_time_total'
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from benchmark_memory import (
        build_model,
        build_optimizer,
        input_size,
        load_config,
        make_batch,
        prepare,
        run_step,
        synchronize,
    )

    from mmseg_mesa import MesaConfig
    cfg = load_config(args.config, args.cfg_options)
    mesa_config = MesaConfig.from_cfg(cfg.get('mesa', True)) or MesaConfig()
    size = input_size(args.size, cfg)
    base = build_model(cfg, args.device)
    batch = make_batch(cfg, args.batch, size, args.device)
    models = {mode: prepare(base, mode, mesa_config) for mode in args.modes}
    optimizers = {mode: build_optimizer(model, cfg) for mode, model in models.items()}
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for round_ in range(args.warmup + args.iters):
        for mode, model in models.items():
            synchronize(args.device)
            start = time.perf_counter()
            run_step(model, batch, mode, args.device, optimizers[mode])
            synchronize(args.device)
            if round_ >= args.warmup:
                times[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    baseline = medians.get('baseline')
    paired = {mode: statistics.median(t / b for t, b in zip(times[mode], times['baseline']))
              for mode in args.modes} if baseline else {}
    results = dict(config=osp.relpath(args.config, ROOT), device=args.device, batch=args.batch,
                   size=list(size), iters=args.iters, warmup=args.warmup,
                   threads=torch.get_num_threads(), torch=torch.__version__, modes={
                       mode: dict(step_time_s=medians[mode], times_s=times[mode],
                                  ratio=paired.get(mode),
                                  ratio_of_medians=medians[mode] / baseline if baseline else None)
                       for mode in args.modes})
    print(f'{results["config"]}: batch {args.batch}, {size[0]}x{size[1]}, {args.device}, '
          f'{torch.get_num_threads()} threads, median of {args.iters} steps')
    for mode, entry in results['modes'].items():
        ratio = f'{entry["ratio"]:.2f}x' if entry['ratio'] is not None else '-'
        print(f'  {mode:<24} {entry["step_time_s"] * 1e3:9.1f} ms  {ratio}')
    if args.profile:
        print(profile_step(models[args.profile], batch, args.profile, args.device))
    if args.json:
        os.makedirs(osp.dirname(osp.abspath(args.json)), exist_ok=True)
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == '__main__':
    main()
