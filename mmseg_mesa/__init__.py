"""mmseg-mesa: Mesa memory-saving training (`bits`-bit saved activations) for mmsegmentation."""
from .version import __version__, check_supported_versions

check_supported_versions()  # a clear error naming the range before any module needs newer torch

from .config import MesaConfig
from .convert import ConversionReport, convert_to_mesa, register_handler
from .division import DivisionCompressor, DivisionPacked, DivisionSpec
from .handlers import register_openmmlab_handlers_if_installed
from .layers import (
                     MatMul,
                     MesaAdaptiveAvgPool2d,
                     MesaAvgPool2d,
                     MesaBatchNorm,
                     MesaBatchNorm2d,
                     MesaConv1d,
                     MesaConv2d,
                     MesaConvTranspose2d,
                     MesaDropout,
                     MesaELU,
                     MesaGELU,
                     MesaGroupNorm,
                     MesaHardsigmoid,
                     MesaHardswish,
                     MesaHardtanh,
                     MesaLayerNorm,
                     MesaLeakyReLU,
                     MesaLinear,
                     MesaMatMul,
                     MesaMaxPool2d,
                     MesaModule,
                     MesaPReLU,
                     MesaReLU,
                     MesaReLU6,
                     MesaSigmoid,
                     MesaSiLU,
                     MesaSoftmax,
                     MesaSyncBatchNorm,
                     MesaTanh,
)
from .quantizer import ActivationQuantizer, Packed, QuantSpec, pack, unpack

register_openmmlab_handlers_if_installed()  # torch handlers register on import; these if installed

__all__ = [
    'MesaConfig', 'ConversionReport', 'convert_to_mesa', 'register_handler', 'MesaModule',
    'MesaLinear', 'MesaConv2d', 'MesaGELU', 'MesaReLU', 'MesaSoftmax', 'MesaLayerNorm',
    'MesaBatchNorm', 'MesaBatchNorm2d', 'MesaSyncBatchNorm', 'MatMul', 'MesaMatMul', 'MesaDropout',
    'ActivationQuantizer', 'Packed', 'QuantSpec', 'pack', 'unpack', 'DivisionCompressor',
    'DivisionPacked', 'DivisionSpec', '__version__',
    'MesaHardtanh', 'MesaReLU6', 'MesaLeakyReLU', 'MesaPReLU', 'MesaSiLU', 'MesaHardswish',
    'MesaHardsigmoid', 'MesaSigmoid', 'MesaTanh', 'MesaELU', 'MesaMaxPool2d',
    'MesaConvTranspose2d', 'MesaGroupNorm', 'MesaAvgPool2d', 'MesaAdaptiveAvgPool2d', 'MesaConv1d',
]
