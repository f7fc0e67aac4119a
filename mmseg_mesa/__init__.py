"""mmseg-mesa: Mesa memory-saving training (`bits`-bit saved activations) for mmsegmentation.

The public API is what ``__all__`` names. Layer classes are importable from
``mmseg_mesa.layers``; the quantizer (``mmseg_mesa.quantizer``), memory reports
(``mmseg_mesa.memory``) and the mmengine integration (``mmseg_mesa.integrations``) from their
modules.
"""
from .version import __version__, check_supported_versions

check_supported_versions()  # a clear error naming the range before any module needs newer torch

from .config import MesaConfig
from .convert import ConversionReport, convert_to_mesa
from .handlers import register_openmmlab_handlers_if_installed
from .layers import MesaModule
from .memory import count_saved_tensors
from .registry import mesa_layer, register_handler
from .training_state import restore_training_state, training_state

register_openmmlab_handlers_if_installed()  # torch handlers register on import; these if installed

__all__ = [
    'MesaConfig', 'convert_to_mesa', 'ConversionReport', 'register_handler', 'mesa_layer',
    'MesaModule', 'count_saved_tensors', 'training_state', 'restore_training_state',
    '__version__',
]
