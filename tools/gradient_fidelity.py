"""Mesa's parameter gradients next to the exact ones on one training step, with a yardstick.

    python tools/gradient_fidelity.py [CONFIG] [--presets config default max-saving ...]
        [--batch 2] [--size 128 128] [--no-init-weights] [--draws 1] [--checkpoint PATH]
        [--json PATH] [--cfg-options mesa.stochastic_rounding=False ...]

Builds the config's model (random weights unless ``--checkpoint``; SyncBN reverted), takes the
exact gradient of one training step on a random batch, then for each preset the Mesa gradient
of the same step, and prints:

- the relative error of the whole parameter-gradient vector, ``||g_mesa - g|| / ||g||``;
- the worst cosine over parameters whose exact gradient norm is at least 1e-3 of the largest
  (smaller ones are float noise around an exact zero), and which parameter it is;
- as the yardstick, the minibatch noise: ``||g(A) - g(B)|| / ||g(A)||`` for the exact gradients
  of two independent batches A and B of the same size. Mesa's error must be small next to it
  to be harmless: SGD already follows gradients that are that far apart.

``--draws N`` averages N Mesa steps (different stochastic-rounding draws): unbiased rounding
makes the error of the mean fall like 1/sqrt(N), a bias would make it level off.
``config`` in ``--presets`` is the config's own ``mesa`` setting (the default preset for a plain
mmseg config); ``--cfg-options mesa.KEY=VALUE`` changes it.
"""
from __future__ import annotations

import argparse
import copy
import math
import os.path as osp
import sys
from typing import Any

import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'tools'))

from benchmark_memory import (  # noqa: E402
    add_cfg_options,
    build_model,
    input_size,
    load_config,
    loss_of,
    make_batch,
    write_json,
)

Gradients = dict[str, torch.Tensor]
SIGNIFICANT = 1e-3  # parameters below this fraction of the largest gradient norm are not ranked


def gradients(model: torch.nn.Module, batch: tuple) -> Gradients:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same drop-path / dropout masks in every run
    loss_of(model(*batch, mode='loss')).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(got: Gradients, exact: Gradients) -> float:
    """``||got - exact|| / ||exact||`` over the whole gradient vector (a missing entry is 0)."""
    error = sum((got[n] - g if n in got else g).double().pow(2).sum() for n, g in exact.items())
    return float((error / sum(g.double().pow(2).sum() for g in exact.values())).sqrt())


def cosines(got: Gradients, exact: Gradients) -> dict[str, float]:
    """Cosine per parameter whose exact gradient is at least ``SIGNIFICANT`` of the largest."""
    largest = max(g.norm() for g in exact.values())
    return {n: torch.nn.functional.cosine_similarity(got[n].flatten().double(),
                                                     g.flatten().double(), dim=0).item()
            for n, g in exact.items() if g.norm() >= SIGNIFICANT * largest}


def worst_cosine(got: Gradients, exact: Gradients) -> float:
    return min(cosines(got, exact).values())


def build_reference(cfg: Any, init_weights: bool) -> torch.nn.Module:
    """The config's model on CPU in training mode; ``init_weights=False`` keeps the modules'
    construction-time values (zero position embeddings and class tokens in mmseg's ViTs)."""
    if init_weights:
        return build_model(cfg, 'cpu')
    from mmengine.model import revert_sync_batchnorm
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    torch.manual_seed(0)
    return revert_sync_batchnorm(MODELS.build(cfg.model)).train()


def split(batch: tuple, n: int) -> tuple[tuple, tuple]:
    inputs, samples = batch
    return (inputs[:n], samples[:n]), (inputs[n:], samples[n:])


def mesa_config_for(name: str, cfg: Any) -> Any:
    from mmseg_mesa import MesaConfig
    if name == 'config':
        return MesaConfig.from_cfg(cfg.get('mesa', True)) or MesaConfig()
    return MesaConfig.preset(name)


def measure(reference: torch.nn.Module, batch: tuple, exact: Gradients, config: Any,
            draws: int) -> dict:
    """Mesa's error on ``batch`` for one MesaConfig, after each of ``draws`` steps (averaged)."""
    from mmseg_mesa import convert_to_mesa
    model = copy.deepcopy(reference)
    convert_to_mesa(model, config=config)
    total: Gradients | None = None
    rows = []
    for draw in range(1, draws + 1):
        grads = gradients(model, batch)
        total = grads if total is None else {n: total[n] + grads[n] for n in grads}
        mean = {n: g / draw for n, g in total.items()}
        per_param = cosines(mean, exact)
        worst = min(per_param, key=per_param.get)
        rows.append(dict(draws=draw, relative_error=relative_error(mean, exact),
                         worst_cosine=per_param[worst], worst_parameter=worst,
                         cosines=per_param))
    return dict(config=str(config), rows=rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mmseg_mesa.config import PRESETS
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', nargs='?',
                        default=osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py'))
    parser.add_argument('--presets', nargs='+', default=['config'],
                        choices=['config', *PRESETS], help='MesaConfigs to measure')
    parser.add_argument('--draws', type=int, default=1)
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help="input size; defaults to the config's crop_size")
    parser.add_argument('--no-init-weights', dest='init_weights', action='store_false',
                        help="skip the model's init_weights() (construction-time values)")
    parser.add_argument('--checkpoint', help='weights to load (an mmengine checkpoint)')
    parser.add_argument('--json', help='write the results as JSON here')
    add_cfg_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
    cfg = load_config(args.config, args.cfg_options)
    configs = {name: mesa_config_for(name, cfg) for name in args.presets}  # bad values fail here
    size = input_size(args.size, cfg)
    reference = build_reference(cfg, args.init_weights)
    if args.checkpoint:
        from mmseg_mesa.integrations.checkpoint import allow_mmengine_checkpoints
        allow_mmengine_checkpoints()
        state = torch.load(args.checkpoint, map_location='cpu')
        reference.load_state_dict(state.get('state_dict', state))
    batch, other = split(make_batch(cfg, 2 * args.batch, size, 'cpu'), args.batch)
    exact = gradients(reference, batch)
    noise = relative_error(gradients(reference, other), exact)
    results = dict(config=osp.relpath(osp.abspath(args.config), ROOT), size=list(size),
                   batch=args.batch, init_weights=args.init_weights,
                   checkpoint=args.checkpoint, minibatch_noise=noise, presets={})
    print(f"{results['config']}  size={size[0]}x{size[1]}  batch={args.batch}  "
          f"init_weights={args.init_weights}")
    print(f'minibatch noise (exact gradients of two batches): {noise:.4f}')
    print(f'{"preset":<12}{"draws":>6}{"rel. error":>12}{"/ noise":>9}{"worst cosine":>14}  '
          'parameter')
    for name, config in configs.items():
        results['presets'][name] = entry = measure(reference, batch, exact, config, args.draws)
        for row in entry['rows']:
            print(f"{name:<12}{row['draws']:6d}{row['relative_error']:12.5f}"
                  f"{row['relative_error'] / noise if noise else math.inf:9.3f}"
                  f"{row['worst_cosine']:14.6f}  {row['worst_parameter']}", flush=True)
    write_json(results, args.json)
    return results


if __name__ == '__main__':
    main()
