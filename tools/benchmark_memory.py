"""Peak memory, activation memory and step time of one mmseg config with and without Mesa.

    python tools/benchmark_memory.py [CONFIG] [--modes baseline mesa ...] [--batch 2]
        [--size 512 512] [--device cpu|cuda] [--iters N] [--json PATH] [--plot PATH]
        [--budget SIZE [SIZE ...] [--second-batch N] [--check] [--check-batch N] [--search]]
        [--checkpoint PATH] [--data-root DIR] [--sharpen F]

Every mode runs on the same inputs in this one process. For each: the **peak** tensor memory of
one full training step (forward, backward, the config's optimizer step; measured after one
warm-up step, so the optimizer state exists) with torch's ``MemTracker``, broken down by category
(parameters, gradients, optimizer state, activations, backward temporaries) and where the peak
happens (phase and module); on CUDA also ``torch.cuda.max_memory_allocated`` of that step. Then
the bytes saved for backward (deduplicated storages, parameters excluded), the median time of a
training step, ratios to ``baseline``, and the saved bytes by the type of module that saved them.
Modes: ``baseline``, ``mesa`` (the config's ``mesa`` setting: the default preset unless it says
otherwise), ``mesa:PRESET`` for every other preset of ``mmseg_mesa.config.PRESETS``
(``mesa:paper``, the paper's; ``mesa:stored-maps``), ``amp`` (autocast: fp16 on CUDA, bf16 on CPU),
``mesa+amp``, ``checkpoint`` (activation checkpointing of each backbone stage, as mmengine's
``activation_checkpointing`` does), ``mesa+checkpoint``. Any Mesa mode combines with ``+amp`` and
``+checkpoint`` (``mesa:paper+amp``).
``--checkpoint`` measures a checkpoint's weights and ``--data-root DIR`` a batch of the config's
training set under DIR instead of random images (without ``--budget``): what attention keeps
depends on how sharp its maps are (``MesaConfig.attention_refine_error``).
``--cfg-options`` changes the config as in ``tools/train.py``; ``mesa.*`` keys change what the
``mesa`` mode measures (e.g. ``--cfg-options "mesa.division=[conv2d,batchnorm]"``).

``--budget SIZE [SIZE ...]`` (GiB, or with a unit: ``4GiB``, ``512MiB``) answers "what fits?": for
each mode (default: baseline and every preset) it measures the step peak at ``--batch`` B and 2B
(``--second-batch N``: at N instead, where 2B would not fit the machine),
fits peak = fixed + per_image * batch (``mmseg_mesa.memory.BatchPlan``: the peak is close to affine
in the batch) and prints the fixed part, the growth per image (and its ratio to the baseline's:
at a large batch it sets what fits) and the largest batch whose predicted peak fits in each SIZE;
``--check`` then runs the first SIZE's batch once per mode and reports predicted against
measured, ``--check-batch N`` does the same at batch N; ``--search`` (CUDA) runs batches 1, 2,
4, ... and reports the largest whose step stayed within the first SIZE by
``torch.cuda.max_memory_allocated`` (what the allocator saw).
"""
from __future__ import annotations

import argparse
import os
import os.path as osp
import time

import torch

from mmseg_mesa.bench.fidelity import add_weight_options, apply_weight_options
from mmseg_mesa.bench.memory import (
    add_ratios,
    budget_modes,
    default_modes,
    format_plans,
    format_table,
    measure,
    mode_name,
    plan_batches,
    plot,
    prepare,
)
from mmseg_mesa.bench.models import (
    add_model_arguments,
    dataset_batch,
    make_batch,
    model_setup,
    write_json,
)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEFAULT_CONFIG = osp.join(
    ROOT, 'configs/swin/mesa_swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py')


