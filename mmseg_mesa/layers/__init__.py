"""Mesa layers: torch modules whose forward is exact and whose saved activations are compressed."""
from .activation import MesaGELU, MesaReLU
from .base import MesaModule
from .conv import MesaConv2d
from .dropout import MesaDropout
from .linear import MesaLinear
from .matmul import MatMul, MesaMatMul
from .norm import MesaBatchNorm, MesaBatchNorm2d, MesaLayerNorm
from .softmax import MesaSoftmax
from .sync_batchnorm import MesaSyncBatchNorm

__all__ = [
    'MesaModule', 'MesaLinear', 'MesaConv2d', 'MesaGELU', 'MesaReLU', 'MesaSoftmax',
    'MesaLayerNorm', 'MesaBatchNorm', 'MesaBatchNorm2d', 'MesaSyncBatchNorm', 'MatMul',
    'MesaMatMul', 'MesaDropout',
]
