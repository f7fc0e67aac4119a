"""What Mesa leaves uncompressed: the baseline's and the converted model's saved bytes, and who
saved what.

Every storage saved for backward during a training forward is sorted by who saved it: one of
Mesa's autograd Functions (a compressed copy, a mask, exact statistics) or anything else (an op
of a module Mesa did not convert, or a functional op), by the innermost module running at the
time. ``tools/coverage.py`` is the command line over ``coverage`` and ``format_result``; the
zoo tests hold models to a share left uncompressed with ``split_saved``.
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ..reuse import count_reuse
from .models import build_model, make_batch, mesa_config_of

FUNCTIONAL = '<functional>'


def mesa_backward_names() -> set[str]:
    """Class names of the backward nodes of every autograd Function mmseg_mesa defines."""
    import mmseg_mesa  # noqa: F401  (imports every layer, so every Function is defined)
    names, todo = set(), list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith('mmseg_mesa'):
            names.add(f'{cls.__name__}Backward')
    return names


def mesa_saved_storages(outputs: list[torch.Tensor]) -> dict[tuple[str, int], bool]:
    """Storages saved by Mesa Functions in the graph that produced ``outputs`` (before backward),
    each with whether it is floating point (not codes, masks or indices)."""
    from torch.autograd.function import BackwardCFunction

    from mmseg_mesa.memory import storage_key
    names = mesa_backward_names()
    keys: dict[tuple[str, int], bool] = {}
    seen: set[int] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, BackwardCFunction) and type(node).__name__ in names:
            keys.update((storage_key(t), t.is_floating_point()) for t in node.saved_tensors
                        if t is not None and t.numel())
        todo.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return keys


def losses_of(result: dict) -> list[torch.Tensor]:
    """The differentiable entries of mmseg's loss dict (mmengine sums those named '*loss*')."""
    out = []
    for name, value in result.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if 'loss' in name:
            out.extend(v for v in values if isinstance(v, torch.Tensor) and v.requires_grad)
    return out


def module_types(model: torch.nn.Module) -> dict[str, str]:
    """Qualified name -> type name, Mesa modules marked with the type they replaced."""
    from mmseg_mesa import MesaModule
    types = {}
    for name, module in model.named_modules():
        original = getattr(module, 'mesa_original_type', type(module).__name__)
        types[name] = f'{original} (Mesa)' if isinstance(module, MesaModule) else original
    types[FUNCTIONAL] = FUNCTIONAL
    return types


def split_saved(model: torch.nn.Module, forward: Callable[[], list[torch.Tensor]]) -> dict:
    """Bytes saved while ``forward()`` runs; those not saved by a Mesa Function (``left``) and
    the floating-point ones Mesa Functions saved (``mesa_float``), by the qualified name of the
    innermost module that saved them."""
    from mmseg_mesa.memory import count_saved_tensors
    with count_saved_tensors(model) as saved:
        outputs = forward()
    mesa_keys = mesa_saved_storages(outputs)
    left: Counter = Counter()
    mesa_float: Counter = Counter()
    for key, (name, nbytes) in saved.storages.items():
        if key not in mesa_keys:
            left[name] += nbytes
        elif mesa_keys[key]:
            mesa_float[name] += nbytes
    del outputs
    return dict(saved_bytes=saved.total_bytes, left_bytes=sum(left.values()),
                left_by_module=dict(left), mesa_float_bytes=sum(mesa_float.values()),
                mesa_float_by_module=dict(mesa_float))


def training_forward(model: torch.nn.Module, batch: tuple) -> Callable[[], list[torch.Tensor]]:
    def forward() -> list[torch.Tensor]:
        torch.manual_seed(1)  # the same dropout / drop-path draws in every model
        return losses_of(model(*batch, mode='loss'))

    return forward