def budget_bytes(value: str) -> int:
    """argparse's reading of --budget: a size in bytes (``mmseg_mesa.memory.parse_bytes``)."""
    from mmseg_mesa.memory import parse_bytes
    try:
        return parse_bytes(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_model_arguments(parser, DEFAULT_CONFIG, batch=2,
                        device='cuda' if torch.cuda.is_available() else 'cpu')
    modes = default_modes()
    parser.add_argument('--modes', nargs='+', default=None, type=mode_name,
                        help=f'default: {" ".join(modes)} (with --budget: '
                             f'{" ".join(budget_modes())})')
    parser.add_argument('--iters', type=int, default=None,
                        help='timed steps per mode (default: 1 on CPU, 5 on CUDA; 0: none)')
    parser.add_argument('--json', help='write the results as JSON here')
    parser.add_argument('--plot', help='write a PNG bar chart here')
    parser.add_argument('--budget', type=budget_bytes, nargs='+', default=None, metavar='SIZE',
                        help='predict the largest batch per mode whose step peak fits in each '
                             'SIZE (GiB, or with a unit: 4GiB, 512MiB), from peaks measured at '
                             '--batch B and 2B')
    parser.add_argument('--check', action='store_true',
                        help="with --budget: run the first SIZE's predicted batch once and "
                             'compare')
    parser.add_argument('--second-batch', type=int, default=None, metavar='N',
                        help='with --budget: the second batch of the fit (default: 2 x --batch)')
    parser.add_argument('--check-batch', type=int, default=None, metavar='N',
                        help='with --budget: run batch N once and compare with the prediction')
    parser.add_argument('--search', action='store_true',
                        help='with --budget, CUDA only: also run batches 1, 2, 4, ... and report '
                             'the largest whose step stayed within SIZE')
    add_weight_options(parser)
    args = parser.parse_args(argv)
    if args.data_root and args.budget is not None:
        parser.error('--data-root measures one batch of the training set; --budget fits random '
                     'batches of two sizes: give one of them')
    for flag in ('check', 'search', 'check_batch', 'second_batch'):
        if getattr(args, flag) and args.budget is None:
            parser.error(f'--{flag.replace("_", "-")} works on the budget of --budget: give '
                         '--budget SIZE')
    if args.check_batch is not None and args.check_batch < 1:
        parser.error(f'--check-batch must be at least 1, got {args.check_batch}')
    if args.second_batch is not None and args.second_batch == args.batch:
        parser.error(f'--second-batch must differ from --batch ({args.batch})')
    if args.search and args.device != 'cuda':
        parser.error('--search measures peak CUDA memory: it needs --device cuda')
    if args.batch < 1:
        parser.error(f'--batch must be at least 1, got {args.batch}')
    if args.modes is None:
        args.modes = budget_modes() if args.budget is not None else modes
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = model_setup(args)
    cfg, mesa_config, size, base = setup.cfg, setup.mesa_config, setup.size, setup.base
    iters = args.iters if args.iters is not None else (5 if args.device == 'cuda' else 1)
    apply_weight_options(base, args)
    if args.data_root:
        batch = dataset_batch(cfg, base, args.batch, args.data_root)
        size = tuple(batch[0].shape[-2:])
    else:
        batch = make_batch(cfg, args.batch, size, args.device)
    results: dict = dict(config=osp.relpath(args.config, ROOT), device=args.device,
                         batch=args.batch, size=list(size), iters=iters,
                         mesa=str(mesa_config), sharpen=args.sharpen,
                         checkpoint=args.checkpoint, data_root=args.data_root, modes={})
    if args.budget is not None:
        results.update(budget_bytes=args.budget[0], budget_gib=[b / 2 ** 30 for b in args.budget],
                       plans=plan_batches(base, cfg, args.modes, mesa_config, args.batch, size,
                                          args.device, args.budget, args.check, args.search,
                                          args.check_batch, args.second_batch))
        print(format_plans(results['plans'], size))
        write_json(results, args.json)
        return results
    mib = 2 ** 20
    for mode in args.modes:
        print(f'measuring {mode} ...', flush=True)
        start = time.perf_counter()
        model = prepare(base, mode, mesa_config)
        entry = results['modes'][mode] = measure(model, batch, mode, args.device, iters, cfg)
        del model
        print(f"  {mode}: step peak {entry['peak_bytes'] / mib:.0f} MiB ({entry['peak_phase']}: "
              f"{entry['peak_module'] or '-'}), saved {entry['saved_bytes'] / mib:.1f} MiB "
              f'[{time.perf_counter() - start:.0f} s]', flush=True)
        write_json(results, args.json)  # what is measured so far survives an interruption
    add_ratios(results)
    print(format_table(results))
    write_json(results, args.json)
    if args.plot:
        os.makedirs(osp.dirname(osp.abspath(args.plot)), exist_ok=True)
        plot(results, args.plot)
    return results


if __name__ == '__main__':
    main()
