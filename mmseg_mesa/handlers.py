"""Where the handler table is filled.

Torch module types register beside their Mesa layers (``registry.mesa_layer`` in
``mmseg_mesa.layers``), when those modules are imported. mmcv / mmseg specific handlers (Swin
attention, DropPath, decode heads, functional attention) are added from
``mmseg_mesa.integrations.mmseg_handlers`` by ``register_openmmlab_handlers_if_installed`` when
those packages import, once (``registry.register_once``): a re-import registers nothing twice,
and ``register_handler`` refuses a second handler for a type. ``convert`` only reads the table
(``registry``), so neither module imports the other.
"""
from __future__ import annotations

from . import layers  # noqa: F401  (its modules register the torch handlers)
from .registry import register_once


def register_openmmlab_handlers_if_installed() -> None:
    """Add the mmcv / mmseg handlers when both import, once (``mmseg_mesa/__init__`` calls this).

    Without them plain torch models still convert; OpenMMLab modules are simply absent.
    """
    try:
        import mmcv  # noqa: F401
        import mmseg  # noqa: F401
    except ImportError:
        return
    from .integrations.mmseg_handlers import register_openmmlab_handlers
    register_once('openmmlab', register_openmmlab_handlers)
