"""Memory of a training step per mode: its peak, the bytes saved for backward, its time, and
the largest batch that fits in a budget.

A mode (``baseline``, ``mesa[:PRESET]``, ``amp``, ``checkpoint`` and their ``+`` combinations)
is a way of training the same model; ``prepare`` makes it from a built model, ``measure`` takes
a warm-up step and then measures one, ``plan_batches`` fits each mode's step peak against the
batch (``mmseg_mesa.memory.BatchPlan``). ``tools/benchmark_memory.py`` is the command line over
it; ``format_table``, ``format_plans`` and ``plot`` are its reports.
"""
from __future__ import annotations

import argparse
import copy
import os.path as osp
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from .models import loss_of, make_batch


@dataclass(frozen=True)
class Mode:
    """What a mode name asks for: a Mesa config (None: none, '': the config's), AMP, checkpoints."""

    preset: str | None
    amp: bool
    checkpoint: bool


def parse_mode(value: str) -> Mode:
    """``baseline``, or ``mesa[:PRESET]`` / ``amp`` / ``checkpoint`` with ``+amp`` /
    ``+checkpoint``; anything else is an error that lists the presets."""
    from mmseg_mesa.config import PRESETS, check_preset
    head, *options = value.split('+')
    name, sep, preset = head.partition(':')
    why = f'presets: {", ".join(PRESETS)}'
    if name == 'mesa':
        valid, mesa = not sep or preset in PRESETS, preset
        if sep and preset:
            try:
                check_preset(preset)
            except ValueError as error:  # says so when the preset was renamed
                why = str(error)
    else:
        valid, mesa = not sep and (head in ('amp', 'checkpoint') or value == 'baseline'), None
        options = [head, *options] if head != 'baseline' else options
    flags = set(options)
    if not (valid and flags <= {'amp', 'checkpoint'} and len(flags) == len(options)):
        raise argparse.ArgumentTypeError(
            f'invalid mode {value!r}: use baseline, amp, checkpoint or mesa[:PRESET] with '
            f'optional +amp / +checkpoint; {why}')
    return Mode(mesa, 'amp' in flags, 'checkpoint' in flags)


def mode_name(value: str) -> str:
    """argparse's check of --modes: the name itself, once ``parse_mode`` accepts it."""
    parse_mode(value)
    return value


def default_modes() -> list[str]:
    """Baseline, the config's Mesa setting, every other preset, AMP and checkpointing."""
    from mmseg_mesa.config import PRESETS
    presets = [f'mesa:{name}' for name in PRESETS if name != 'default']
    return ['baseline', 'mesa', *presets, 'amp', 'mesa+amp', 'checkpoint', 'mesa+checkpoint']


def budget_modes() -> list[str]:
    """Baseline, the config's Mesa setting and every other preset."""
    from mmseg_mesa.config import PRESETS
    return ['baseline', 'mesa', *[f'mesa:{name}' for name in PRESETS if name != 'default']]


def checkpoint_backbone_stages(model: torch.nn.Module) -> list[str]:
    """Turn on mmengine's activation checkpointing for each block of the backbone's stage list."""
    from mmengine.runner.activation_checkpointing import turn_on_activation_checkpointing
    for name, child in model.backbone.named_children():
        if isinstance(child, torch.nn.ModuleList):
            names = [f'backbone.{name}.{i}' for i in range(len(child))]
            turn_on_activation_checkpointing(model, names)
            return names
    raise ValueError(f'{type(model.backbone).__name__} has no ModuleList of stages to checkpoint')


def prepare(base: torch.nn.Module, mode: str, mesa_config: Any) -> torch.nn.Module:
    from mmseg_mesa import MesaConfig, convert_to_mesa
    model = copy.deepcopy(base)
    parsed = parse_mode(mode)
    if parsed.preset is not None:
        config = MesaConfig.preset(parsed.preset) if parsed.preset else mesa_config
        convert_to_mesa(model, config=config)
    if parsed.checkpoint:
        checkpoint_backbone_stages(model)
    return model


def build_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The config's optimizer (with its per-parameter settings), as training would build it."""
    from mmengine.optim import build_optim_wrapper
    wrapper = copy.deepcopy(cfg.get('optim_wrapper') or dict(
        optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)))
    wrapper['type'] = 'OptimWrapper'  # only the optimizer matters here (AMP is a mode)
    wrapper.pop('loss_scale', None)
    return build_optim_wrapper(model, wrapper).optimizer


