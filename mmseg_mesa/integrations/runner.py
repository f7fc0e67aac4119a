"""Config plumbing for mmengine runners: ``mesa=...`` becomes a validated MesaConfig and a hook
(and ``--compile`` a ``CompileHook``)."""
from __future__ import annotations

from typing import Any

from ..config import MesaConfig


def enable_mesa_in_config(cfg: Any) -> MesaConfig | None:
    """Validate ``cfg.mesa`` and make sure a ``MesaHook`` will convert the model.

    Works for configs that inherit ``configs/_base_/mesa.py`` and for plain mmseg configs given
    ``--cfg-options mesa=True`` (where ``custom_imports`` cannot be set). Raises ``ValueError``
    for a bad ``mesa`` value before anything is built.
    """
    config = MesaConfig.from_cfg(cfg.get('mesa'))
    if config is None:
        return None
    add_hook(cfg, 'MesaHook')
    return config


def add_hook(cfg: Any, name: str) -> None:
    """Add one of our hooks (registered when ``mmseg_mesa.integrations`` is imported, as our
    tools do) to ``cfg.custom_hooks`` unless it is there."""
    hooks = list(cfg.get('custom_hooks') or [])
    if not any(h.get('type') in (name, f'mmseg_mesa.{name}') for h in hooks):
        hooks.append(dict(type=name))
        cfg.custom_hooks = hooks
