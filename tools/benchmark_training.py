"""Does Mesa train to the same accuracy? The demo model trained with the baseline and Mesa presets
for several seeds each, on CPU, with the gap set against the seed spread.

    python tools/benchmark_training.py                      # baseline and default, 3 seeds
    python tools/benchmark_training.py --modes baseline default paper --seeds 3
    python tools/benchmark_training.py --difficulty hard    # the harder generated dataset

Every run is ``tools/train.py`` on the demo config (``configs/demo/swin-mini_upernet_demo.py``,
1000 iterations; a preset adds ``mesa=<preset>``), its validation at the end. Seed ``s`` fixes
the initial weights, the data order and the model's random streams, the same for every mode, so
each Mesa run has a baseline twin (``mmseg_mesa.demo.seeds``: paired gap, Student-t 95% interval,
the baseline's seed std). Runs go ``--jobs`` at a time (default: one per core, one thread each);
each prints a progress line as it logs. Writes ``WORK_DIR/training.json`` (every run, mean and
std per mode, the gaps, the command, commit, date and machine) and ``WORK_DIR/training.png``
(loss curves with a band, mIoU per seed).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import os.path as osp
import sys
import time
from typing import Any

from mmseg_mesa.config import PRESETS
from mmseg_mesa.demo import write_demo_dataset
from mmseg_mesa.demo.runs import (
    FULL,
    QUICK,
    Schedule,
    TrainingRun,
    cfg_options,
    progress_line,
    read_scalars,
)
from mmseg_mesa.demo.seeds import conclusion, figure, provenance, summarize

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(REPO, 'configs', 'demo', 'swin-mini_upernet_demo.py')
TRAIN_SCRIPT = osp.join(REPO, 'tools', 'train.py')
MODES = ('baseline', *PRESETS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train the demo model for several seeds with '
                                                 'and without Mesa and compare accuracy')
    parser.add_argument('--modes', nargs='+', default=['baseline', 'default'], choices=MODES,
                        help='baseline and Mesa presets to train (default: baseline default)')
    parser.add_argument('--seeds', type=int, default=3, help='seeds per mode (default: 3)')
    parser.add_argument('--first-seed', type=int, default=0,
                        help='seeds are FIRST .. FIRST + SEEDS - 1 (default: 0)')
    parser.add_argument('--difficulty', default='standard', choices=('standard', 'hard'),
                        help="the generated dataset: 'hard' doubles colour spread and pixel "
                             'noise (default: standard)')
    parser.add_argument('--iters', type=int, default=None,
                        help="training iterations (default: the config's 1000)")
    parser.add_argument('--quick', action='store_true',
                        help='a few iterations on a few images (a smoke test)')
    parser.add_argument('--jobs', type=int, default=None,
                        help='runs at a time (default: cores // threads)')
    parser.add_argument('--threads', type=int, default=1,
                        help='CPU threads per run (default: 1)')
    parser.add_argument('--work-dir', default=osp.join(REPO, 'work_dirs', 'benchmark_training'),
                        help='runs, training.json and training.png (default: '
                             'work_dirs/benchmark_training)')
    parser.add_argument('--data-root', default=None,
                        help='the generated dataset (default: data/mesa_demo, or '
                             'data/mesa_demo_hard for --difficulty hard)')
    args = parser.parse_args(argv)
    if 'baseline' not in args.modes or len(args.modes) < 2:
        parser.error('--modes needs baseline and at least one preset')
    if args.seeds < 1 or args.threads < 1 or (args.jobs is not None and args.jobs < 1):
        parser.error('--seeds, --threads and --jobs must be >= 1')
    return args


def run_options(mode: str, seed: int, data_root: str, schedule: Schedule) -> dict[str, Any]:
    """``tools/train.py``'s overrides for one run: data, seed, schedule and the preset."""
    options = cfg_options(data_root, seed, schedule)
    if mode != 'baseline':
        options['mesa'] = mode
    return options


