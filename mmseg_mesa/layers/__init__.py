"""Mesa layers: torch modules whose forward is exact and whose saved activations are compressed.

Every module of this package is imported here, so each layer registers itself
(``registry.mesa_layer``) and each layer type is declared before any config is built; the
registered classes are exported by name, with the few classes that are built rather than
converted to (``MesaModule``, the ``MatMul`` module, ``MesaBatchNorm2d``).
"""
import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f'{__name__}.{_info.name}')

from ..registry import layer_classes as _layer_classes  # noqa: E402
from .base import MesaModule  # noqa: E402
from .matmul import MatMul  # noqa: E402
from .norm import MesaBatchNorm2d  # noqa: E402

globals().update(_layer_classes())
__all__ = ['MatMul', 'MesaBatchNorm2d', 'MesaModule', *sorted(_layer_classes())]
