"""What ``tools/calibrate.py`` measures: a config's calibration (``mmseg_mesa.calibration``) on
a random batch, with its cost against one training step of the same batch.

The time of the calibration against one Mesa step with the chosen codes (after it, so that
first-call costs count in neither), and optionally (``peak=True``, slower: torch's
``MemTracker`` follows every tensor) the peak tensor bytes of the calibration against those of
one baseline (unconverted) step and one Mesa step at that batch: the calibration must fit where
the baseline step does. What the refined layers add is given as a share of the baseline's saved
bytes at that batch (the sweeps' "saved" unit).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch


def report_row(report: Any) -> dict:
    """A ``CalibrationReport`` as JSON-ready fields (the sweeps' rows keep it too)."""
    return dict(refined=[dict(name=c.name, error=c.error, parameter=c.parameter,
                              parameter_error=c.parameter_error, extra_bytes=c.extra_bytes)
                         for c in report.refined],
                candidates=report.candidates, passes=report.passes, before=report.before,
                after=report.after, seconds=report.seconds, step_seconds=report.step_seconds,
                extra_bytes=report.extra_bytes, saved_bytes=report.saved_bytes,
                exhausted=report.exhausted)


def _peak(model: torch.nn.Module, run: Callable[[Any], Any], *external: torch.Tensor) -> int:
    """Peak tensor bytes while ``run(tracker)`` runs, the model's Parameters, buffers and
    gradients and ``external`` counted."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, *external)
    with tracker:
        run(tracker)
    peaks = tracker.get_tracker_snapshot('peak')
    return max(stats['Total'] for stats in peaks.values())


def _step(model: torch.nn.Module, batch: tuple) -> None:
    from .models import loss_of
    torch.manual_seed(1)
    loss_of(model(*batch, mode='loss')).backward()
    model.zero_grad(set_to_none=True)


def _stepper(model: torch.nn.Module, batch: tuple) -> Callable[[Any], None]:
    return lambda tracker: _step(model, batch)


def calibrate_config(cfg: Any, size: tuple[int, int], batch: int | None = None,
                     peak: bool = False) -> dict:
    """Build ``cfg``'s model (random weights), convert it with the config's ``mesa`` setting
    (calibration on, with the default bounds, where it says nothing of it) and calibrate it on
    ``batch`` random ``size`` images; the report, the chosen layers and the costs."""
    from ..calibration import calibrate
    from ..config import Calibration
    from ..convert import convert_to_mesa
    from ..memory import count_saved_tensors
    from .models import build_model, loss_of, make_batch, mesa_config_of
    config = mesa_config_of(cfg)
    bounds = config.calibrate or Calibration()
    n = batch or bounds.batch
    reference = build_model(cfg, 'cpu')
    data = make_batch(cfg, n, size, 'cpu')
    reference.train()
    model = copy.deepcopy(reference)
    result: dict[str, Any] = dict(size=list(size), batch=n, parameter_bytes=sum(
        p.numel() * p.element_size() for p in reference.parameters()))
    with count_saved_tensors(reference) as saved:
        loss_of(reference(*data, mode='loss'))
    result['baseline_saved_bytes'] = saved.total_bytes
    if peak:
        result['baseline_step_peak'] = _peak(reference, _stepper(reference, data), data[0])
    del reference
    convert_to_mesa(model, config=config)
    model.train()

    def run(tracker: Any = None) -> Any:
        def step() -> torch.Tensor:
            if tracker is not None:  # its per-module stats follow one forward at a time
                tracker.reset_mod_stats()
            return loss_of(model(*data, mode='loss'))
        return calibrate(model, step, bounds)

    if peak:
        holder: list = []
        result['calibration_peak'] = _peak(model, lambda tracker: holder.append(run(tracker)),
                                           data[0])
        report = holder[0]
        result['mesa_step_peak'] = _peak(model, _stepper(model, data), data[0])
    else:
        report = run()
    start = time.perf_counter()
    _step(model, data)
    result['mesa_step_seconds'] = time.perf_counter() - start
    result.update(report_row(report))
    # what the refined layers add, as a share of the baseline's saved bytes (the sweeps' unit)
    result['added_share'] = report.extra_bytes / max(saved.total_bytes, 1)
    result['report'] = report.format()
    return result


def format_cost(result: dict) -> str:
    """The costs of a ``calibrate_config`` result, one line each."""
    lines = [f"refined: +{result['extra_bytes'] / 2**20:.2f} MiB saved, "
             f"{result['added_share']:.4f} of the baseline's saved bytes "
             f"({result['baseline_saved_bytes'] / 2**20:.0f} MiB)",
             f"calibration: {result['seconds']:.1f} s = {result['passes']} steps, "
             f"{result['seconds'] / result['mesa_step_seconds']:.1f}x one Mesa step "
             f"({result['mesa_step_seconds']:.2f} s) at batch {result['batch']}, "
             f"{result['size'][0]}x{result['size'][1]}"]
    if 'calibration_peak' in result:
        lines.append(f"peak: calibration {result['calibration_peak'] / 2**20:.0f} MiB, one "
                     f"Mesa step {result['mesa_step_peak'] / 2**20:.0f} MiB, one baseline step "
                     f"{result['baseline_step_peak'] / 2**20:.0f} MiB (and AdamW's state, "
                     f"{2 * result['parameter_bytes'] / 2**20:.0f} MiB, in training)")
        lines.append('(times under --peak include its tracking: run without it for the time)')
    return '\n'.join(lines)