def train_runs(args: argparse.Namespace, data_root: str, schedule: Schedule
               ) -> list[dict[str, Any]]:
    """Every (seed, mode) run, ``--jobs`` at a time; their scalars and usage."""
    jobs = args.jobs or max(1, (os.cpu_count() or 1) // args.threads)
    queue = [(mode, seed) for seed in range(args.first_seed, args.first_seed + args.seeds)
             for mode in args.modes]
    total, running, results = len(queue), [], []
    print(f'benchmark_training: {total} runs ({", ".join(args.modes)} x {args.seeds} seeds), '
          f'{jobs} at a time', flush=True)
    while queue or running:
        while queue and len(running) < jobs:
            mode, seed = queue.pop(0)
            name = f'{mode} s{seed}'
            run = TrainingRun(name, TRAIN_SCRIPT, CONFIG,
                              osp.join(args.work_dir, mode, f'seed{seed}'),
                              run_options(mode, seed, data_root, schedule),
                              args.threads, show=progress_line)
            running.append((mode, seed, run))
        time.sleep(0.5)
        for item in [r for r in running if r[2].done()]:
            running.remove(item)
            mode, seed, run = item
            usage = run.wait()
            scalars = read_scalars(usage['run_dir'])
            results.append(dict(mode=mode, seed=seed, **scalars,
                                train_time_s=usage['train_time_s'],
                                cpu_time_s=usage['cpu_time_s']))
            print(f'benchmark_training: {len(results)}/{total} done: {mode} seed {seed}: '
                  f'mIoU {scalars["miou"]:.2f}, final loss {scalars["final_loss"]:.4f}',
                  flush=True)
    return results


def format_table(summary: dict[str, Any]) -> str:
    def fmt(mean: float, std: float | None) -> str:
        return f'{mean:.2f} +- {std:.2f}' if std is not None else f'{mean:.2f}'

    rows = [('mode', 'seeds', 'val mIoU (%)', 'final loss', 'mIoU gap (95% interval)')]
    for name, entry in summary['modes'].items():
        gap = summary['comparisons'].get(name, {}).get('miou')
        interval = '' if gap is None else (
            f'{gap["gap"]:+.2f}' + (f' ({gap["ci95"][0]:+.2f} to {gap["ci95"][1]:+.2f})'
                                    if gap['ci95'] else ''))
        rows.append((name, str(len(entry['seeds'])), fmt(entry['miou_mean'], entry['miou_std']),
                     f'{entry["final_loss_mean"]:.4f}', interval))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    schedule = QUICK if args.quick else FULL
    if args.iters is not None:
        schedule = dataclasses.replace(schedule, max_iters=args.iters)
    default_root = 'mesa_demo' if args.difficulty == 'standard' else 'mesa_demo_hard'
    data_root = osp.abspath(args.data_root or osp.join(REPO, 'data', default_root))
    args.work_dir = osp.abspath(args.work_dir)
    data = write_demo_dataset(data_root, num_train=schedule.num_train, num_val=schedule.num_val,
                              size=schedule.size, seed=0, difficulty=args.difficulty)
    print(f'benchmark_training: dataset in {data_root} ({args.difficulty}, '
          f'{data["num_train"]} train / {data["num_val"]} val; '
          f'{"written" if data["written"] else "already there"})', flush=True)
    runs = train_runs(args, data_root, schedule)
    summary = summarize(runs)
    record = dict(
        command=' '.join(['python', 'tools/benchmark_training.py', *(argv or sys.argv[1:])]),
        date=datetime.date.today().isoformat(), **provenance(REPO),
        settings=dict(modes=args.modes, seeds=args.seeds, first_seed=args.first_seed,
                      difficulty=args.difficulty, quick=args.quick, iters=args.iters,
                      threads=args.threads),
        runs=[{k: v for k, v in r.items() if k != 'loss_curve'} for r in runs],
        wall_time_s=round(time.perf_counter() - start, 1), **summary,
        conclusion=conclusion(summary))
    os.makedirs(args.work_dir, exist_ok=True)
    with open(osp.join(args.work_dir, 'training.json'), 'w') as f:
        json.dump(record, f, indent=2)
    import matplotlib.pyplot as plt
    fig = figure(summary)
    fig.savefig(osp.join(args.work_dir, 'training.png'), dpi=100)
    plt.close(fig)
    print('\n' + format_table(summary))
    for line in record['conclusion']:
        print(line)
    print(f'\nbenchmark_training: done in {record["wall_time_s"]:.0f} s; wrote '
          f'{osp.join(args.work_dir, "training.json")} and training.png', flush=True)


if __name__ == '__main__':
    main()
