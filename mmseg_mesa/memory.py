"""Measuring activation memory: bytes of tensors autograd saves for backward.

On CPU this is the honest measure of what Mesa changes (allocator peaks are not observable);
storages are counted once however many tensors view them, and Parameters are excluded because
they are not activations. Every Mesa layer saves through ``ctx.save_for_backward``, so the hooks
see its packed data.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SavedTensorReport:
    """Deduplicated bytes saved for backward, in total and by the innermost module.

    ``by_type`` counts by that module's type, ``by_module`` by its qualified name (``''`` is the
    model itself, ``'<functional>'`` means no module was running), and ``storages`` maps each
    counted storage (``storage_key``) to that name and its bytes, so a caller can tell who saved
    what (``tools/coverage.py`` splits it into Mesa's saves and the rest).
    """

    total_bytes: int = 0
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
    seen: set[tuple[str, int]] = set()
    excluded: set[tuple[str, int]] = set()
    stack: list[tuple[str, str]] = []  # (qualified name, type) of the running modules
    handles = []
    if model is not None:
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.numel():
                excluded.add(storage_key(tensor))
        for qualified, module in model.named_modules():
            if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                continue
            # converted modules count under the type they replaced, so modes compare by type
            name = getattr(module, 'mesa_original_type', type(module).__name__)
            handles.append(module.register_forward_pre_hook(
                lambda _m, _i, entry=(qualified, name): stack.append(entry)))
            handles.append(module.register_forward_hook(lambda *_: stack.pop() and None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            key = storage_key(t)
            if key not in seen and key not in excluded:
                seen.add(key)
                nbytes = t.untyped_storage().nbytes()
                qualified, name = stack[-1] if stack else ('<functional>', '<functional>')
                report.total_bytes += nbytes
                report.by_type[name] += nbytes
                report.by_module[qualified] += nbytes
                report.storages[key] = (qualified, nbytes)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield report
    finally:
        for handle in handles:
            handle.remove()
