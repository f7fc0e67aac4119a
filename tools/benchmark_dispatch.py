"""What a GPU step would launch and wait for, Mesa against the baseline, across many models.

    python tools/benchmark_dispatch.py [--zoo] [--backbones] [--only NAME ...] [--size 64]
        [--batch 2] [--json PATH] [--markdown PATH]

For one config per mmseg family (``tools/benchmark_zoo.py``'s) and UPerNet around every backbone
of ``tools/benchmark_backbones.py`` (both by default), random weights, one training forward +
backward of the unconverted model and of its default Mesa conversion on the same random batch,
each after an uncounted one, with the CPU on a device's branches (``host.device_path``):

- kernel ops: every op the dispatcher runs but views and allocations (``bench.dispatch``);
- host syncs: ops whose result the host reads (``.item()``, ``nonzero``, ``unique``, indexing
  with a bool mask), by op name; those Mesa adds to the baseline's, and those called from
  ``mmseg_mesa``'s own code, with where.

Counts, not times: a quick sweep (about 10 minutes on one core at 64x64), to run after a change
to any layer. A model that fails ends only its row.
"""
from __future__ import annotations

import argparse
import copy
import os.path as osp
import sys
import traceback
from typing import Any

from mmseg_mesa.bench import sweep

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
COLUMNS = ('model', 'kernel ops: baseline', 'Mesa', 'ratio', 'syncs: baseline', 'Mesa',
           'Mesa adds', 'from mmseg_mesa')


def models(zoo: bool, backbones: bool) -> dict[str, Any]:
    """Name -> (a function making its config at a size and batch, the size it must have or
    None), for the chosen sweeps (their lists: the other sweep tools', imported as
    ``tools.*``)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tools import benchmark_backbones, benchmark_zoo
    made: dict[str, Any] = {}
    if zoo:
        for family, name in sorted(benchmark_zoo.CONFIGS.items()):
            path = osp.join(sweep.configs_root(), family, name)
            made[family] = (lambda size, batch, path=path: benchmark_zoo.zoo_config(path, size),
                            benchmark_zoo.SIZES.get(family))
    if backbones:
        for name in benchmark_backbones.names():
            made[name] = (lambda size, batch, name=name: benchmark_backbones.backbone_upernet(
                name, size, batch), benchmark_backbones.SIZES.get(name))
    return made


def measure(make: Any, size: int, batch: int) -> dict:
    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.bench.dispatch import compared, step_counts
    from mmseg_mesa.bench.models import build_model, make_batch
    cfg = make(size, batch)
    reference = build_model(cfg, 'cpu').train()
    data = make_batch(cfg, batch, (size, size), 'cpu')
    model = copy.deepcopy(reference)  # before any step: a forward may update state it reads
    convert_to_mesa(model)
    model.train()
    return compared(step_counts(model, data), step_counts(reference, data))


def format_row(row: dict) -> str:
    if 'error' in row:
        return f"| {row['model']} | {row['error']} |" + ' |' * (len(COLUMNS) - 2)
    added = ', '.join(f'{n} `{name}`' for name, n in row['added_syncs'].items()) or '0'
    sites = '; '.join(row['mesa_sync_sites']) or '-'
    return (f"| {row['model']} ({row['size']}) | {row['baseline_kernel_ops']} | {row['kernel_ops']}"
            f" | {row['kernel_ratio']:.2f}x | {row['baseline_syncs']} | {row['syncs']} | {added}"
            f" | {sites} |")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--zoo', action='store_true', help="mmseg's families only")
    parser.add_argument('--backbones', action='store_true', help='the backbones only')
    parser.add_argument('--only', nargs='+', default=None, help='these families / backbones')
    parser.add_argument('--size', type=int, default=64)
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--json', default=None)
    parser.add_argument('--markdown', default=None)
    args = parser.parse_args(argv)
    both = not (args.zoo or args.backbones)
    chosen = models(args.zoo or both, args.backbones or both)
    unknown = sorted(set(args.only or []) - set(chosen))
    if unknown:
        parser.error(f'unknown models {unknown}; known: {" ".join(chosen)}')
    header = (f"| {' | '.join(COLUMNS)} |\n|---|" + '---:|' * 5 + '---|---|')
    print(header, flush=True)
    rows = []
    for name in args.only or chosen:
        make, fixed = chosen[name]
        size = fixed or args.size
        row: dict = dict(model=name, size=size)
        try:
            row.update(measure(make, size, args.batch))
        except Exception as error:  # one model's failure ends only its row
            row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:120]}'
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
        print(format_row(row), flush=True)
    table = '\n'.join([header, *map(format_row, rows)])
    if args.markdown:
        with open(args.markdown, 'w') as f:
            f.write(table + '\n')
    from mmseg_mesa.bench.models import write_json
    write_json(dict(size=args.size, batch=args.batch, rows=rows), args.json)
    return rows


if __name__ == '__main__':
    main()
