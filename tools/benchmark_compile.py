"""One mmseg config under torch.compile, baseline and Mesa, next to eager.

    python tools/benchmark_compile.py [CONFIG] [--batch 2] [--size 128 128] [--steps 3]
        [--iters 5] [--device cpu|cuda] [--no-explain] [--json PATH] [--cfg-options ...]

For the baseline and the Mesa model (built from the same weights), after one eager step (in which
Mesa's generic path settles which modules stay converted, as ``CompileHook`` does),
``torch.compile(model)`` runs ``--steps`` training steps (forward, backward, the config's optimizer
step): the first step's time (the compile), the graphs and graph breaks it meets, and the
recompiles after it. Then eager and compiled steps of both are timed interleaved, ``--iters``
rounds (median), and the ratios are to the eager baseline (on a GPU with each mode's step peak,
``torch.cuda.max_memory_allocated``). ``torch._dynamo.explain`` over one Mesa
forward lists the graph breaks whose frame is in ``mmseg_mesa`` (``--no-explain`` skips it). The
compiled Mesa step's gradients are compared with an eager Mesa step's from the same seed, and two
eager draws give the yardstick. Random ops draw from torch's generator in compiled code too
(``mmseg_mesa.bench.compiled.same_random``)."""
from __future__ import annotations

import argparse
import copy
import os.path as osp
import statistics

import torch

from mmseg_mesa.bench.compiled import (
    break_sites,
    first_steps,
    gradient_match,
    same_random,
    step_gradients,
    summary,
    timed_step,
)
from mmseg_mesa.bench.memory import build_optimizer, prepare
from mmseg_mesa.bench.models import (
    add_model_arguments,
    make_batch,
    model_setup,
    write_json,
)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO_CONFIG = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_model_arguments(parser, DEMO_CONFIG, batch=2)
    parser.add_argument('--steps', type=int, default=3, help='compiled steps counted')
    parser.add_argument('--iters', type=int, default=5, help='timed rounds (median of these)')
    parser.add_argument('--no-explain', action='store_true')
    parser.add_argument('--json', default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = model_setup(args)
    cfg, size = setup.cfg, setup.size
    batch = make_batch(cfg, args.batch, size, args.device)
    models = {mode: prepare(setup.base, mode, setup.mesa_config) for mode in ('baseline', 'mesa')}
    result: dict = dict(config=osp.relpath(args.config, ROOT), device=args.device,
                        batch=args.batch, size=list(size), threads=torch.get_num_threads(),
                        torch=torch.__version__, modes={})
    with same_random():
        eager_mesa = copy.deepcopy(models['mesa'])
        losses = dict(baseline=step_gradients(models['baseline'], models['baseline'], batch)[0])
        losses['mesa'], eager = step_gradients(eager_mesa, eager_mesa, batch)
        _, eager_again = step_gradients(eager_mesa, eager_mesa, batch)
        for model in models.values():  # a first eager step settles the conversion
            step_gradients(model, model, batch)
        compiled = {mode: torch.compile(model) for mode, model in models.items()}
        optimizers = {mode: build_optimizer(model, cfg) for mode, model in models.items()}
        for mode in models:
            counts, losses[f'{mode} compiled'], grads = first_steps(
                compiled[mode], models[mode], batch, args.steps, optimizers[mode])
            result['modes'][f'{mode} compiled'] = counts
            if mode == 'mesa':
                result['gradients'] = gradient_match(grads, eager, eager_again)
        result['losses'] = losses
        times: dict[str, list[float]] = {m: [] for m in
                                         ('baseline', 'mesa', 'baseline compiled',
                                          'mesa compiled')}
        peaks: dict[str, int] = {}
        for _ in range(args.iters):
            for mode in models:
                for name, forward in ((mode, models[mode]), (f'{mode} compiled', compiled[mode])):
                    if args.device == 'cuda':
                        torch.cuda.reset_peak_memory_stats()
                    times[name].append(timed_step(forward, models[mode], batch,
                                                  optimizers[mode]))
                    if args.device == 'cuda':
                        peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated())
    for mode, values in times.items():
        result['modes'].setdefault(mode, {})['step_s'] = statistics.median(values)
        if mode in peaks:
            result['modes'][mode]['cuda_peak_bytes'] = peaks[mode]
    result['modes'] = {m: result['modes'][m] for m in times}
    if not args.no_explain:
        result['breaks'] = break_sites(copy.deepcopy(eager_mesa), batch)
    print(f'{result["config"]}: batch {args.batch}, {size[0]}x{size[1]}, {args.device}, '
          f'{torch.get_num_threads()} threads')
    print(summary(result))
    write_json(result, args.json)
    return result


if __name__ == '__main__':
    main()
