"""``convert_to_mesa``: the one public conversion entry point, driven by a table of handlers.

Handlers are looked up by module type along the MRO (``mmseg_mesa.registry``), so subclasses
whose forward is the base's (mmengine's ``_BatchNormXd``) find their base's handler, and those
that override it are left with the reason. Conversion happens in place by class swap (see
``MesaModule.convert``): Parameters, buffers, names and the training flag are untouched.
"""
from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from .config import MesaConfig
from .layer_types import opt_in_layer_types
from .layers.base import MesaModule
from .layers.intercept import convert_generic
from .quantizer import ActivationQuantizer
from .registry import Handler, find_handler, register_alias, register_handler, supported_types

__all__ = ['ConversionReport', 'ModuleFilter', 'convert_to_mesa', 'register_alias',
           'register_handler', 'supported_types']

ModuleFilter = Callable[[nn.Module, str], bool]

# Modules whose forward only calls their children: the generic path has nothing of theirs to route.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class ConversionReport:
    """What ``convert_to_mesa`` did: converted modules and the modules it left, with reasons."""

    converted: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (from, to)
    left: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (type, reason)
    covered: dict[str, str] = field(default_factory=dict)  # name -> parent that handles it
    # name -> module converted by the generic path (``generic_reason``): its own forward's
    # functional calls routed through Mesa's Functions, the rest counted by op name
    generic: dict[str, nn.Module] = field(default_factory=dict)
    # name -> how a converted module keeps less than it could (``MesaModule.mesa_note``)
    notes: dict[str, str] = field(default_factory=dict)
    # name -> converted module that counts the calls it leaves to torch (``mesa_left_to_torch``:
    # ``MesaFunctional``, ``MesaSoftmax``), as the generic path's modules do
    routing: dict[str, nn.Module] = field(default_factory=dict)

    def converted_by_type(self) -> Counter:
        return Counter(src for src, _ in self.converted.values())

    def left_by_reason(self) -> Counter:
        return Counter((typ, reason) for typ, reason in self.left.values())

    def left_to_torch(self) -> Counter:
        """``(type, reason)`` -> calls left to torch by the generic path's modules and by
        converted modules that count them (``MesaFunctional``'s own forward, a softmax whose
        attention is left to torch), in the training steps they ran so far."""
        counts: Counter = Counter()
        for module in (*self.generic.values(), *self.routing.values()):
            typ = getattr(module, 'mesa_original_type', type(module).__name__)
            for reason, n in getattr(module, 'mesa_left_to_torch', {}).items():
                counts[(typ, reason)] += n
        return counts

    def format(self) -> str:
        lines = [f'Mesa converted {len(self.converted)} module(s):']
        for typ, n in sorted(self.converted_by_type().items()):
            lines.append(f'  {n:5d} x {typ}')
        if self.generic:
            routing = sum(isinstance(m, MesaModule) and not m.mesa_probe_pending
                          for m in self.generic.values())
            lines.append(f'Generic path: {len(self.generic)} module(s) without a handler, their '
                         f'own functional calls routed through Mesa ({routing} routing after a '
                         'training step; one whose first training step routes nothing goes back '
                         'to its own class)')
        left = self.left_to_torch()
        if left:
            lines.append('Left to torch in the forwards Mesa routes '
                         '(calls in the training steps so far):')
            for (typ, reason), n in sorted(left.items()):
                lines.append(f'  {n:5d} x {typ}: {reason}')
        if self.left:
            lines.append(f'Left unconverted: {len(self.left)} leaf module(s):')
            for (typ, reason), n in sorted(self.left_by_reason().items()):
                lines.append(f'  {n:5d} x {typ}: {reason}')
        if self.notes:
            lines.append(f'Notes on {len(self.notes)} converted module(s):')
            for note, n in sorted(Counter(self.notes.values()).items()):
                lines.append(f'  {n:5d} x {note}')
        return '\n'.join(lines)

    __str__ = format


