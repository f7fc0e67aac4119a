"""What Mesa leaves uncompressed: the share of the baseline's saved bytes, and who holds it.

    python tools/coverage.py CONFIG [--size H W] [--batch N] [--top K] [--json PATH]
        [--cfg-options mesa.preset=paper ...]

Builds the config's model (random weights, SyncBN reverted) and runs one training forward
(``mode='loss'``) of the baseline and of its Mesa conversion (the config's ``mesa`` setting: the
default preset for a plain mmseg config) on the same random batch, counting what autograd saves
for backward (``mmseg_mesa.memory.count_saved_tensors``: storages once, Parameters excluded).
Every saved storage is then sorted by who saved it: a Mesa autograd Function (a Mesa layer's
compressed copy, mask or exact statistics; the recomputed loss's logits) or anything else: an op
inside a module Mesa did not convert, or a functional op (also one inside a converted module's
own forward, such as a decode head's resize). The second kind is "left uncompressed", attributed
to the innermost module running when it was saved, by qualified name and type. Of the first kind,
the floating-point storages (everything but codes, masks and window positions) are listed too:
what Mesa keeps exactly on purpose.
"""
from __future__ import annotations

import argparse

from mmseg_mesa.bench.coverage import coverage, format_result
from mmseg_mesa.bench.models import add_cfg_options, input_size, load_config, write_json


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config')
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help="input size; defaults to the config's crop_size")
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--top', type=int, default=12, help='modules and types to list')
    parser.add_argument('--json', help='write the result as JSON here')
    add_cfg_options(parser)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    size = input_size(args.size, cfg)
    result = dict(config=args.config, **coverage(cfg, size, args.batch))
    print(format_result(result, args.top))
    write_json(result, args.json)
    return result


if __name__ == '__main__':
    main()
