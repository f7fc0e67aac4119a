"""The built-in handler table: which torch module becomes which Mesa module.

Importing this module registers the torch handlers; mmcv / mmseg specific ones (Swin attention,
DropPath, decode heads, functional attention) are added from
``mmseg_mesa.integrations.mmseg_handlers`` by ``register_openmmlab_handlers_if_installed`` when
those packages are importable. Both go through ``registry.register_once``: a re-import or reload
registers nothing twice, and
``register_handler`` refuses a second handler for a type. ``convert`` only reads the table
(``registry``), so neither module imports the other.
"""
from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .config import MesaConfig
from .layers.activations import (
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
from .layers.attention import MesaMultiheadAttention, unsupported_mha_reason
from .layers.conv import MesaConv1d, MesaConv2d, conv1d_reason
from .layers.conv_transpose import MesaConvTranspose2d, conv_transpose_reason
from .layers.dropout import MesaDropout
from .layers.group_norm import MesaGroupNorm
from .layers.linear import MesaLinear
from .layers.matmul import MatMul, MesaMatMul
from .layers.norm import MesaBatchNorm, MesaLayerNorm
from .layers.pooling import MesaAdaptiveAvgPool2d, MesaAvgPool2d, MesaMaxPool2d
from .layers.softmax import MesaSoftmax
from .layers.sync_batchnorm import MesaSyncBatchNorm
from .registry import register_handler, register_once, swap_to


def _conv_check(module: nn.Module) -> str | None:
    if isinstance(module.padding, str):
        return f'string padding {module.padding!r} is not supported'
    return None


def _dropout_check(module: nn.Module) -> str | None:
    if module.inplace:
        return 'in-place dropout is not supported'
    if not 0.0 < module.p < 1.0:
        return f'p={module.p} saves no mask'
    return None


def _convert_mha(module: nn.Module, config: MesaConfig) -> tuple[str, ...]:
    MesaMultiheadAttention.convert(module, config)
    return ('out_proj',)  # used through its weight by the rewritten attention


def register_torch_handlers() -> None:
    """The handlers of torch module types (run once, on import)."""
    register_handler(nn.Linear, 'linear', swap_to(MesaLinear))
    # MesaConv2d.forward calls F.conv2d itself, so an overridden _conv_forward would be lost too.
    register_handler(nn.Conv2d, 'conv2d', swap_to(MesaConv2d), _conv_check,
                     replaces=('forward', '_conv_forward'))
    register_handler(nn.Conv1d, 'conv1d', swap_to(MesaConv1d), conv1d_reason,
                     replaces=('forward', '_conv_forward'))
    register_handler(nn.GELU, 'gelu', swap_to(MesaGELU))
    register_handler(nn.ReLU, 'relu', swap_to(MesaReLU))
    register_handler(nn.Softmax, 'softmax', swap_to(MesaSoftmax))
    register_handler(nn.LayerNorm, 'layernorm', swap_to(MesaLayerNorm))
    register_handler(_BatchNorm, 'batchnorm', swap_to(MesaBatchNorm))
    register_handler(nn.SyncBatchNorm, 'batchnorm', swap_to(MesaSyncBatchNorm))
    register_handler(nn.Dropout, 'dropout', swap_to(MesaDropout), _dropout_check)
    register_handler(MatMul, 'matmul', swap_to(MesaMatMul))
    # The other activations: each type explicitly, ReLU6 apart from its base Hardtanh.
    for module_type, mesa_type in (
            (nn.Hardtanh, MesaHardtanh), (nn.ReLU6, MesaReLU6), (nn.LeakyReLU, MesaLeakyReLU),
            (nn.PReLU, MesaPReLU), (nn.SiLU, MesaSiLU), (nn.Hardswish, MesaHardswish),
            (nn.Hardsigmoid, MesaHardsigmoid), (nn.Sigmoid, MesaSigmoid), (nn.Tanh, MesaTanh),
            (nn.ELU, MesaELU)):
        register_handler(module_type, 'activation', swap_to(mesa_type))
    register_handler(nn.MaxPool2d, 'pooling', swap_to(MesaMaxPool2d),
                     lambda m: 'return_indices=True: the int64 indices are an output'
                     if m.return_indices else None)
    register_handler(nn.AvgPool2d, 'pooling', swap_to(MesaAvgPool2d))
    # UPerHead's and PSPNet's pyramid pooling, SE blocks: torch keeps the whole input.
    register_handler(nn.AdaptiveAvgPool2d, 'pooling', swap_to(MesaAdaptiveAvgPool2d))
    register_handler(nn.ConvTranspose2d, 'conv_transpose2d', swap_to(MesaConvTranspose2d),
                     conv_transpose_reason)
    register_handler(nn.GroupNorm, 'groupnorm', swap_to(MesaGroupNorm))
    register_handler(nn.MultiheadAttention, 'attention', _convert_mha, unsupported_mha_reason)
    register_handler(NonDynamicallyQuantizableLinear, 'linear', swap_to(MesaLinear),
                     lambda m: 'out_proj of nn.MultiheadAttention: only called through its '
                               'weight, compressed when the attention is converted')


register_once('torch', register_torch_handlers)


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
