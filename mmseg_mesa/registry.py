"""The handler table: which module types Mesa converts, and the rule that keeps forwards exact.

A handler is found along a module's MRO, so a subclass can use its base's handler, but only when
its forward is provably the base's: no class between the module's type and the handled type may
define a method the Mesa class replaces (``Handler.replaces``; for ``nn.Conv2d`` that is
``forward`` and ``_conv_forward``). Otherwise the module is left, with the reason: converting it
would silently drop its own forward (mmcv's ``Conv2dAdaptivePadding`` pads in ``forward``).
Subclasses whose override is known to change nothing on the running torch (mmcv's ``Linear`` /
``Conv2d`` wrappers) are declared with ``register_alias``; others get handlers of their own.

A Mesa layer registers itself where it is defined, with the ``mesa_layer`` class decorator: that
one line names the module type it replaces and its layer type, and the handler, the layer type's
declaration and the export from ``mmseg_mesa.layers`` all follow from it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from torch import nn

from .layer_types import declare_layer_type
from .state import ALIASES as _ALIASES
from .state import HANDLER_TABLES as _TABLES
from .state import HANDLERS as _HANDLERS
from .state import LAYER_CLASSES as _LAYER_CLASSES

if TYPE_CHECKING:
    from .config import MesaConfig
    from .layers.base import MesaModule

L = TypeVar('L', bound=type)

# convert(module, config) converts in place; it may return names (relative to the module) of
# children it took care of itself, e.g. an attention's out_proj used through its weight.
Converter = Callable[[nn.Module, 'MesaConfig'], Iterable[str] | None]
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
    declare_layer_type(layer_type)
    _HANDLERS[module_type] = Handler(layer_type, convert, check, tuple(replaces))


def register_left(module_type: type, reason: str) -> None:
    """Leave ``module_type`` (and its subclasses) as it is, ``reason`` in the report: a module
    whose compression was measured and refused, which the generic path would otherwise take."""
    def refuse(module: nn.Module, config: MesaConfig) -> None:
        raise AssertionError(f'{type(module).__name__} is left, never converted')

    register_handler(module_type, 'generic', refuse, check=lambda module: reason, replaces=())


def mesa_layer(module_type: type, layer_type: str, check: Checker | None = None,
               replaces: tuple[str, ...] = ('forward',), covers: tuple[str, ...] = (),
               **properties: bool) -> Callable[[L], L]:
    """Class decorator: the decorated Mesa class is what ``module_type`` converts to.

    It registers the class-swap handler (``register_handler``; see it for ``check`` and
    ``replaces``; ``covers``: see ``swap_to``), declares ``layer_type`` with ``properties``
    (``LayerType``'s ``division``, ``nearest_rounding``, ``opt_in``; one declaration of a type
    carries them), sets the class's ``mesa_layer_type`` (the settings a directly built layer
    takes from its config) and exports the class from ``mmseg_mesa.layers``. Stack it to convert
    several module types to one class. Re-running a module's definitions (a reload) replaces its
    own registrations, as they are the same statements.

    Raises:
        KeyError: ``module_type`` has a handler from elsewhere.
    """

    def register(cls: L) -> L:
        known = _HANDLERS.get(module_type)
        same_statement = known is not None and getattr(known.convert, 'mesa_class', None) \
            is not None and _qualified(known.convert.mesa_class) == _qualified(cls)
        declare_layer_type(layer_type, **properties)
        cls.mesa_layer_type = layer_type
        register_handler(module_type, layer_type, swap_to(cls, covers), check, replaces,
                         force=same_statement)
        _LAYER_CLASSES[cls.__name__] = cls
        return cls

    return register


def _qualified(cls: type) -> str:
    return f'{cls.__module__}.{cls.__qualname__}'


def layer_classes() -> dict[str, type]:
    """The classes registered with ``mesa_layer``, by name."""
    return dict(_LAYER_CLASSES)


def register_once(table: str, register: Callable[[], None]) -> None:
    """Run ``register`` (a group of ``register_handler`` calls) unless ``table`` ran already.

    The built-in tables register through this, so importing or reloading the modules that
    trigger them again registers nothing twice, while a second handler for one type from
    anywhere else still fails (``register_handler``).
    """
    if table not in _TABLES:
        register()
        _TABLES.add(table)


def swap_to(mesa_cls: type[MesaModule], covers: tuple[str, ...] = ()) -> Converter:
    """A converter that class-swaps a module into ``mesa_cls``; ``covers`` names the children
    the Mesa class takes care of itself (an attention's ``out_proj``, used through its
    weight)."""

    def convert(module: nn.Module, config: MesaConfig) -> tuple[str, ...]:
        mesa_cls.convert(module, config)
        return covers

    convert.mesa_class = mesa_cls  # type: ignore[attr-defined]
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