def forward_loss(model: torch.nn.Module, batch: tuple, mode: str, device: str) -> torch.Tensor:
    amp_dtype = torch.float16 if device == 'cuda' else torch.bfloat16
    with torch.autocast(device, dtype=amp_dtype, enabled=parse_mode(mode).amp):
        return loss_of(model(*batch, mode='loss'))


def run_step(model: torch.nn.Module, batch: tuple, mode: str, device: str,
             optimizer: torch.optim.Optimizer | None = None) -> None:
    """One training step: forward, backward and (when given) the optimizer step."""
    forward_loss(model, batch, mode, device).backward()
    if optimizer is not None:
        optimizer.step()
    model.zero_grad(set_to_none=True)


def synchronize(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def step_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, mode: str,
              device: str) -> dict:
    """The peak of one training step (after a warm-up step has created the optimizer state)."""
    from mmseg_mesa.memory import track_step_peak
    if device == 'cuda':
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak = track_step_peak(model, optimizer, lambda: forward_loss(model, batch, mode, device),
                           batch[0], *[s.gt_sem_seg.data for s in batch[1]])
    cuda_peak = None
    if device == 'cuda':
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated()
    return dict(peak_bytes=peak.peak_bytes, peak_by_category=peak.by_category,
                peak_phase=peak.phase, peak_module=peak.module, phase_peaks=peak.phase_peaks,
                site_peaks=peak.site_peaks, cuda_peak_bytes=cuda_peak)


def measure(model: torch.nn.Module, batch: tuple, mode: str, device: str, iters: int,
            cfg: Any) -> dict:
    from mmseg_mesa.memory import count_saved_tensors
    optimizer = build_optimizer(model, cfg)
    with count_saved_tensors(model) as saved:
        loss = forward_loss(model, batch, mode, device)
    loss.backward()  # with the optimizer step below: the warm-up step
    del loss
    optimizer.step()
    model.zero_grad(set_to_none=True)
    result = step_peak(model, optimizer, batch, mode, device)
    del result['site_peaks']  # for plans only (hundreds of module calls)
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        run_step(model, batch, mode, device, optimizer)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return dict(result, saved_bytes=saved.total_bytes, softmax_bytes=saved.softmax_bytes,
                step_time_s=statistics.median(times) if times else None,
                by_type=dict(saved.by_type))


def peak_at(base: torch.nn.Module, cfg: Any, mode: str, mesa_config: Any, batch_size: int,
            size: tuple[int, int], device: str) -> dict:
    """Build the mode's model, take a warm-up step and measure the next step's peak."""
    model = prepare(base, mode, mesa_config)
    optimizer = build_optimizer(model, cfg)
    batch = make_batch(cfg, batch_size, size, device)
    run_step(model, batch, mode, device, optimizer)
    result = step_peak(model, optimizer, batch, mode, device)
    del model, optimizer, batch
    if device == 'cuda':
        torch.cuda.empty_cache()
    return result