def _skip_reason(module: nn.Module, name: str, handler: Handler, config: MesaConfig,
                 module_filter_fn: ModuleFilter | None) -> str | None:
    for pattern in config.skip:
        if fnmatch.fnmatchcase(name, pattern):
            return f'skipped by pattern {pattern!r}'
    if handler.layer_type not in config.layers:
        if handler.layer_type in opt_in_layer_types():
            return (f'layer type {handler.layer_type!r} is converted only when config.layers '
                    'names it (it keeps too little for backward to gain)')
        return f'layer type {handler.layer_type!r} not in config.layers'
    if module_filter_fn is not None and not module_filter_fn(module, name):
        return 'excluded by module_filter_fn'
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return 'lazy module with uninitialized parameters (run one forward first)'
    return handler.check(module) if handler.check is not None else None


def generic_reason(module: nn.Module, name: str, config: MesaConfig,
                   module_filter_fn: ModuleFilter | None) -> str | None:
    """Why the generic path (``layers.intercept.convert_generic``) does not take a module that
    no handler converts, or None when it does."""
    if 'generic' not in config.layers:
        return "layer type 'generic' not in config.layers"
    for pattern in config.skip:
        if fnmatch.fnmatchcase(name, pattern):
            return f'skipped by pattern {pattern!r}'
    if module_filter_fn is not None and not module_filter_fn(module, name):
        return 'excluded by module_filter_fn'
    if isinstance(module, CONTAINERS) or type(module).forward is nn.Module.forward:
        return 'a container: its forward only calls its children'
    if 'forward' in vars(module):
        return 'instance attribute forward replaces the method'
    if isinstance(module, torch.jit.ScriptModule):
        return 'a TorchScript module'
    return None


def convert_to_mesa(model: nn.Module, *, config: MesaConfig | None = None,
                    module_filter_fn: ModuleFilter | None = None) -> ConversionReport:
    """Convert every supported module of ``model`` to its Mesa version, in place.

    Args:
        model: The model; it keeps its identity, Parameters, buffers and state-dict keys.
        config: How to compress. Defaults to ``MesaConfig()`` (8 bits, the paper's settings).
        module_filter_fn: ``(module, qualified_name) -> bool``; False leaves the module alone.
            Defaults to None (convert everything supported).

    Returns:
        A report of converted modules and the leaves left unconverted, with the reason.

    Raises:
        ValueError: if the model ends up with no Mesa module at all, since training it
            "with Mesa" would silently save nothing.
    """
    config = config or MesaConfig()
    report = ConversionReport()
    already = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, ActivationQuantizer):
            continue
        if isinstance(module, MesaModule):
            already += 1
            continue
        if name in report.covered:
            continue
        handler, reason = find_handler(module)
        if handler is None or (reason is not None and 'forward' in handler.replaces):
            # no handler, or one the module's own forward rules out: the generic path
            generic = generic_reason(module, name, config, module_filter_fn)
            if generic is None:
                convert_generic(module, config.for_layer('generic', name))
                report.generic[name] = module
            elif not any(True for _ in module.children()):
                report.left[name] = (type(module).__name__, reason or generic if handler else
                                     f'no Mesa handler for {type(module).__name__}')
            continue
        reason = reason or _skip_reason(module, name, handler, config, module_filter_fn)
        if reason is not None:
            report.left[name] = (type(module).__name__, reason)
            continue
        original = type(module).__name__
        covered = handler.convert(module, config.for_layer(handler.layer_type, name)) or ()
        # the Mesa class by its own name ('MesaFunctional', not 'MesaFunctional[KernelUpdateHead]':
        # the original type is the entry's first item)
        report.converted[name] = (original, type(module).__name__.split('[', 1)[0])
        if hasattr(module, 'mesa_left_to_torch'):
            report.routing[name] = module
        note = getattr(module, 'mesa_note', None)
        if note is not None:
            report.notes[name] = f'{original}: {note}'
        for child in covered:
            full = f'{name}.{child}' if name else child
            report.covered[full] = name
            report.left.pop(full, None)
    if not report.converted and not report.generic and not already:
        raise ValueError(
            f'convert_to_mesa: nothing to convert in {type(model).__name__}: no module is of a '
            f'supported type (or all were excluded). Supported types: {supported_types()}. '
            f'Left: {dict(report.left_by_reason())}')
    return report
