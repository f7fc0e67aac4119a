"""Accuracy across seeds: what ``tools/benchmark_training.py`` makes of its runs.

Each mode (the baseline, or a Mesa preset) trains once per seed; a seed fixes the initial weights,
the data order and the model's random streams, and the same seeds serve every mode, so each
Mesa run has a baseline twin. The gap is the mean of the per-seed differences (Mesa minus its
twin), with a paired Student-t 95% interval, next to the baseline's own seed-to-seed spread.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
from typing import Any

import numpy as np


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (scipy, which mmseg installs)."""
    from scipy.stats import t
    return float(t.ppf(p, df))


def compare(mode: list[float], baseline: list[float]) -> dict[str, Any]:
    """Paired comparison of one metric over the same seeds: the mean difference (mode minus
    baseline), its 95% interval (None for one seed), the baseline's seed spread, and a
    sentence that says which of them is larger and whether the interval holds 0."""
    if len(mode) != len(baseline) or not mode:
        raise ValueError(f'compare: needs the same seeds for both, got {len(mode)} and '
                         f'{len(baseline)} values')
    diffs = [a - b for a, b in zip(mode, baseline)]
    n = len(diffs)
    gap, diff_std = mean_std(diffs)
    _, spread = mean_std(baseline)
    result: dict[str, Any] = dict(gap=gap, diff_std=diff_std, baseline_std=spread, seeds=n,
                                  ci95=None)
    if diff_std is None or spread is None:
        result['verdict'] = (f'{gap:+.2f} from one seed: no seed spread to set it against')
        return result
    half = t_quantile(0.975, n - 1) * diff_std / math.sqrt(n)
    low, high = gap - half, gap + half
    result['ci95'] = [low, high]
    interval = f'{gap:+.2f} (95% interval {low:+.2f} to {high:+.2f}, {n} seeds)'
    if low <= 0.0 <= high and abs(gap) <= spread:
        verdict = (f'{interval}: within the baseline\'s seed spread (std {spread:.2f}); no '
                   f'difference shown')
    elif low <= 0.0 <= high:
        verdict = (f'{interval}: larger than the baseline\'s seed spread (std {spread:.2f}) '
                   f'but not significant with {n} seeds')
    else:
        verdict = (f'{interval}: {"lower" if gap < 0 else "higher"} than the baseline beyond '
                   f'the seed noise (baseline std {spread:.2f})')
    result['verdict'] = verdict
    return result


def mean_curve(curves: list[dict[str, list]]) -> dict[str, list]:
    """Mean and standard deviation of several runs' loss curves at the iterations they share."""
    common = sorted(set.intersection(*(set(c['iter']) for c in curves)))
    rows = np.array([[dict(zip(c['iter'], c['loss']))[i] for i in common] for c in curves])
    std = rows.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(len(common))
    return dict(iter=common, mean=rows.mean(axis=0).tolist(), std=std.tolist())


def summarize(runs: list[dict[str, Any]], baseline: str = 'baseline') -> dict[str, Any]:
    """Per mode: mIoU and final loss (mean, std, per seed) and the mean loss curve; per mode
    other than ``baseline``: ``compare`` of its mIoU and final loss with the baseline's.

    ``runs``: one dict per run with ``mode``, ``seed``, ``miou``, ``final_loss``, ``loss_curve``.
    """
    modes: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r['seed']):
        entry = modes.setdefault(run['mode'], dict(seeds=[], miou=[], final_loss=[], curves=[]))
        entry['seeds'].append(run['seed'])
        entry['miou'].append(run['miou'])
        entry['final_loss'].append(run['final_loss'])
        entry['curves'].append(run['loss_curve'])
    summary: dict[str, Any] = dict(modes={}, comparisons={})
    for name, entry in modes.items():
        miou_mean, miou_std = mean_std(entry['miou'])
        loss_mean, loss_std = mean_std(entry['final_loss'])
        summary['modes'][name] = dict(
            seeds=entry['seeds'], miou=entry['miou'], miou_mean=miou_mean, miou_std=miou_std,
            final_loss=entry['final_loss'], final_loss_mean=loss_mean, final_loss_std=loss_std,
            loss_curve=mean_curve(entry['curves']))
    if baseline in modes:
        base = modes[baseline]
        for name, entry in modes.items():
            if name == baseline:
                continue
            if entry['seeds'] != base['seeds']:
                raise ValueError(f'summarize: {name} ran seeds {entry["seeds"]}, the '
                                 f'{baseline} {base["seeds"]}; a paired gap needs the same')
            summary['comparisons'][name] = dict(
                miou=compare(entry['miou'], base['miou']),
                final_loss=compare(entry['final_loss'], base['final_loss']))
    return summary


def conclusion(summary: dict[str, Any]) -> list[str]:
    """One line per compared mode: its mIoU gap in plain words."""
    return [f'{name}: mIoU {c["miou"]["verdict"]}'
            for name, c in summary['comparisons'].items()]


def figure(summary: dict[str, Any]) -> Any:
    """Loss curves (mean of the seeds, with a band of one standard deviation) and each seed's
    validation mIoU with the mean and standard deviation per mode."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    modes = summary['modes']
    fig, (ax_loss, ax_miou) = plt.subplots(1, 2, figsize=(13, 4.5),
                                           gridspec_kw=dict(width_ratios=[2, 1]))
    for k, (name, entry) in enumerate(modes.items()):
        curve, colour = entry['loss_curve'], f'C{k}'
        mean, std = np.array(curve['mean']), np.array(curve['std'])
        ax_loss.plot(curve['iter'], mean, color=colour,
                     label=f'{name} ({len(entry["seeds"])} seeds)')
        ax_loss.fill_between(curve['iter'], mean - std, mean + std, color=colour, alpha=0.2)
        ax_miou.scatter([k] * len(entry['miou']), entry['miou'], color=colour, alpha=0.6)
        ax_miou.errorbar([k + 0.15], [entry['miou_mean']], yerr=[entry['miou_std'] or 0.0],
                         color=colour, fmt='D', capsize=4)
    ax_loss.set(xlabel='iteration', ylabel='training loss', yscale='log')
    ax_loss.set_title('Training loss: mean of the seeds, band = one std', fontsize=10)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_miou.set_xticks(range(len(modes)), list(modes))
    ax_miou.set_ylabel('val mIoU (%)')
    ax_miou.set_title('Validation mIoU per seed; mean +- std', fontsize=10)
    ax_miou.grid(alpha=0.3, axis='y')
    ax_miou.margins(x=0.2)
    fig.tight_layout()
    return fig


def provenance(repo: str) -> dict[str, Any]:
    """The commit (with ``+dirty`` for uncommitted changes), the CPU and its cores."""
    def git(*args: str) -> str:
        return subprocess.run(['git', '-C', repo, *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        commit = git('rev-parse', '--short', 'HEAD') or None
        if commit and git('status', '--porcelain', '--untracked-files=no'):
            commit += '+dirty'
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((line.split(':', 1)[1].strip() for line in f
                        if line.startswith('model name')), cpu)
    except OSError:
        pass
    return dict(commit=commit, cpu=cpu, cores=os.cpu_count())
