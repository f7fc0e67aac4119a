"""Measuring memory: bytes autograd saves for backward, and the peak of a whole training step.

``count_saved_tensors``: what autograd keeps for backward (storages counted once, Parameters
excluded). Every Mesa layer saves through ``ctx.save_for_backward``, so the hooks see its packed
data. ``track_step_peak``: the peak tensor memory of one training step (forward, backward,
optimizer step) as torch's ``MemTracker`` follows every storage (a TorchDispatchMode; it works on
CPU, where allocator statistics do not exist), by category at the peak and where it happened.
This is the number a GPU runs out at: it also holds weights, gradients, optimizer state and every
transient tensor. ``BatchPlan``: that peak as a function of the batch, fitted at two measured
batches, and the largest batch that fits in a budget (``parse_bytes`` reads one, ``'4GiB'``).
"""
from __future__ import annotations

import math
import re
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .saved import SOFTMAX_OUTPUT, saved_label


@dataclass
class SavedTensorReport:
    """Deduplicated bytes saved for backward, in total and by the innermost module.

    ``by_type`` counts by that module's type, ``by_module`` by its qualified name (``''`` is the
    model itself, ``'<functional>'`` means no module was running), and ``storages`` maps each
    counted storage (``storage_key``) to that name and its bytes, so a caller can tell who saved
    what (``tools/coverage.py`` splits it into Mesa's saves and the rest); where a storage was
    freed and its address reused by a later one, the later one's entry replaces it.
    ``softmax_bytes`` is the part that softmax outputs take (attention maps, in transformers):
    torch's softmax keeps its output, Mesa's softmax its codes.
    """

    total_bytes: int = 0
    softmax_bytes: int = 0
    by_type: Counter = field(default_factory=Counter)
    by_module: Counter = field(default_factory=Counter)
    storages: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """What identifies a tensor's storage (views of one storage share it)."""
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr()


