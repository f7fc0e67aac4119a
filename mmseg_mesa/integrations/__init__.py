"""Integrations with the OpenMMLab stack (mmcv, mmseg, mmengine).

Importing this package (e.g. through ``custom_imports``) registers ``MesaHook`` and
``CompileHook`` and lets mmengine load its own checkpoints on torch >= 2.6.
"""
from .checkpoint import allow_mmengine_checkpoints
from .compile_hook import CompileHook
from .hook import MesaHook
from .runner import enable_mesa_in_config

allow_mmengine_checkpoints()

__all__ = ['CompileHook', 'MesaHook', 'allow_mmengine_checkpoints', 'enable_mesa_in_config']
