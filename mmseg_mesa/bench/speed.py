"""Training-step time per mode, the modes interleaved round by round.

Each round times one training step of every mode in turn (``memory.run_step``: forward,
backward, the optimizer step), so that a slow spell of a shared machine falls on every mode
alike; a mode's ratio to ``baseline`` is the median over rounds of the ratio within a round.
``tools/benchmark_speed.py`` is the command line over it.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch

from .memory import forward_loss, run_step, synchronize


def interleaved_times(models: dict[str, torch.nn.Module],
                      optimizers: dict[str, torch.optim.Optimizer], batch: tuple, device: str,
                      warmup: int, iters: int) -> dict[str, list[float]]:
    """Per mode, the times of ``iters`` training steps, after ``warmup`` untimed rounds."""
    times: dict[str, list[float]] = {mode: [] for mode in models}
    for round_ in range(warmup + iters):
        for mode, model in models.items():
            synchronize(device)
            start = time.perf_counter()
            run_step(model, batch, mode, device, optimizers[mode])
            synchronize(device)
            if round_ >= warmup:
                times[mode].append(time.perf_counter() - start)
    return times


def step_times(times: dict[str, list[float]]) -> dict[str, dict]:
    """Per mode: the median step time, the times, ``ratio`` (the median over rounds of the
    mode's time over the baseline's in the same round) and ``ratio_of_medians``; the ratios are
    None without a ``baseline`` mode."""
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    baseline = medians.get('baseline')
    paired = {mode: statistics.median(t / b for t, b in zip(times[mode], times['baseline']))
              for mode in times} if baseline else {}
    return {mode: dict(step_time_s=medians[mode], times_s=times[mode], ratio=paired.get(mode),
                       ratio_of_medians=medians[mode] / baseline if baseline else None)
            for mode in times}


def profile_step(model: torch.nn.Module, batch: tuple, mode: str, device: str,
                 rows: int = 15) -> str:
    """torch.profiler's table of one forward + backward step, by self time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == 'cuda' else [])
    with profile(activities=activities) as prof:
        forward_loss(model, batch, mode, device).backward()
    model.zero_grad(set_to_none=True)
    key = 'self_cuda_time_total' if device == 'cuda' else 'self_cpu_time_total'
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def dispatch_counts(models: dict[str, torch.nn.Module], batch: tuple, device: str
                    ) -> dict[str, dict]:
    """Per mode: kernel ops and host syncs of one forward + backward (``dispatch.step_counts``),
    their ratios to ``baseline``'s, the syncs it adds to the baseline's by op name, and its
    syncs called from ``mmseg_mesa`` by site; on a GPU also the synchronizing calls CUDA itself
    reports for one more step (``cuda_sync_warnings``)."""
    from .dispatch import compared, step_counts
    counts = {mode: step_counts(model, batch, mode, device) for mode, model in models.items()}
    results = {mode: compared(c, counts.get('baseline')) for mode, c in counts.items()}
    if device == 'cuda':
        for mode, model in models.items():
            results[mode]['cuda_sync_warnings'] = cuda_sync_warnings(model, batch, mode)
    return results


def cuda_sync_warnings(model: torch.nn.Module, batch: tuple, mode: str) -> list[str]:
    """The first line of each warning CUDA gives for a synchronizing call during one forward +
    backward (``torch.cuda.set_sync_debug_mode('warn')``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try:
            forward_loss(model, batch, mode, 'cuda').backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        model.zero_grad(set_to_none=True)
    return [str(w.message).splitlines()[0] for w in caught
            if 'synchroniz' in str(w.message).lower()]


def format_counts(counts: dict[str, dict]) -> str:
    """The table ``--count`` prints."""
    lines = ['kernel ops and host syncs per forward + backward (CPU on a device\'s branches)']
    for mode, entry in counts.items():
        ratio = f'{entry["kernel_ratio"]:.2f}x' if entry['kernel_ratio'] is not None else '-'
        added = sum((entry['added_syncs'] or {}).values())
        cuda = entry.get('cuda_sync_warnings')
        lines.append(f'  {mode:<24} {entry["kernel_ops"]:6d} ops {ratio:>6}  '
                     f'{entry["syncs"]:4d} syncs, {added} added'
                     + (f'; CUDA reports {len(cuda)} synchronizing calls' if cuda is not None
                        else ''))
        lines += [f'      {site}' for site in entry['mesa_sync_sites']]
    return '\n'.join(lines)