@contextmanager
def count_saved_tensors(model: nn.Module | None = None) -> Iterator[SavedTensorReport]:
    """Count what autograd saves inside the ``with`` block.

    Args:
        model: If given, its Parameters and buffers are excluded and bytes are attributed to the
            innermost module running when they were saved, by type and by qualified name
            (``'<functional>'`` when none; a converted Mesa module counts as the type it
            replaced). Defaults to None.
    """
    report = SavedTensorReport()
    # Counted storages by address, each with a weak reference: a storage freed inside the block
    # (a graph dropped in forward, a recomputation in a layer's backward) can leave its address to
    # a later one, which must count too. Storages keep their Python object while they live.
    seen: dict[tuple[str, int], weakref.ref] = {}
    excluded: set[tuple[str, int]] = set()
    stack: list[tuple[str, str]] = []  # (qualified name, type) of the running modules
    handles = []
    if model is not None:
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.numel():
                excluded.add(storage_key(tensor))
        names: dict[int, tuple[str, str]] = {}
        for qualified, module in model.named_modules():
            if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                continue
            # converted modules count under the type they replaced, so modes compare by type
            names[id(module)] = (qualified, getattr(module, 'mesa_original_type',
                                                    type(module).__name__))

        # Global module hooks, not hooks on the model's modules: counting must not change what
        # a module sees of itself (a layer that runs a child's steps itself where it has no
        # hooks of its own, ``MesaUPerHead``'s fused bottleneck, would run otherwise).
        def enter(module: nn.Module, _: Any) -> None:
            entry = names.get(id(module))
            if entry is not None:
                stack.append(entry)

        def leave(module: nn.Module, *_: Any) -> None:
            if id(module) in names:
                stack.pop()

        handles.append(register_module_forward_pre_hook(enter))
        handles.append(register_module_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            key = storage_key(t)
            counted = seen.get(key)
            if (counted is None or counted() is None) and key not in excluded:
                storage = t.untyped_storage()
                seen[key] = weakref.ref(storage)
                nbytes = storage.nbytes()
                qualified, name = stack[-1] if stack else ('<functional>', '<functional>')
                report.total_bytes += nbytes
                if saved_label(t) == SOFTMAX_OUTPUT or \
                        type(t.grad_fn).__name__ == 'SoftmaxBackward0':
                    report.softmax_bytes += nbytes
                report.by_type[name] += nbytes
                report.by_module[qualified] += nbytes
                report.storages[key] = (qualified, nbytes)
        # A detached alias (same storage): a saved output packed as itself holds its own grad_fn,
        # a cycle through C++ that Python's collector cannot free, so a graph never run
        # backward (split_saved's) would keep its model's Parameters alive.
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield report
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class StepPeak:
    """The peak tensor memory of one training step.

    Attributes:
        peak_bytes: The largest total of live tensor bytes during the step.
        by_category: MemTracker's categories at that moment (Parameter, Gradient, Optstate,
            Activation: created in forward, Temp: created in backward, Buffer, Other).
        phase: ``'forward'``, ``'backward'`` or ``'optimizer'``: where the peak was reached.
        module: The innermost module running at the peak, by its name in the model
            (``'<model>'``: the model itself, outside its children; ``''``: outside the model).
        phase_peaks: The peak of each phase: ``forward``, ``backward`` (the largest total while
            a module's backward ran: what is alive then, the forward's saved tensors included)
            and ``optimizer`` (the step and ``zero_grad``, with the gradients and optimizer
            state it starts from). Each is fitted on its own by ``BatchPlan``.
        site_peaks: The peak while each module call ran, in forward (``'forward:NAME#K'``, the
            K-th call of module NAME) and in its backward (``'backward:NAME#K'``). ``BatchPlan``
            fits each too: the place that holds the step's peak can move with the batch.
    """

    peak_bytes: int
    by_category: dict[str, int]
    phase: str
    module: str
    phase_peaks: dict[str, int]
    site_peaks: dict[str, int] = field(default_factory=dict)


def track_step_peak(model: nn.Module, optimizer: torch.optim.Optimizer,
                    loss_fn: Callable[[], torch.Tensor], *external: torch.Tensor) -> StepPeak:
    """Run ``loss_fn().backward()``, ``optimizer.step()`` and ``zero_grad`` under MemTracker.

    Args:
        model: The model (its Parameters, buffers and gradients are followed).
        optimizer: Its optimizer; run a warm-up step first so its state exists, as in training.
        loss_fn: Runs the forward pass and returns the scalar loss.
        external: Other live tensors to count (the input batch).
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *external)
    with tracker:
        loss = loss_fn()
        after_forward = _tracked_peak(tracker)
        loss.backward()
        del loss
    overall = _tracked_peak(tracker)
    # Backward on its own: the largest total any module saw during its backward (MemTracker's
    # PEAK_BW snapshots; the model's own spans the whole backward). Up to the end of backward the
    # forward's peak would hide it, though backward grows faster with the batch on some models.
    backward_peak = max((snap[device]['Total'] for stats in tracker.memory_tracking.values()
                         for state, snaps in stats.snapshots.items() if state.name == 'PEAK_BW'
                         for snap in snaps for device in snap), default=overall)
    # The optimizer step in a tracker of its own, so that its peak is known on its own.
    step_tracker = MemTracker()
    step_tracker.track_external(model, optimizer, *external)
    with step_tracker:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer_peak = _tracked_peak(step_tracker)
    phase_peaks = dict(forward=after_forward, backward=backward_peak, optimizer=optimizer_peak)
    if optimizer_peak > overall:
        phase, peak, source = 'optimizer', optimizer_peak, step_tracker
    else:
        phase = 'forward' if after_forward == overall else 'backward'
        peak, source = overall, tracker
    device = next(iter(source.get_tracker_snapshot('peak')))
    snapshot = source.get_tracker_snapshot('peak')[device]
    module, depth = '', -1
    root = type(model).__name__
    expected = 'PEAK_FW' if phase == 'forward' else 'PEAK_BW'
    for stats in tracker.memory_tracking.values() if phase != 'optimizer' else ():
        for state, snaps in stats.snapshots.items():
            top = max((snap[device]['Total'] for snap in snaps if device in snap), default=0)
            name_depth = stats.mod_fqn.count('.')
            if state.name == expected and top == peak and name_depth > depth:
                module, depth = stats.mod_fqn, name_depth
    if module == root:
        module = '<model>'
    elif module.startswith(root + '.'):
        module = module[len(root) + 1:]
    by_category = {getattr(key, 'value', str(key)): value for key, value in snapshot.items()
                   if getattr(key, 'value', key) != 'Total' and value}
    return StepPeak(peak, by_category, phase, module, phase_peaks, _site_peaks(tracker))


def _site_peaks(tracker: Any) -> dict[str, int]:
    """Every module call's peak total in forward and in backward (all devices summed)."""
    sites = {}
    for stats in tracker.memory_tracking.values():
        for state, snaps in stats.snapshots.items():
            if state.name in ('PEAK_FW', 'PEAK_BW'):
                phase = 'forward' if state.name == 'PEAK_FW' else 'backward'
                for call, snap in enumerate(snaps):
                    sites[f'{phase}:{stats.mod_fqn}#{call}'] = sum(
                        dev_snap['Total'] for dev_snap in snap.values())
    return sites


def _tracked_peak(tracker: object) -> int:
    peaks = tracker.get_tracker_snapshot('peak')  # type: ignore[attr-defined]
    return sum(snap['Total'] for snap in peaks.values())


BINARY_UNITS = {'B': 1, 'KiB': 2 ** 10, 'MiB': 2 ** 20, 'GiB': 2 ** 30, 'TiB': 2 ** 40}


def parse_bytes(text: str, default_unit: str = 'GiB') -> int:
    """``'4'``, ``'4GiB'``, ``'512 MiB'`` as bytes; a bare number is in ``default_unit``.

    Only binary units: every figure the tools print is in MiB / GiB, and a decimal GB next to
    them would be off by 7%.
    """
    match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*', text)
    unit = match and (match.group(2) or default_unit)
    factor = next((f for name, f in BINARY_UNITS.items() if name.lower() == (unit or '').lower()),
                  None)
    if match is None or factor is None:
        raise ValueError(f'{text!r} is not a size: a number (in {default_unit}) or a number with '
                         f'one of {", ".join(BINARY_UNITS)}, e.g. 4GiB or 512MiB')
    size = float(match.group(1)) * factor
    if size <= 0:
        raise ValueError(f'{text!r}: a size must be positive')
    return int(size)


def format_bytes(size: float) -> str:
    """``size`` in the largest binary unit that keeps it at 1 or more: ``'1 GiB'``."""
    name, factor = next(((n, f) for n, f in reversed(BINARY_UNITS.items()) if size >= f),
                        ('B', 1))
    return f'{size / factor:.4g} {name}'


@dataclass(frozen=True)
class BatchPlan:
    """The step peak as a function of the batch, fitted at two measured batches.

    Each phase's peak (``StepPeak.phase_peaks``) is fitted as ``fixed + per_image * batch``:
    weights, gradients and optimizer state are fixed, activations and transients scale with the
    batch. So is the peak of each module call (``StepPeak.site_peaks``): at a larger batch the
    step's peak can move to another place that grows faster (Swin-T UPerNet: the fused
    bottleneck holds it at batches 2 and 4, the bottleneck's BatchNorm at 8), which the fit of
    the phase's peak alone misses. The predicted peak is the largest of all these lines.

    Attributes:
        batches: The two measured batch sizes.
        fits: Per phase, ``(fixed bytes, bytes per image)``.
        site_fits: The same per module call measured at both batches.
    """

    batches: tuple[int, int]
    fits: dict[str, tuple[float, float]]
    site_fits: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def fit(cls, low_batch: int, low: Mapping[str, int], high_batch: int,
            high: Mapping[str, int], low_sites: Mapping[str, int] | None = None,
            high_sites: Mapping[str, int] | None = None) -> BatchPlan:
        """From the phase peaks (and the site peaks, where given) at two batch sizes; a site
        measured at only one of them is left out.

        Raises:
            ValueError: The batches are equal or the peak did not grow with the batch (nothing
                to extrapolate).
        """
        if high_batch == low_batch:
            raise ValueError(f'BatchPlan.fit needs two batch sizes, got {low_batch} twice')

        def lines(lows: Mapping[str, int], highs: Mapping[str, int]) -> dict:
            slopes = {k: (highs[k] - lows[k]) / (high_batch - low_batch)
                      for k in lows if k in highs}
            return {k: (lows[k] - slope * low_batch, slope) for k, slope in slopes.items()}

        # a site that does not grow cannot take the peak from the phases above it
        sites = {k: line for k, line in lines(low_sites or {}, high_sites or {}).items()
                 if line[1] > 0}
        plan = cls((low_batch, high_batch), lines(low, high), sites)
        if plan.per_image_bytes <= 0:
            raise ValueError(f'the step peak did not grow with the batch ({dict(low)} at '
                             f'{low_batch} -> {dict(high)} at {high_batch}); cannot extrapolate')
        return plan

    def predict(self, batch: int) -> float:
        """The predicted step peak at ``batch``, in bytes."""
        return max(fixed + per_image * batch
                   for fixed, per_image in [*self.fits.values(), *self.site_fits.values()])

    def place(self, batch: int) -> str:
        """The phase or site whose line gives the predicted peak at ``batch``."""
        lines = {**self.fits, **self.site_fits}
        return max(lines, key=lambda k: lines[k][0] + lines[k][1] * batch)

    @property
    def per_image_bytes(self) -> float:
        """What each image adds to the step peak (the steepest phase)."""
        return max(per_image for _, per_image in self.fits.values())

    @property
    def steepest_per_image_bytes(self) -> float:
        """What each image adds at large batches: the steepest line, phase or module call."""
        return max(per_image for _, per_image in [*self.fits.values(), *self.site_fits.values()])

    @property
    def fixed_bytes(self) -> float:
        """The peak of no images by the phases' lines: weights, gradients, optimizer state."""
        return max(fixed for fixed, _ in self.fits.values())

    def largest_batch(self, budget_bytes: float) -> int:
        """The largest batch whose predicted step peak fits in ``budget_bytes`` (0: none)."""
        growing = [(budget_bytes - fixed) / per_image
                   for fixed, per_image in [*self.fits.values(), *self.site_fits.values()]
                   if per_image > 0]
        batch = max(0, math.floor(min(growing)))
        while batch and self.predict(batch) > budget_bytes:  # phases that do not grow
            batch -= 1
        return batch

    def summary(self, budget_bytes: float) -> dict:
        """The plan for ``budget_bytes`` as JSON-ready numbers."""
        largest = self.largest_batch(budget_bytes)
        return dict(batches=list(self.batches), budget_bytes=int(budget_bytes),
                    fixed_bytes=self.fixed_bytes, per_image_bytes=self.per_image_bytes,
                    steepest_per_image_bytes=self.steepest_per_image_bytes,
                    max_batch=largest, predicted_bytes=self.predict(largest) if largest else None)
