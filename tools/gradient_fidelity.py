"""Mesa's gradients next to the exact ones on one batch, and whether their error averages out.

    python tools/gradient_fidelity.py [CONFIG] [--draws 8] [--batch 8] [--size 64 64]
        [--checkpoint PATH] [--cfg-options mesa.preset=max-saving ...]

Builds the config's model (random weights, SyncBN reverted), takes the exact gradient of one
training step, then Mesa gradients of the same step under several stochastic-rounding draws. If
the quantization error is unbiased, the relative error of the averaged gradient falls like
1/sqrt(draws); a bias would make it level off. ``--checkpoint`` measures a trained model instead
(attention maps of trained models are peaked, which random weights do not show);
``--cfg-options mesa.KEY=VALUE`` changes the MesaConfig (the config's ``mesa``), e.g.
``mesa.preset=max-saving`` or ``mesa.stochastic_rounding=False``.
"""
from __future__ import annotations

import argparse
import copy
import os.path as osp
import sys

import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'tools'))

from benchmark_memory import (  # noqa: E402
    add_cfg_options,
    build_model,
    load_config,
    loss_of,
    make_batch,
)


def gradients(model: torch.nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same drop-path / dropout masks in every run
    loss_of(model(*batch, mode='loss')).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def relative_error(got: dict, exact: dict) -> float:
    error = sum((got[n] - exact[n]).double().pow(2).sum() for n in exact)
    return float((error / sum(g.double().pow(2).sum() for g in exact.values())).sqrt())


def worst_cosine(got: dict, exact: dict) -> float:
    largest = max(g.norm() for g in exact.values())
    return min(torch.nn.functional.cosine_similarity(got[n].flatten().double(),
                                                     g.flatten().double(), dim=0).item()
               for n, g in exact.items() if g.norm() > 1e-3 * largest)


def main(argv: list[str] | None = None) -> list[tuple[int, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', nargs='?',
                        default=osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py'))
    parser.add_argument('--draws', type=int, default=8)
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'))
    parser.add_argument('--checkpoint', help='weights to load (an mmengine checkpoint)')
    add_cfg_options(parser)
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    from mmseg_mesa import MesaConfig, convert_to_mesa
    cfg = load_config(args.config, args.cfg_options)
    mesa = MesaConfig.from_cfg(cfg.get('mesa', True)) or MesaConfig()  # a bad value fails here
    size = tuple(args.size) if args.size else tuple(cfg.get('crop_size', (512, 512)))
    reference = build_model(cfg, 'cpu')
    if args.checkpoint:
        from mmseg_mesa.integrations.checkpoint import allow_mmengine_checkpoints
        allow_mmengine_checkpoints()
        state = torch.load(args.checkpoint, map_location='cpu')
        reference.load_state_dict(state.get('state_dict', state))
    batch = make_batch(cfg, args.batch, size, 'cpu')
    exact = gradients(reference, batch)
    model = copy.deepcopy(reference)
    convert_to_mesa(model, config=mesa)
    total, rows = None, []
    print(f'{"draws":>6}{"relative error":>16}{"worst cosine":>14}')
    for draw in range(1, args.draws + 1):
        grads = gradients(model, batch)
        total = grads if total is None else {n: total[n] + grads[n] for n in grads}
        mean = {n: g / draw for n, g in total.items()}
        rows.append((draw, relative_error(mean, exact), worst_cosine(mean, exact)))
        print(f'{draw:6d}{rows[-1][1]:16.5f}{rows[-1][2]:14.6f}', flush=True)
    return rows


if __name__ == '__main__':
    main()
