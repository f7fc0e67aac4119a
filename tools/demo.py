"""The main job: train a small Swin-UPerNet with and without Mesa on CPU and compare them.

    python tools/demo.py                # ~7.5 minutes on two idle CPU cores (runs in parallel)
    python tools/demo.py --sequential   # one run after the other: ~10.5 minutes
    python tools/demo.py --quick        # a smoke run of a few iterations (what the tests use)

Steps: write the generated demo dataset (``mmseg_mesa.demo``); count the bytes one training step
saves for backward and measure the peak tensor memory of one full training step (forward,
backward, optimizer step, after a warm-up step; torch's ``MemTracker``), for both models on the
same batch, and again on half of it; from those two peaks the budget planner
(``mmseg_mesa.memory.BatchPlan``) predicts the largest batch whose step fits in ``--budget``
(default 1 GiB): what the saving buys, since the demo model's weights and AdamW state dominate
its step peak at its own batch. Both models then take a few training steps in turn (the step
time ratio, compute alone). Then train the baseline and the Mesa config through
``tools/train.py`` (one subprocess each, same seed, log lines streamed) and record each child's
wall time, CPU time and peak RSS; read the final loss and the mIoU of its validation at the end
from its ``vis_data/scalars.json``. Results go to ``WORK_DIR/summary.json``
(``{"baseline": {"miou": <percent>, "saved_bytes": ..., "train_time_s": ..., "budget_plan":
{"max_batch": ..., "per_image_bytes": ..., ...}, ...}, "mesa": {...}}``) and
``WORK_DIR/summary.png`` (loss curves, memory bars and the largest batch in the budget).
"""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import time
from typing import Any

from mmseg_mesa.demo.report import format_table, plot
from mmseg_mesa.demo.runs import FULL, QUICK, TrainingRun, cfg_options, read_scalars

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIGS = {
    'baseline': osp.join(REPO, 'configs', 'demo', 'swin-mini_upernet_demo.py'),
    'mesa': osp.join(REPO, 'configs', 'demo', 'mesa_swin-mini_upernet_demo.py'),
}
TRAIN_SCRIPT = osp.join(REPO, 'tools', 'train.py')


