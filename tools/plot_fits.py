"""One figure of what fits: the fitted step peak against the batch, one panel per model.

    python tools/plot_fits.py OUT.png TITLE=RESULT.json [TITLE=RESULT.json ...]

Each RESULT.json is ``tools/benchmark_memory.py --budget ... --json`` output; each panel shows
every mode's line (fixed + per image x batch), the two measured batches, any checked batch and
the budgets.
"""
from __future__ import annotations

import argparse
import json

from mmseg_mesa.bench.memory import plot_fits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('out', help='the PNG to write')
    parser.add_argument('runs', nargs='+', metavar='TITLE=RESULT.json')
    args = parser.parse_args(argv)
    runs = []
    for run in args.runs:
        title, sep, path = run.rpartition('=')
        if not sep or not title:
            parser.error(f'{run!r}: give TITLE=RESULT.json')
        with open(path) as f:
            results = json.load(f)
        if 'plans' not in results:
            parser.error(f'{path}: not a --budget result (no "plans")')
        runs.append((title, results))
    plot_fits(runs, args.out)


if __name__ == '__main__':
    main()