def plan_batches(base: torch.nn.Module, cfg: Any, modes: list[str], mesa_config: Any,
                 batch: int, size: tuple[int, int], device: str, budgets: list[int],
                 check: bool, search: bool, check_batch: int | None = None,
                 second_batch: int | None = None) -> dict:
    """Per mode: step peaks at ``batch`` and ``second_batch`` (default ``2 * batch``), their
    ``BatchPlan``, and for each of
    ``budgets`` (bytes) the largest batch whose predicted peak fits (``fits``; the first budget's
    is also the summary's ``max_batch``). ``check``: the measured peak at the first budget's
    batch; ``check_batch``: the measured peak at that batch; ``search``: the largest
    power-of-two batch that ran within the first budget on CUDA."""
    from mmseg_mesa.memory import BatchPlan
    plans = {}
    second = second_batch or 2 * batch
    for mode in modes:
        print(f'planning {mode}: peaks at batch {batch} and {second} ...', flush=True)
        low = peak_at(base, cfg, mode, mesa_config, batch, size, device)
        high = peak_at(base, cfg, mode, mesa_config, second, size, device)
        try:
            fitted = BatchPlan.fit(batch, low['phase_peaks'], second, high['phase_peaks'],
                                   low['site_peaks'], high['site_peaks'])
        except ValueError as error:
            raise SystemExit(f'{mode}: {error}') from None
        plan = dict(fitted.summary(budgets[0]), phase_peaks_low=low['phase_peaks'],
                    phase_peaks_high=high['phase_peaks'],
                    fits=[dict(budget_bytes=b, max_batch=fitted.largest_batch(b),
                               place=fitted.place(fitted.largest_batch(b))) for b in budgets])
        # the predicted peak is the largest of many lines: convex, piecewise linear
        largest = max(f['max_batch'] for f in plan['fits']) + 1
        plan['predicted_curve'] = [[b, fitted.predict(b)] for b in sorted(
            {0, batch, second, largest, check_batch or 0, *(f['max_batch'] for f in plan['fits']),
             *range(0, largest, max(1, largest // 32))})]
        checks = [b for b in (plan['max_batch'] if check else None, check_batch) if b]
        for checked in dict.fromkeys(checks):
            print(f'checking {mode} at batch {checked} ...', flush=True)
            measured = peak_at(base, cfg, mode, mesa_config, checked, size, device)
            predicted = fitted.predict(checked)
            plan.setdefault('checks', []).append(dict(
                batch=checked, predicted_bytes=predicted, measured_bytes=measured['peak_bytes'],
                error=predicted / measured['peak_bytes'] - 1, predicted_place=fitted.place(checked),
                measured_place=f"{measured['peak_phase']}: {measured['peak_module'] or '-'}"))
        if check and plan['max_batch']:
            plan.update({k: plan['checks'][0][k] for k in ('measured_bytes', 'error')})
        if search:
            print(f'searching {mode}: batches 1, 2, 4, ... on CUDA ...', flush=True)
            plan['searched_batch'] = search_batch(base, cfg, mode, mesa_config, size, budgets[0])
        plans[mode] = plan
    return plans


def format_plans(plans: dict, size: tuple[int, int]) -> str:
    """The fixed part, the growth per image (and its ratio to the baseline's) and the largest
    batch in each budget, per mode; then the checks, predicted against measured."""
    from mmseg_mesa.memory import format_bytes
    mib = 2 ** 20
    budgets = [f['budget_bytes'] for f in next(iter(plans.values()))['fits']]
    base = plans.get('baseline')
    searched = any('searched_batch' in p for p in plans.values())
    lines = [f'Step peak = fixed + per image x batch at {size[0]}x{size[1]} (each phase fitted at '
             'two batches); the largest batch whose predicted peak (the largest of the phases\' '
             'and every module call\'s lines) fits in each budget; steepest: MiB per image of '
             'the steepest line, what each image adds at large batches:',
             f"{'mode':<17}{'fixed MiB':>11}{'MiB/image':>11}{'ratio':>7}{'steepest':>10}" +
             ''.join(f'{format_bytes(b):>9}' for b in budgets) +
             (f"{'searched':>10}" if searched else '')]
    for mode, p in plans.items():
        ratio = (f"{p['per_image_bytes'] / base['per_image_bytes']:7.3f}" if base
                 else f"{'-':>7}")
        lines.append(f"{mode:<17}{p['fixed_bytes'] / mib:11.0f}{p['per_image_bytes'] / mib:11.1f}"
                     + ratio + f"{p['steepest_per_image_bytes'] / mib:10.1f}"
                     + ''.join(f"{f['max_batch']:9d}" for f in p['fits'])
                     + (f"{p.get('searched_batch', '-'):>10}" if searched else ''))
    checks = [(mode, c) for mode, p in plans.items() for c in p.get('checks', ())]
    if checks:
        lines.append(f"{'checked':<17}{'batch':>7}{'predicted MiB':>15}{'measured MiB':>14}"
                     f"{'error':>8}  predicted at / measured at")
        for mode, c in checks:
            lines.append(f"{mode:<17}{c['batch']:7d}{c['predicted_bytes'] / mib:15.0f}"
                         f"{c['measured_bytes'] / mib:14.0f}{c['error']:+8.1%}  "
                         f"{c['predicted_place']} / {c['measured_place']}")
    return '\n'.join(lines)


def search_batch(base: torch.nn.Module, cfg: Any, mode: str, mesa_config: Any,
                 size: tuple[int, int], budget: int) -> int:
    """The largest power-of-two batch (up to 1024) whose training step, after a warm-up step,
    stayed within ``budget`` bytes of ``torch.cuda.max_memory_allocated``; 0 if batch 1 did not."""
    best, batch = 0, 1
    while batch <= 1024:
        try:
            peak = peak_at(base, cfg, mode, mesa_config, batch, size, 'cuda')['cuda_peak_bytes']
        except torch.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
        if peak > budget:
            break
        best, batch = batch, batch * 2
    return best


def add_ratios(results: dict) -> None:
    base = results['modes'].get('baseline')
    if not base:
        return
    for entry in results['modes'].values():
        entry['peak_ratio'] = entry['peak_bytes'] / base['peak_bytes']
        entry['saved_ratio'] = entry['saved_bytes'] / base['saved_bytes']
        entry['time_ratio'] = (entry['step_time_s'] / base['step_time_s']
                               if entry['step_time_s'] and base['step_time_s'] else None)
        entry['cuda_peak_ratio'] = (entry['cuda_peak_bytes'] / base['cuda_peak_bytes']
                                    if entry['cuda_peak_bytes'] and base['cuda_peak_bytes']
                                    else None)


CATEGORIES = ('Parameter', 'Gradient', 'Optstate', 'Activation', 'Temp', 'Buffer', 'Other')


def format_table(results: dict) -> str:
    mib = 2 ** 20
    modes = results['modes']
    lines = [f"{results['config']}  device={results['device']}  batch={results['batch']}  "
             f"size={results['size']}",
             'Peak of one training step (forward, backward, optimizer step; after a warm-up '
             'step), saved bytes and step time:',
             f"{'mode':<17}{'peak MiB':>9}{'ratio':>8}{'saved MiB':>10}{'ratio':>8}"
             f"{'step s':>9}{'ratio':>8}  peak in"]
    for mode, r in modes.items():
        timing = (f"{r['step_time_s']:9.3f}{r.get('time_ratio') or 1:8.3f}"
                  if r['step_time_s'] is not None else f"{'-':>9}{'-':>8}")
        lines.append(f"{mode:<17}{r['peak_bytes'] / mib:9.0f}{r.get('peak_ratio', 1):8.3f}"
                     f"{r['saved_bytes'] / mib:10.1f}{r.get('saved_ratio', 1):8.3f}{timing}  "
                     f"{r['peak_phase']}: {r['peak_module'] or '-'}")
    if any(r.get('cuda_peak_bytes') for r in modes.values()):
        lines.append('CUDA max_memory_allocated of that step (MiB): ' + ', '.join(
            f"{m}={r['cuda_peak_bytes'] / mib:.0f}" for m, r in modes.items()))
    lines.append('\nAt the peak, by category (MiB; Activation: made in forward, Temp: in '
                 'backward):')
    lines.append(f"{'category':<12}" + ''.join(f'{m:>17}' for m in modes))
    for category in CATEGORIES:
        if any(r['peak_by_category'].get(category) for r in modes.values()):
            lines.append(f'{category:<12}' + ''.join(
                f"{r['peak_by_category'].get(category, 0) / mib:17.0f}" for r in modes.values()))
    lines.append("\nOf the saved MiB, softmax outputs (attention maps): " + ', '.join(
        f"{m}={r.get('softmax_bytes', 0) / mib:.1f}" for m, r in modes.items()))
    types = sorted({t for r in modes.values() for t in r['by_type']},
                   key=lambda t: -modes.get('baseline', next(iter(modes.values())))[
                       'by_type'].get(t, 0))
    lines.append('\nSaved MiB by module type (Mesa modules under the type they replaced):')
    lines.append(f"{'type':<22}" + ''.join(f'{m:>17}' for m in modes))
    for t in types:
        lines.append(f'{t:<22}' + ''.join(f"{r['by_type'].get(t, 0) / mib:17.1f}"
                                           for r in modes.values()))
    return '\n'.join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    modes = list(results['modes'])
    mib = 2 ** 20
    fig, (peak_ax, left, right) = plt.subplots(1, 3, figsize=(18, 4.8))
    bottom = [0.0] * len(modes)
    for i, category in enumerate(CATEGORIES):
        values = [results['modes'][m]['peak_by_category'].get(category, 0) / mib for m in modes]
        if any(values):
            peak_ax.bar(modes, values, bottom=bottom, label=category,
                        color=plt.cm.Set2.colors[i % 8])
            bottom = [b + v for b, v in zip(bottom, values)]
    for k, m in enumerate(modes):
        ratio = results['modes'][m].get('peak_ratio')
        if ratio is not None:
            peak_ax.annotate(f'{ratio:.2f}x', (k, bottom[k]), ha='center', va='bottom',
                             fontsize=8)
    peak_ax.set_ylabel('MiB at the peak')
    peak_ax.set_title('Peak of a training step (fwd + bwd + optimizer)')
    peak_ax.tick_params(axis='x', rotation=30)
    peak_ax.legend(fontsize=7)
    peak_ax.margins(y=0.1)
    saved = [results['modes'][m]['saved_bytes'] / mib for m in modes]
    colours = ['#888' if parse_mode(m).preset is None else '#2a7' for m in modes]
    left.bar(modes, saved, color=colours)
    left.set_ylabel('saved for backward (MiB)')
    left.set_title('Saved for backward per mode')
    left.tick_params(axis='x', rotation=30)
    totals: dict[str, float] = {}
    for m in modes:
        for t, v in results['modes'][m]['by_type'].items():
            totals[t] = max(totals.get(t, 0), v)
    # the types that matter (>= 1% of the largest), largest first; the rest as "other"
    types = [t for t in sorted(totals, key=totals.get, reverse=True)
             if totals[t] >= 0.01 * max(totals.values())]
    colours = plt.cm.tab20.colors
    bottom = [0.0] * len(modes)
    for i, t in enumerate(types + ['other']):
        if t == 'other':
            values = [sum(v for k, v in results['modes'][m]['by_type'].items()
                          if k not in types) / mib for m in modes]
        else:
            values = [results['modes'][m]['by_type'].get(t, 0) / mib for m in modes]
        # matplotlib hides labels that start with '_' (mmengine's _BatchNormXd)
        right.bar(modes, values, bottom=bottom, label=t.lstrip('_'),
                  color=colours[i % len(colours)])
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_title('By module type')
    right.tick_params(axis='x', rotation=30)
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{osp.basename(results['config'])}, batch {results['batch']}, "
                 f"{results['size'][0]}x{results['size'][1]}, {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_fits(runs: list[tuple[str, dict]], path: str) -> None:
    """One panel per model: each mode's fitted step peak against the batch (the measured batches
    as dots, the checked ones as crosses) and the budgets as horizontal lines."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    gib = 2 ** 30
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4), squeeze=False)
    for ax, (title, results) in zip(axes[0], runs):
        plans = results['plans']
        budgets = [f['budget_bytes'] for f in next(iter(plans.values()))['fits']]
        largest = max(max(f['max_batch'] for f in p['fits']) for p in plans.values())
        top = max(budgets) * 1.05
        for i, (mode, p) in enumerate(plans.items()):
            colour = plt.cm.tab10.colors[i % 10]
            # the plan's predicted peaks (every phase's and module call's line), else the
            # phases' line (plans written before module calls were fitted)
            curve = p.get('predicted_curve') or [
                [b, p['fixed_bytes'] + p['per_image_bytes'] * b] for b in (0, largest + 1)]
            steepest = p.get('steepest_per_image_bytes', p['per_image_bytes'])
            label = f"{mode}: {p['per_image_bytes'] / 2 ** 20:.0f} MiB/image" + (
                f" ({steepest / 2 ** 20:.0f} at large batches)"
                if steepest > p['per_image_bytes'] * 1.001 else '')
            ax.plot([b for b, _ in curve], [peak / gib for _, peak in curve],
                    color=colour, label=label)
            low, high = p['batches']
            ax.scatter([low, high], [max(p['phase_peaks_low'].values()) / gib,
                                     max(p['phase_peaks_high'].values()) / gib], color=colour)
            for check in p.get('checks', ()):
                ax.scatter([check['batch']], [check['measured_bytes'] / gib], color=colour,
                           marker='x')
        for budget in budgets:
            ax.axhline(budget / gib, color='#bbb', linewidth=0.8, linestyle='--')
        ax.set_ylim(0, top / gib)
        ax.set_xlim(0, largest + 1)
        ax.set_xlabel('batch (images)')
        ax.set_ylabel('step peak (GiB)')
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc='upper left')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