# What the planner fills: at 64x64 the demo model's step peak is some 50 MiB of weights, gradients
# and AdamW state plus a few MiB per image, so 1 GiB holds batches of hundreds.
DEFAULT_BUDGET = '1GiB'


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train with and without Mesa and compare')
    parser.add_argument('--quick', action='store_true',
                        help='a few iterations on a few images (a smoke test)')
    parser.add_argument('--work-dir', default=osp.join(REPO, 'work_dirs', 'demo'),
                        help='where runs and the summary go (default: work_dirs/demo)')
    parser.add_argument('--data-root', default=osp.join(REPO, 'data', 'mesa_demo'),
                        help='where the generated dataset goes (default: data/mesa_demo)')
    parser.add_argument('--seed', type=int, default=0, help='seed of data and training')
    # A training step of these small models is thousands of small ops, each an OpenMP parallel
    # region; when another process shares the cores, a descheduled thread stalls every region and
    # steps took 10-30x longer (measured on 2 cores). One thread costs ~20% on an idle machine
    # and keeps the timings predictable and comparable.
    parser.add_argument('--threads', type=int, default=1,
                        help='CPU threads of each training run and of the memory count '
                             '(default: 1)')
    parser.add_argument('--budget', default=DEFAULT_BUDGET, metavar='SIZE',
                        help='memory budget of the batch planner: GiB, or with a unit (512MiB); '
                             f'default: {DEFAULT_BUDGET}')
    parser.add_argument('--sequential', action='store_true',
                        help='train one config after the other (by default both train at once '
                             'when there are two or more cores: each gets a core, the demo '
                             'takes ~40%% less time, and CPU times are unaffected)')
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------
# Memory: bytes saved for backward by one training step of each model, its step peak and what
# fits in a budget.
def measure_steps(options: dict[str, Any], seed: int, budget: int, timed_steps: int
                  ) -> dict[str, dict[str, Any]]:
    """Build both models from their configs with the same weights; measure steps on one batch.

    The first step counts what is saved for backward and, with its optimizer step, is the
    warm-up; the second is tracked for its peak, the third (half the batch) too, and the two
    peaks give each model's ``BatchPlan`` for ``budget`` bytes. Then both models take
    ``timed_steps`` training steps in turn after an untimed round (``bench.speed``: a slow
    spell of the machine falls on both), the step time being compute alone, unlike the
    training runs' times (data loading, validation, logging). Returns ``{name:
    dict(saved_bytes, saved_by_type, step_peak_bytes, step_peak_by_category, step_peak_phase,
    budget_plan, step_time_s, step_time_ratio)}``.
    """
    import numpy as np
    import torch
    from mmengine.config import Config
    from mmengine.dataset import pseudo_collate
    from mmengine.model import revert_sync_batchnorm
    from mmengine.optim import build_optim_wrapper
    from mmseg.registry import DATASETS, MODELS
    from mmseg.utils import register_all_modules

    from mmseg_mesa import MesaConfig, convert_to_mesa
    from mmseg_mesa.bench.speed import interleaved_times, step_times
    from mmseg_mesa.memory import BatchPlan, count_saved_tensors, track_step_peak

    register_all_modules()
    cfgs = {}
    for name, path in CONFIGS.items():
        cfg = Config.fromfile(path)  # imports `custom_imports` (the demo dataset, Mesa's hook)
        cfg.merge_from_dict(options)
        cfgs[name] = cfg

    np.random.seed(seed)  # the pipeline's random flips
    dataset = DATASETS.build(cfgs['baseline'].train_dataloader.dataset)
    batch_size = cfgs['baseline'].train_dataloader.batch_size
    batch = pseudo_collate([dataset[i] for i in range(min(batch_size, len(dataset)))])
    if len(batch['inputs']) < 2:
        raise SystemExit('demo: the planner needs a batch of at least 2 images')

    weights = None
    results, models, optimizers = {}, {}, {}
    for name, cfg in cfgs.items():
        torch.manual_seed(seed)
        # No init_weights(): what is saved depends on shapes only, and outside a runner it
        # prints every parameter's initialisation to the console.
        model = revert_sync_batchnorm(MODELS.build(cfg.model))
        if weights is None:
            weights = model.state_dict()
        else:
            model.load_state_dict(weights)  # same weights: only Mesa differs
        model.train()
        mesa = MesaConfig.from_cfg(cfg.get('mesa'))
        if mesa is not None:
            convert_to_mesa(model, config=mesa)
        data = model.data_preprocessor(batch, training=True)
        torch.manual_seed(seed)
        with count_saved_tensors(model) as report:
            losses = model(**data, mode='loss')
        loss, _ = model.parse_losses(losses)
        loss.backward()  # frees what was saved
        del losses, loss
        optimizer = build_optim_wrapper(model, cfg.optim_wrapper).optimizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        half = len(data['data_samples']) // 2
        small = dict(inputs=data['inputs'][:half].clone(), data_samples=data['data_samples'][:half])
        peaks = []
        for step_data in (data, small):
            torch.manual_seed(seed)

            def step_loss(model: Any = model, step_data: dict = step_data) -> Any:
                return model.parse_losses(model(**step_data, mode='loss'))[0]

            peaks.append(track_step_peak(model, optimizer, step_loss, step_data['inputs'],
                                         *[s.gt_sem_seg.data for s in step_data['data_samples']]))
        peak, small_peak = peaks
        plan = BatchPlan.fit(half, small_peak.phase_peaks, len(data['data_samples']),
                             peak.phase_peaks, small_peak.site_peaks, peak.site_peaks)
        results[name] = dict(saved_bytes=int(report.total_bytes),
                             saved_by_type=dict(report.by_type.most_common()),
                             step_peak_bytes=peak.peak_bytes,
                             step_peak_by_category=peak.by_category,
                             step_peak_phase=f'{peak.phase}: {peak.module or "-"}',
                             budget_plan=plan.summary(budget))
        models[name], optimizers[name] = model, optimizer
    times = step_times(interleaved_times(models, optimizers, (data['inputs'],
                                                              data['data_samples']),
                                         'cpu', warmup=1, iters=timed_steps))
    for name, entry in times.items():
        results[name].update(step_time_s=entry['step_time_s'], step_time_ratio=entry['ratio'])
    return results


