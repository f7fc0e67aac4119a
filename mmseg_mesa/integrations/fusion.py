"""Running a head's fusion conv module over levels it would upsample and concatenate first.

``fused_conv_module`` is ``conv_module(torch.cat([levels[0], *map(upsample, levels[1:])], 1))``
through ``layers.level_fusion`` (the concatenation built a block of samples at a time, each level
saved as codes at its own resolution), then the module's norm and activation on the whole
output. ``fusion_quantizers`` says when a module can run that way: a plain mmcv ``ConvModule``
whose conv is a converted one.
"""
from __future__ import annotations

import torch
from mmcv.cnn import ConvModule
from torch import nn

from ..config import MesaConfig
from ..layers.base import MesaModule, make_quantizer
from ..layers.conv import MesaConv2d
from ..layers.dropout import FeatureDropoutFunction
from ..layers.intercept import has_hooks, own_type
from ..layers.level_fusion import FusionSpec, LevelFusionConvFunction, Upsample
from ..layers.ownership import sole_reference
from ..quantizer import ActivationQuantizer


def level_quantizers(config: MesaConfig, levels: int) -> nn.ModuleList | None:
    """One quantizer per level for a fused conv's input codes (``FusedCodes``): the conv's own
    config, one group per channel; None where convs keep no Mesa codes."""
    conv_config = config.for_layer('conv2d')
    if conv_config.compressor != 'mesa':
        return None
    return nn.ModuleList(make_quantizer(conv_config, 1) for _ in range(levels))


def plain_conv_module(module: nn.Module) -> bool:
    """An mmcv ``ConvModule`` whose forward is the conv, norm, act steps and nothing else: no
    subclass, hooks, explicit padding or fused eval-mode conv-bn."""
    return (own_type(module) is ConvModule and not module.with_explicit_padding
            and module.efficient_conv_bn_eval_forward is None
            and not has_hooks(module))


def conv_module_steps(module: ConvModule, holder: list[torch.Tensor], steps: tuple[str, ...]
                      ) -> torch.Tensor:
    """``steps`` of a plain ``ConvModule.forward`` (``module.order`` or a tail of it) on
    ``holder.pop()``, each step's input dropped once it has run (the caller keeps no reference)."""
    x = holder.pop()
    for layer in steps:
        if layer == 'conv':
            x = module.conv(x)
        elif layer == 'norm' and module.with_norm:
            x = module.norm(x)
        elif layer == 'act' and module.with_activation:
            x = module.activate(x)
    return x


def classified(head: nn.Module, holder: list[torch.Tensor]) -> torch.Tensor:
    """``head.cls_seg(holder.pop())`` (mmseg's ``BaseDecodeHead.cls_seg`` steps: dropout, then
    ``conv_seg``) with no reference to the features left once the dropout has run: mmseg's
    ``forward`` holds them through the whole classifier. A plain ``nn.Dropout2d`` runs as
    ``FeatureDropoutFunction`` (the same output), written into the features where nothing else
    holds them, whose backward can reuse the gradient that ``conv_seg``'s backward makes."""
    in_place = sole_reference(holder, len(holder) - 1)
    x = holder.pop()
    if plain_feature_dropout(head.dropout, x):
        x = FeatureDropoutFunction.apply(x, head.dropout.p, in_place)
    elif head.dropout is not None:
        x = head.dropout(x)
    return head.conv_seg(x)


def plain_feature_dropout(module: nn.Module | None, x: torch.Tensor) -> bool:
    """An ``nn.Dropout2d`` (no subclass, no hooks) that drops channels of the 4-d ``x`` now."""
    return (module is not None and own_type(module) is nn.Dropout2d and module.training
            and not module.inplace and 0.0 < module.p < 1.0 and x.dim() == 4 and x.numel() > 0
            and not has_hooks(module))


def releasing_input(module: nn.Module, holder: list[torch.Tensor]) -> torch.Tensor:
    """``module(holder.pop())``, but a plain mmcv ``ConvModule`` drops its input once its first
    layer has run.

    A module call keeps its arguments alive until it returns, so ``fpn_bottleneck(buffer)`` holds
    the concatenation, the largest tensor of the head, through its BatchNorm and ReLU, though
    only the conv reads it. The steps are ``ConvModule.forward``'s with ``activate`` and ``norm``
    on. Anything else (a subclass, hooks on the module, explicit padding or the fused eval-mode
    conv-bn) is called as it is.
    """
    if not plain_conv_module(module):
        return module(holder.pop())
    return conv_module_steps(module, holder, module.order)


def fusion_quantizers(module: nn.Module, quantizers: nn.ModuleList | None,
                      levels: list[torch.Tensor]) -> list[ActivationQuantizer] | None:
    """The quantizers of ``levels`` when ``module`` (a fusion conv module) can run as
    ``LevelFusionConvFunction``: a plain ``ConvModule`` whose first step is a converted, active,
    ungrouped conv with zero padding and no hooks, whose quantizer keeps what ours keep."""
    conv = getattr(module, 'conv', None)
    if (quantizers is None or not plain_conv_module(module) or module.order[0] != 'conv'
            or not isinstance(conv, MesaConv2d) or conv.padding_mode != 'zeros'
            or conv.groups != 1 or has_hooks(conv)
            or not conv.mesa_active(levels[0], conv.weight)
            or not isinstance(conv.quant_input, ActivationQuantizer)
            or conv.quant_input.spec != quantizers[0].spec
            or len(levels) != len(quantizers)):
        return None
    return list(quantizers)


def fused_conv_module(module: ConvModule, quantizers: list[ActivationQuantizer],
                      levels: list[torch.Tensor | None], upsample: Upsample) -> torch.Tensor:
    """``module(torch.cat([levels[0], *map(upsample, levels[1:])], dim=1))`` with the
    concatenation built a block of samples at a time (``LevelFusionConvFunction``); ``levels``
    is emptied (the caller's references would keep every level to the end), and the output
    takes level 0's storage where nothing else refers to it."""
    conv = module.conv
    # the conv's output goes straight into a Mesa norm (its next step), whose backward returns
    # a gradient of its own making: backward may reuse that gradient's storage
    owns_grad = (len(module.order) > 1 and module.order[1] == 'norm' and module.with_norm
                 and isinstance(module.norm, MesaModule))
    pieces = list(levels)
    levels.clear()
    # the output may overwrite level 0 where nothing else can read it (a ReLU's output, which
    # its ReLU keeps as a bit mask)
    spec = FusionSpec(upsample, (conv.stride, conv.padding, conv.dilation, conv.groups),
                      quantizers, owns_grad, output_into_first=sole_reference(pieces, 0))
    out = [LevelFusionConvFunction.apply(spec, conv.weight, conv.bias, *pieces)]
    del pieces  # not alive through the norm
    return conv_module_steps(module, out, module.order[1:])


