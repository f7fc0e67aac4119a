"""The layer types: the names ``MesaConfig.layers``, ``layer_bits`` and ``nearest_rounding`` use.

A layer type is declared once, beside the code that compresses it: ``registry.mesa_layer``
declares the type of the class it decorates, and code whose type no single class carries (the
recomputed loss, element-wise products, attention) calls ``declare_layer_type`` next to it.
Every list of layer types elsewhere (validation, defaults, ``python -m mmseg_mesa.info``) is
read from here. Importing ``mmseg_mesa`` imports every layer module, so the table is complete
before any ``MesaConfig`` is built.
"""
from __future__ import annotations

from dataclasses import dataclass

from .state import LAYER_TYPES as _DECLARED

__all__ = ['LayerType', 'declare_layer_type', 'default_layer_types', 'default_nearest_rounding',
           'division_layer_types', 'layer_types', 'opt_in_layer_types']


@dataclass(frozen=True)
class LayerType:
    """What a layer type is, beside its name.

    Args:
        name: The name configs use.
        opt_in: Converted only when ``MesaConfig.layers`` names it (it keeps too little for
            backward to gain). Defaults to False.
        division: Its saved activation is a feature map (channels x space or tokens x
            channels), which DIVISION's low-pass + residual split applies to. Defaults to False.
        nearest_rounding: Its codes round to nearest by default (``MesaConfig.nearest_rounding``).
            Defaults to False.
    """

    name: str
    opt_in: bool = False
    division: bool = False
    nearest_rounding: bool = False


def declare_layer_type(name: str, *, opt_in: bool = False, division: bool = False,
                       nearest_rounding: bool = False) -> str:
    """Declare a layer type; returns ``name``.

    A declaration without properties (what ``register_handler`` makes for the type it names)
    adds the name if it is new and changes nothing otherwise, so the one declaration with the
    type's properties may come before or after it.

    Raises:
        ValueError: ``name`` was declared before with other properties.
    """
    declared = LayerType(name, opt_in, division, nearest_rounding)
    known = _DECLARED.get(name)
    if known is None or known == LayerType(name):
        _DECLARED[name] = declared
    elif declared != LayerType(name) and known != declared:
        raise ValueError(f'layer type {name!r} is declared twice, differently: {known} and '
                         f'{declared}')
    return name


def layer_types() -> tuple[str, ...]:
    """Every declared layer type, in declaration order."""
    return tuple(_DECLARED)


def opt_in_layer_types() -> frozenset[str]:
    return frozenset(n for n, t in _DECLARED.items() if t.opt_in)


def default_layer_types() -> frozenset[str]:
    """What ``MesaConfig().layers`` converts: every type but the opt-in ones."""
    return frozenset(n for n, t in _DECLARED.items() if not t.opt_in)


def division_layer_types() -> tuple[str, ...]:
    return tuple(n for n, t in _DECLARED.items() if t.division)


def default_nearest_rounding() -> frozenset[str]:
    return frozenset(n for n, t in _DECLARED.items() if t.nearest_rounding)