# ---------------------------------------------------------------------------------------------
# Training runs: one tools/train.py subprocess per config (mmseg_mesa.demo.runs).
def train_all(work_dir: str, options: dict[str, Any], threads: int, parallel: bool
              ) -> dict[str, dict[str, Any]]:
    """Train every config, one after the other or (``parallel``) all at once."""
    results, pending = {}, []
    for name, config in CONFIGS.items():
        pending.append(TrainingRun(name, TRAIN_SCRIPT, config, osp.join(work_dir, name),
                                   options, threads))
        if not parallel:
            results[name] = pending.pop().wait()
    for run in pending:
        results[run.name] = run.wait()
    return results


def main() -> None:
    args = parse_args()
    schedule = QUICK if args.quick else FULL
    work_dir = osp.abspath(args.work_dir)
    data_root = osp.abspath(args.data_root)
    start = time.perf_counter()

    from mmseg_mesa.demo import write_demo_dataset
    data = write_demo_dataset(data_root, num_train=schedule.num_train, num_val=schedule.num_val,
                              size=schedule.size, seed=args.seed)
    print(f'demo: dataset in {data_root} ({data["num_train"]} train / {data["num_val"]} val '
          f'images of {data["size"]}x{data["size"]}, {len(data["classes"])} classes; '
          f'{"written" if data["written"] else "already there"})', flush=True)

    import torch

    from mmseg_mesa.memory import format_bytes, parse_bytes
    try:
        budget = parse_bytes(args.budget)
    except ValueError as error:
        raise SystemExit(f'demo: --budget: {error}') from None
    torch.set_num_threads(args.threads)
    options = cfg_options(data_root, args.seed, schedule)
    memory = measure_steps(options, args.seed, budget, schedule.timed_steps)
    for name, result in memory.items():
        plan = result['budget_plan']
        print(f'demo: {name}: one training step saves {result["saved_bytes"] / 2**20:.2f} MiB '
              f'for backward; planned: batch {plan["max_batch"]} in {format_bytes(budget)}',
              flush=True)

    summary: dict[str, dict[str, Any]] = {}
    curves = {}
    parallel = not args.sequential and (os.cpu_count() or 1) >= 2 * args.threads
    runs = train_all(work_dir, options, args.threads, parallel)
    for name, config in CONFIGS.items():
        run = runs[name]
        scalars = read_scalars(run['run_dir'])
        curves[name] = scalars.pop('loss_curve')
        summary[name] = dict(miou=scalars.pop('miou'), saved_bytes=memory[name]['saved_bytes'],
                             train_time_s=run.pop('train_time_s'), **run, **scalars,
                             **{k: v for k, v in memory[name].items() if k != 'saved_bytes'},
                             config=config)
    summary['mesa']['saved_bytes_ratio'] = round(
        summary['mesa']['saved_bytes'] / max(1, summary['baseline']['saved_bytes']), 4)
    summary['mesa']['max_batch_ratio'] = round(
        summary['mesa']['budget_plan']['max_batch']
        / max(1, summary['baseline']['budget_plan']['max_batch']), 4)

    with open(osp.join(work_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    plot(summary, curves, osp.join(work_dir, 'summary.png'))
    print('\n' + format_table(summary))
    print('(The step peak counts tensors only: weights, gradients, AdamW state, activations '
          'and\n temporaries, as torch\'s MemTracker follows them; the process RSS, mostly the '
          'libraries,\n is in summary.json as peak_rss_bytes. The largest batch is predicted: '
          'the peak of each phase\n and of each module call fitted as fixed + per image x batch '
          'from the steps at the full\n and half batch, the largest of these lines.)')
    print(f'\ndemo: done in {time.perf_counter() - start:.0f} s; '
          f'wrote {osp.join(work_dir, "summary.json")} and summary.png', flush=True)


if __name__ == '__main__':
    main()