def coverage(cfg: Any, size: tuple[int, int], batch_size: int) -> dict:
    """Baseline and Mesa saved bytes, and what Mesa left uncompressed, by module and type."""
    from mmseg_mesa import convert_to_mesa
    config = mesa_config_of(cfg)
    base = build_model(cfg, 'cpu')
    batch = make_batch(cfg, batch_size, size, 'cpu')
    baseline = split_saved(base, training_forward(base, batch))
    model = copy.deepcopy(base)
    del base
    report = convert_to_mesa(model, config=config)
    with count_reuse(model) as reuse:
        mesa = split_saved(model, training_forward(model, batch))
    types = module_types(model)
    total = baseline['saved_bytes']
    by_type: Counter = Counter()
    for name, nbytes in mesa['left_by_module'].items():
        by_type[types.get(name, '?')] += nbytes
    float_by_type: Counter = Counter()
    for name, nbytes in mesa['mesa_float_by_module'].items():
        float_by_type[types.get(name, '?')] += nbytes
    modules = sorted(mesa['left_by_module'].items(), key=lambda kv: -kv[1])
    return dict(
        size=list(size), batch=batch_size, mesa=str(config),
        baseline_bytes=total, mesa_bytes=mesa['saved_bytes'],
        saved_ratio=mesa['saved_bytes'] / total, left_bytes=mesa['left_bytes'],
        left_share=mesa['left_bytes'] / total,
        left_by_type=[dict(type=t, bytes=b, share=b / total)
                      for t, b in sorted(by_type.items(), key=lambda kv: -kv[1])],
        left_by_module=[dict(name=n or '(model)', type=types.get(n, '?'), bytes=b,
                             share=b / total) for n, b in modules],
        mesa_float_bytes=mesa['mesa_float_bytes'],
        mesa_float_share=mesa['mesa_float_bytes'] / total,
        mesa_float_by_type=[dict(type=t, bytes=b, share=b / total)
                            for t, b in sorted(float_by_type.items(), key=lambda kv: -kv[1])],
        unconverted=[dict(type=t, reason=r, count=c)
                     for (t, r), c in sorted(report.left_by_reason().items())],
        left_to_torch=[dict(type=t, reason=r, count=c)
                       for (t, r), c in sorted(report.left_to_torch().items())],
        reuse=reuse.summary())


def format_result(result: dict, top: int) -> str:
    mb = 2 ** 20
    lines = [f"{result['config']}  size={result['size']}  batch={result['batch']}",
             f"mesa: {result['mesa']}",
             f"saved for backward: baseline {result['baseline_bytes'] / mb:.1f} MB, "
             f"Mesa {result['mesa_bytes'] / mb:.1f} MB ({result['saved_ratio']:.3f} of baseline)",
             f"left uncompressed: {result['left_bytes'] / mb:.2f} MB = "
             f"{result['left_share']:.3f} of the baseline's saved bytes",
             f"kept by Mesa as floating point (exact statistics, quantization ranges, the "
             f"recomputed loss's logits): {result['mesa_float_bytes'] / mb:.2f} MB = "
             f"{result['mesa_float_share']:.3f}",
             '', 'Left uncompressed by module type ("(Mesa)": a converted module\'s own '
             'functional ops):']
    for row in result['left_by_type'][:top]:
        lines.append(f"  {row['share']:7.3f}  {row['bytes'] / mb:9.2f} MB  {row['type']}")
    lines += ['', f'Top {top} modules holding it:']
    for row in result['left_by_module'][:top]:
        lines.append(f"  {row['share']:7.3f}  {row['bytes'] / mb:9.2f} MB  {row['name']}"
                     f"  [{row['type']}]")
    lines += ['', 'Kept by Mesa as floating point, by module type:']
    for row in result['mesa_float_by_type'][:top]:
        lines.append(f"  {row['share']:7.3f}  {row['bytes'] / mb:9.2f} MB  {row['type']}")
    if result.get('reuse'):
        lines += ['', 'Saves of another layer\'s codes, by layer type (reused / packed again, '
                  'with the reason / nothing on offer):']
        lines += [f'  {line}' for line in result['reuse'].splitlines()]
    if result.get('left_to_torch'):
        lines += ['', "Calls of converted modules' own forwards left to torch (per step):"]
        lines += [f"  {row['count']:5d} x {row['type']}: {row['reason']}"
                  for row in result['left_to_torch']]
    if result['unconverted']:
        lines += ['', 'Left unconverted (leaf modules):']
        lines += [f"  {row['count']:5d} x {row['type']}: {row['reason']}"
                  for row in result['unconverted']]
    return '\n'.join(lines)
