"""Kernel ops and host synchronisations of a training step, counted where torch dispatches them.

A GPU is fast because the host queues kernels ahead of the device; an op whose result the host
must read (``.item()``, ``bool(t)``, ``nonzero``, ``unique``, indexing with a bool mask) makes it
wait until the device has drained its queue. Both are visible on CPU: ``DispatchCount`` is a
``TorchDispatchMode`` that sees every aten op a step dispatches (an extension op counts once, as
one call of its own), counts those that run a kernel (not views, not allocations) and records
where each syncing op was called from (the innermost frame outside torch), so that Mesa's syncs
can be told from the model's own.
"""
from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result the host must read before it can go on.
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten._unique2.default,
           aten.unique_dim.default, aten.unique_consecutive.default,
           aten.masked_select.default, aten.equal.default, aten.is_nonzero.default,
           aten.nonzero_static.default}
# Indexing ops that sync when an index is a bool mask (its positions are found first).
MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                 aten._index_put_impl_.default}
# Ops that run no kernel: storage made, nothing computed (views are told by their schema).
FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
        aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default,
        aten.detach.default, aten._unsafe_view.default, aten.alias.default,
        aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.set_.source_Storage}

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def is_view(func: Any) -> bool:
    """Whether an op returns a view of an input (an alias it does not write)."""
    return any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns)


def syncs(func: Any, args: tuple) -> bool:
    """Whether this call makes the host wait for the device."""
    if func in SYNCING:
        return True
    if func in MASK_INDEXING:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices or ())
    if func is aten.repeat_interleave.Tensor:
        return True  # its output size is read from the repeats
    return False


def call_site() -> str:
    """``path:line`` of the innermost frame outside torch and this file (``mmseg_mesa/...`` for
    Mesa's own code), skipping ``__torch_function__`` handlers, which pass a model's own calls
    on (``layers.intercept``): the sync is then the model's."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(TORCH) or path == __file__ or 'site-packages/torch/' in path
                or frame.f_code.co_name == '__torch_function__'):
            if path.startswith(PACKAGE):
                return f'mmseg_mesa/{os.path.relpath(path, PACKAGE)}:{frame.f_lineno}'
            return f'{_short(path)}:{frame.f_lineno}'
        frame = frame.f_back
    return '?'


def _short(path: str) -> str:
    marker = 'site-packages/'
    return path[path.index(marker) + len(marker):] if marker in path else os.path.basename(path)


@dataclass
class DispatchCount:
    """Counts of one region: kernel ops by name, syncing ops by ``(name, call site)``."""

    kernels: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)

    @property
    def kernel_ops(self) -> int:
        return sum(self.kernels.values())

    @property
    def sync_ops(self) -> int:
        return sum(self.syncs.values())

    def mesa_syncs(self) -> collections.Counter:
        """The syncs called from ``mmseg_mesa``'s own code."""
        return collections.Counter({key: n for key, n in self.syncs.items()
                                    if key[1].startswith('mmseg_mesa/')})

    def sync_names(self) -> collections.Counter:
        """Syncs by op name, wherever called."""
        names: collections.Counter = collections.Counter()
        for (name, _), n in self.syncs.items():
            names[name] += n
        return names


class CountDispatch(TorchDispatchMode):
    """``with CountDispatch() as mode: ...`` fills ``mode.count``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = DispatchCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, 'overloadpacket') else str(func)
        if syncs(func, args):
            self.count.syncs[(name, call_site())] += 1
        if func not in FREE and not is_view(func):
            self.count.kernels[name] += 1
        return func(*args, **kwargs)


def count_step(step: Any) -> DispatchCount:
    """The counts of ``step()`` (forward and backward: autograd's engine dispatches through the
    mode too)."""
    with CountDispatch() as mode:
        step()
    return mode.count


def cycle_average(due: DispatchCount, regular: DispatchCount, every: int) -> DispatchCount:
    """The counts per step over ``every`` steps: one ``due`` (every ``host.LateReading``
    measures), the others ``regular`` (none does); fractional."""
    out = DispatchCount()
    for count, weight in ((due, 1), (regular, every - 1)):
        for name, n in count.kernels.items():
            out.kernels[name] += n * weight / every
        for key, n in count.syncs.items():
            out.syncs[key] += n * weight / every
    return out


def step_counts(model: torch.nn.Module, batch: tuple, mode: str = 'baseline',
                device: str = 'cpu', warmup: bool = True) -> DispatchCount:
    """The counts of a forward + backward of ``model``, after an uncounted one where
    ``warmup`` (first calls make quantizers and take first readings), with the CPU on a
    device's branches (``host.device_path``): per step over a cycle of
    ``host.MEASURE_EVERY`` steps, of which one measures its replay errors (two steps counted,
    one with every reading due, ``cycle_average``)."""
    from ..host import MEASURE_EVERY, device_path, measuring_every_call
    from .memory import forward_loss

    def step() -> None:
        forward_loss(model, batch, mode, device).backward()
        model.zero_grad(set_to_none=True)

    with device_path():
        if warmup:
            step()
        with measuring_every_call():
            due = count_step(step)
        return cycle_average(due, count_step(step), MEASURE_EVERY)


def added_syncs(mesa: DispatchCount, baseline: DispatchCount) -> dict[str, int]:
    """Syncing ops Mesa's step runs beyond the baseline's, by op name (where Mesa rewrites a
    step of the model that syncs, as mmdet's sampler, the two counts meet)."""
    added = mesa.sync_names()
    added.subtract(baseline.sync_names())
    return {name: n for name, n in added.items() if n > 0}


def compared(count: DispatchCount, baseline: DispatchCount | None) -> dict:
    """What the tools report of a step against the baseline's: kernel ops and syncs (both
    steps'), the kernel-op ratio and the syncs added (None without a baseline), and the syncs
    called from ``mmseg_mesa`` (``'N x op at site'``)."""
    return dict(kernel_ops=round(count.kernel_ops), syncs=round(count.sync_ops),
                baseline_kernel_ops=round(baseline.kernel_ops) if baseline else None,
                baseline_syncs=round(baseline.sync_ops) if baseline else None,
                kernel_ratio=count.kernel_ops / baseline.kernel_ops if baseline else None,
                added_syncs=({name: round(n) for name, n in added_syncs(count, baseline).items()
                              if round(n)} if baseline else None),
                mesa_sync_sites=sorted(f'{n:g} x {name} at {site}'
                                       for (name, site), n in count.mesa_syncs().items()))
