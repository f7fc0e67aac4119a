"""Which layers of a config's model keep about 16 bits, chosen from the gradient, and what
choosing costs.

    python tools/calibrate.py CONFIG [--size H W] [--batch N] [--peak] [--json PATH]
        [--cfg-options mesa.calibrate.cosine=0.999 ...]

Builds the config's model (random weights), converts it with the config's ``mesa`` setting and
runs the calibration ``MesaHook`` runs at a run's first iteration (``mmseg_mesa.calibration``)
on a random batch of ``--batch`` images (the calibration's own, 2 by default) at ``--size`` (the
config's crop by default): the layers it refines, each with its gradient error alone at 8 bits
and the bytes refining it adds, then the calibration's time against one Mesa step, and with
``--peak`` its peak tensor memory against one baseline and one Mesa step at that batch.
"""
from __future__ import annotations

import argparse

from mmseg_mesa.bench.calibration import calibrate_config, format_cost
from mmseg_mesa.bench.models import add_cfg_options, input_size, load_config, write_json


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config')
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help="input size; defaults to the config's crop_size")
    parser.add_argument('--batch', type=int, default=None,
                        help="images; defaults to the calibration's own (MesaConfig.calibrate)")
    parser.add_argument('--peak', action='store_true',
                        help='measure peak tensor memory too (slower)')
    parser.add_argument('--json', help='write the result as JSON here')
    add_cfg_options(parser)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    result = dict(config=args.config,
                  **calibrate_config(cfg, input_size(args.size, cfg), args.batch, args.peak))
    print(result['report'])
    print(format_cost(result))
    write_json(result, args.json)
    return result


if __name__ == '__main__':
    main()
