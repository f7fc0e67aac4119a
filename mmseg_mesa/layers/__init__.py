"""Mesa layers: torch modules whose forward is exact and whose saved activations are compressed."""
from .activations import (
    MesaELU,
    MesaGELU,
    MesaHardsigmoid,
    MesaHardswish,
    MesaHardtanh,
    MesaLeakyReLU,
    MesaPReLU,
    MesaReLU,
    MesaReLU6,
    MesaSigmoid,
    MesaSiLU,
    MesaTanh,
)
from .base import MesaModule
from .conv import MesaConv1d, MesaConv2d
from .conv_transpose import MesaConvTranspose2d
from .dropout import MesaDropout
from .group_norm import MesaGroupNorm
from .linear import MesaLinear
from .matmul import MatMul, MesaMatMul
from .norm import MesaBatchNorm, MesaBatchNorm2d, MesaLayerNorm
from .pooling import MesaAdaptiveAvgPool2d, MesaAvgPool2d, MesaMaxPool2d
from .softmax import MesaSoftmax
from .sync_batchnorm import MesaSyncBatchNorm

__all__ = [
    'MesaModule', 'MesaLinear', 'MesaConv2d', 'MesaGELU', 'MesaReLU', 'MesaSoftmax',
    'MesaLayerNorm', 'MesaBatchNorm', 'MesaBatchNorm2d', 'MesaSyncBatchNorm', 'MatMul',
    'MesaMatMul', 'MesaDropout',
    'MesaHardtanh', 'MesaReLU6', 'MesaLeakyReLU', 'MesaPReLU', 'MesaSiLU', 'MesaHardswish',
    'MesaHardsigmoid', 'MesaSigmoid', 'MesaTanh', 'MesaELU', 'MesaMaxPool2d',
    'MesaConvTranspose2d', 'MesaGroupNorm', 'MesaAvgPool2d', 'MesaAdaptiveAvgPool2d', 'MesaConv1d',
]
