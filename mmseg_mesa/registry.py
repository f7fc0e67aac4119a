"""The handler table: which module types Mesa converts, and the rule that keeps forwards exact.

A handler is found along a module's MRO, so a subclass can use its base's handler, but only when
its forward is provably the base's: no class between the module's type and the handled type may
define a method the Mesa class replaces (``Handler.replaces``; for ``nn.Conv2d`` that is
``forward`` and ``_conv_forward``). Otherwise the module is left, with the reason: converting it
would silently drop its own forward (mmcv's ``Conv2dAdaptivePadding`` pads in ``forward``).
Subclasses whose override is known to change nothing on the running torch (mmcv's ``Linear`` /
``Conv2d`` wrappers) are declared with ``register_alias``; others get handlers of their own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from .config import MesaConfig

if TYPE_CHECKING:
    from .layers.base import MesaModule

# convert(module, config) converts in place; it may return names (relative to the module) of
# children it took care of itself, e.g. an attention's out_proj used through its weight.
Converter = Callable[[nn.Module, MesaConfig], Iterable[str] | None]
# check(module) returns why a module cannot be converted, or None.
Checker = Callable[[nn.Module], str | None]


@dataclass(frozen=True)
class Handler:
    """How one module type is converted.

    Args:
        layer_type: The ``MesaConfig.layers`` entry that switches it on and off.
        convert: Converts a module in place (see ``Converter``).
        check: Why a particular module cannot be converted, or None. Defaults to None.
        replaces: Methods of the handled type that the converted module no longer runs (its
            forward path). A subclass that defines any of them is left unconverted.
            Defaults to ``('forward',)``.
    """

    layer_type: str
    convert: Converter
    check: Checker | None = None
    replaces: tuple[str, ...] = ('forward',)


_HANDLERS: dict[type, Handler] = {}
_ALIASES: dict[type, type] = {}
_TABLES: set[str] = set()  # names of the built-in tables registered so far (register_once)


def register_handler(module_type: type, layer_type: str, convert: Converter,
                     check: Checker | None = None,
                     replaces: tuple[str, ...] = ('forward',), force: bool = False) -> None:
    """Add the handler for ``module_type``; ``force=True`` replaces one it already has.

    Subclasses use it only if they define none of ``replaces`` (see the module docstring).
    Without ``force`` a second handler for one type is an error, as in mmengine's ``Registry``:
    two handlers for one type would leave the one that converts it to import order.

    Raises:
        KeyError: ``module_type`` has a handler and ``force`` is False.
    """
    if not force and module_type in _HANDLERS:
        raise KeyError(f'register_handler: {module_type.__qualname__} already has a handler '
                       f'(layer type {_HANDLERS[module_type].layer_type!r}); pass force=True to '
                       'replace it')
    _HANDLERS[module_type] = Handler(layer_type, convert, check, tuple(replaces))


def register_once(table: str, register: Callable[[], None]) -> None:
    """Run ``register`` (a group of ``register_handler`` calls) unless ``table`` ran already.

    The built-in tables register through this, so importing or reloading the modules that
    trigger them again registers nothing twice, while a second handler for one type from
    anywhere else still fails (``register_handler``).
    """
    if table not in _TABLES:
        register()
        _TABLES.add(table)


def swap_to(mesa_cls: type[MesaModule]) -> Converter:
    """A converter that class-swaps a module into ``mesa_cls`` and covers no children."""

    def convert(module: nn.Module, config: MesaConfig) -> None:
        mesa_cls.convert(module, config)

    return convert


def register_alias(module_type: type, handled_type: type, force: bool = False) -> None:
    """Convert ``module_type`` with ``handled_type``'s handler although it overrides methods
    that handler replaces: the caller vouches that those overrides do what the base does
    (e.g. mmcv's wrappers, which only special-case empty inputs on torch < 1.5).

    Raises:
        TypeError: ``module_type`` is not a subclass of ``handled_type``.
        KeyError: ``module_type`` has an alias and ``force`` is False.
    """
    if not issubclass(module_type, handled_type):
        raise TypeError(f'register_alias: {module_type.__name__} is not a subclass of '
                        f'{handled_type.__name__}')
    if not force and module_type in _ALIASES:
        raise KeyError(f'register_alias: {module_type.__qualname__} is already an alias of '
                       f'{_ALIASES[module_type].__qualname__}; pass force=True to replace it')
    _ALIASES[module_type] = handled_type


def handler_for_type(module_type: type) -> tuple[Handler | None, str | None]:
    """The handler for modules of ``module_type`` and, when it must not be used, why.

    The nearest handler along the MRO that the subclass rule allows is used; when none is,
    the nearest one is returned with its reason. ``(None, None)`` means no class in the type's
    MRO has a handler.
    """
    mro = module_type.__mro__
    refused: tuple[Handler, str] | None = None  # the nearest handler the rule refused
    for depth, cls in enumerate(mro):
        handler = _HANDLERS.get(cls)
        if handler is None:
            continue
        reason = None
        for sub in mro[:depth]:
            if sub in _ALIASES and issubclass(_ALIASES[sub], cls):
                continue  # its overrides are vouched for (register_alias)
            overridden = [m for m in handler.replaces if m in vars(sub)]
            if overridden:
                reason = (f'{sub.__name__} overrides {", ".join(overridden)} of '
                          f'{cls.__name__}: its own forward would be lost')
                break
        if reason is None:
            return handler, None
        # A more general handler further up may still hold (a UPerHead subclass with its own
        # _forward_feature keeps BaseDecodeHead's): it checks every class below it again.
        refused = refused or (handler, reason)
    return refused if refused is not None else (None, None)


def find_handler(module: nn.Module) -> tuple[Handler | None, str | None]:
    """``handler_for_type`` of the module's type, also refusing instance-level overrides."""
    handler, reason = handler_for_type(type(module))
    if handler is not None and reason is None:
        patched = [m for m in handler.replaces if m in vars(module)]
        if patched:
            reason = f'instance attribute {", ".join(patched)} replaces the method'
    return handler, reason


def handled_types() -> list[type]:
    """Every type with a handler of its own or an alias."""
    return [*_HANDLERS, *_ALIASES]


def supported_types() -> list[str]:
    """Names of the handled types, each once (mmcv's ``Conv2d`` wrapper shares torch's name)."""
    return sorted({t.__name__ for t in handled_types()})
