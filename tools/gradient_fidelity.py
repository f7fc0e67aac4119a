"""Mesa's parameter gradients next to the exact ones on one training step, with a yardstick.

    python tools/gradient_fidelity.py [CONFIG] [--presets config default paper ...]
        [--batch 2] [--size 128 128] [--no-init-weights] [--draws 1] [--batches 1]
        [--checkpoint PATH] [--sharpen F] [--data-root DIR] [--json PATH]
        [--cfg-options mesa.stochastic_rounding=False ...]

Builds the config's model (random weights unless ``--checkpoint``; SyncBN reverted), takes the
exact gradient of one training step on a random batch, then for each preset the Mesa gradient
of the same step, and prints:

- the relative error of the whole parameter-gradient vector, ``||g_mesa - g|| / ||g||``, of the
  mean over the draws so far and of the last draw alone;
- the worst cosine over parameters whose exact gradient norm is at least 1e-3 of the largest
  (smaller ones are float noise around an exact zero), and which parameter it is;
- as the yardstick, the minibatch noise: ``||g(A) - g(B)|| / ||g(A)||`` for the exact gradients
  of two independent batches A and B of the same size. Mesa's error must be small next to it
  to be harmless: SGD already follows gradients that are that far apart.

``--draws N`` averages N Mesa steps (different stochastic-rounding draws): unbiased rounding
makes the error of the mean fall like 1/sqrt(N), a bias would make it level off.
``--batches K`` also measures one step on each of K independent batches (seeds 0 .. K-1) and
prints each one's error and their coherence, ``||sum d_k|| / sqrt(sum ||d_k||^2)`` of the error
vectors: about 1 when they are independent, sqrt(K) when every batch has the same error (a bias
training would accumulate). It is the test for codes rounded to nearest, whose error no number of
draws changes.
``--sharpen F`` multiplies every attention's query and key projections by F: random weights
give nearly flat maps, while trained and pretrained ones (which segmentation starts from) give
sharp ones, whose logits 8-bit q and k replay less closely.
``--data-root DIR`` takes the batches from the config's own training set under DIR (its
pipeline and data preprocessor; ``--size`` is then the pipeline's) instead of random images: a
trained checkpoint's maps are as sharp as its data makes them.
``config`` in ``--presets`` is the config's own ``mesa`` setting (the default preset for a plain
mmseg config); ``--cfg-options mesa.KEY=VALUE`` changes it.
"""
from __future__ import annotations

import argparse
import copy
import math
import os.path as osp

from mmseg_mesa.bench.fidelity import (
    add_weight_options,
    apply_weight_options,
    build_reference,
    gradients,
    measure,
    measure_batches,
    mesa_config_for,
    relative_error,
    split,
)
from mmseg_mesa.bench.models import (
    add_cfg_options,
    dataset_batch,
    head_classes,
    input_size,
    load_config,
    make_batch,
    random_batch,
    write_json,
)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mmseg_mesa.config import PRESETS
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', nargs='?',
                        default=osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py'))
    parser.add_argument('--presets', nargs='+', default=['config'],
                        choices=['config', *PRESETS], help='MesaConfigs to measure')
    parser.add_argument('--draws', type=int, default=1)
    parser.add_argument('--batches', type=int, default=1,
                        help='also measure one step on each of this many independent batches')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help="input size; defaults to the config's crop_size")
    parser.add_argument('--no-init-weights', dest='init_weights', action='store_false',
                        help="skip the model's init_weights() (construction-time values)")
    add_weight_options(parser)
    parser.add_argument('--json', help='write the results as JSON here')
    add_cfg_options(parser)
    args = parser.parse_args(argv)
    for key in ('draws', 'batches', 'batch'):
        if getattr(args, key) < 1:
            parser.error(f'--{key} must be at least 1, got {getattr(args, key)}')
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    configs = {name: mesa_config_for(name, cfg) for name in args.presets}  # bad values fail here
    size = input_size(args.size, cfg)
    reference = build_reference(cfg, args.init_weights)
    apply_weight_options(reference, args)
    if args.data_root:
        batch, other = (dataset_batch(cfg, reference, args.batch, args.data_root, first)
                        for first in (0, args.batch))
        size = tuple(batch[0].shape[-2:])
    else:
        batch, other = split(make_batch(cfg, 2 * args.batch, size, 'cpu'), args.batch)
    # every step from the same state: a training forward may update state it reads (EMANet's
    # bases), so each one runs on a copy
    exact = gradients(copy.deepcopy(reference), batch)
    noise = relative_error(gradients(copy.deepcopy(reference), other), exact)
    results = dict(config=osp.relpath(osp.abspath(args.config), ROOT), size=list(size),
                   batch=args.batch, init_weights=args.init_weights,
                   checkpoint=args.checkpoint, sharpen=args.sharpen,
                   data_root=args.data_root, minibatch_noise=noise,
                   presets={})
    print(f"{results['config']}  size={size[0]}x{size[1]}  batch={args.batch}  "
          f"init_weights={args.init_weights}  sharpen={args.sharpen:g}  "
          f"images={args.data_root or 'random'}")
    print(f'minibatch noise (exact gradients of two batches): {noise:.4f}')
    print(f'{"preset":<12}{"draws":>6}{"rel. error":>12}{"/ noise":>9}{"this draw":>11}'
          f'{"worst cosine":>14}  parameter')
    if args.batches <= 1:
        batches = []
    elif args.data_root:
        batches = [dataset_batch(cfg, reference, args.batch, args.data_root, (2 + k) * args.batch)
                   for k in range(args.batches)]
    else:
        batches = [random_batch(args.batch, size, head_classes(cfg.model.decode_head), seed=seed)
                   for seed in range(args.batches)]
    for name, config in configs.items():
        results['presets'][name] = entry = measure(reference, batch, exact, config, args.draws)
        for row in entry['rows']:
            print(f"{name:<12}{row['draws']:6d}{row['relative_error']:12.5f}"
                  f"{row['relative_error'] / noise if noise else math.inf:9.3f}"
                  f"{row['draw_error']:11.5f}"
                  f"{row['worst_cosine']:14.6f}  {row['worst_parameter']}", flush=True)
        if batches:
            entry['batches'] = found = measure_batches(reference, batches, config)
            print(f"{name:<12}{args.batches} batches: rel. error "
                  + ' '.join(f'{e:.4f}' for e in found['relative_errors'])
                  + f"; coherence {found['coherence']:.2f} (1: independent, "
                  f"{math.sqrt(args.batches):.2f}: one bias)", flush=True)
    write_json(results, args.json)
    return results


if __name__ == '__main__':
    main()
