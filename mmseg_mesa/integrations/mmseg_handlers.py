"""Handlers for mmcv / mmseg module types (registered when those packages import)."""
from __future__ import annotations

from torch import nn

from ..config import MesaConfig
from ..registry import register_alias, register_handler, register_left, swap_to


def register_openmmlab_handlers() -> None:
    from mmcv.cnn.bricks import wrappers
    from mmcv.cnn.bricks.conv2d_adaptive_padding import Conv2dAdaptivePadding
    from mmcv.cnn.bricks.conv_ws import ConvWS2d
    from mmcv.cnn.bricks.drop import DropPath
    from mmseg.models.backbones.swin import WindowMSA
    from mmseg.models.decode_heads.da_head import DAHead
    from mmseg.models.decode_heads.decode_head import BaseDecodeHead
    from mmseg.models.decode_heads.knet_head import KernelUpdator
    from mmseg.models.decode_heads.segformer_head import SegformerHead
    from mmseg.models.decode_heads.uper_head import UPerHead
    from mmseg.models.segmentors.encoder_decoder import EncoderDecoder
    from mmseg.models.utils.encoding import Encoding

    from .attention import MesaWindowMSA
    from .encoding import MesaEncoding
    from .mask_heads import mask_head_handlers
    from .mmcv_conv import MesaConv2dAdaptivePadding, MesaConvWS2d
    from .mmpretrain_modules import layer_norm_2d_class
    from .modules import (
        MesaDAHead,
        MesaDecodeHead,
        MesaDropPath,
        MesaRecomputedLossHead,
        own_loss_heads,
    )
    from .segformer_head import MesaSegformerHead
    from .segmentor import MesaEncoderDecoder
    from .uper_head import MesaUPerHead

    # mmcv's wrappers override forward only to special-case empty inputs on torch < 1.9
    # (obsolete_torch_version); on the torch we support they call the base's forward.
    for wrapper, base in ((wrappers.Linear, nn.Linear), (wrappers.Conv2d, nn.Conv2d),
                          (wrappers.ConvTranspose2d, nn.ConvTranspose2d),
                          (wrappers.MaxPool2d, nn.MaxPool2d)):
        register_alias(wrapper, base)
    register_handler(ConvWS2d, 'conv2d', swap_to(MesaConvWS2d))
    register_handler(Conv2dAdaptivePadding, 'conv2d', swap_to(MesaConv2dAdaptivePadding))
    register_handler(WindowMSA, 'attention', swap_to(MesaWindowMSA))
    register_handler(Encoding, 'attention', swap_to(MesaEncoding))
    register_handler(DropPath, 'droppath', swap_to(MesaDropPath),
                     lambda m: None if 0.0 < m.drop_prob < 1.0 else
                     f'drop_prob={m.drop_prob} saves no mask')
    register_functional_handlers()
    register_handler(KernelUpdator, 'product', convert_kernel_updator, replaces=())
    # mmdet's mask-classification heads (Mask2Former, MaskFormer): each layer's own
    # _loss_by_feat_single (Mask2Former overrides MaskFormer's), so one handler each; mmseg's
    # Mask2Former head also builds its ground-truth masks its own way.
    for head, mesa_head, replaces in mask_head_handlers():
        register_handler(head, 'loss', swap_to(mesa_head), replaces=replaces)
    for norm, mesa_norm in layer_norm_2d_class().items():
        register_handler(norm, 'layernorm', swap_to(mesa_norm), replaces=('forward',))
    # Heads override forward but not loss_by_feat, the one method the Mesa head replaces; a
    # head with its own loss_by_feat (PointHead, DAHead, ...) is left by that rule.
    register_handler(BaseDecodeHead, 'loss', swap_to(MesaDecodeHead),
                     replaces=('loss_by_feat',))
    register_handler(DAHead, 'loss', swap_to(MesaDAHead), replaces=('loss_by_feat',))
    for head in own_loss_heads():
        register_handler(head, 'loss', swap_to(MesaRecomputedLossHead),
                         replaces=('loss_by_feat',))
    # UPerHead also fuses its FPN outputs a block of samples at a time; a subclass with its own
    # _forward_feature, forward or cls_seg falls back to the BaseDecodeHead handler above.
    register_handler(UPerHead, 'loss', swap_to(MesaUPerHead),
                     replaces=('loss_by_feat', '_forward_feature', 'forward', 'cls_seg'))
    # SegFormer's head fuses its levels a block of samples at a time (a subclass with its own
    # forward falls back to the BaseDecodeHead handler).
    register_handler(SegformerHead, 'loss', swap_to(MesaSegformerHead),
                     replaces=('loss_by_feat', 'forward', 'cls_seg'))
    # The segmentor lets UPerHead drop the feature levels it has read. A segmentor that hands
    # its features to its heads in its own way (CascadeEncoderDecoder) is left.
    register_handler(EncoderDecoder, 'loss', swap_to(MesaEncoderDecoder),
                     replaces=('loss', '_decode_head_forward_train',
                               '_auxiliary_head_forward_train'))


def convert_kernel_updator(module: nn.Module, config: MesaConfig) -> None:
    """K-Net's ``KernelUpdator``: its own products and its Linears' inputs, one group per row.

    Each row is one (image, class) proposal: ``x_feat`` is a mask-weighted sum over the image,
    so rows differ in scale by their masks' mass, up to four orders of magnitude in one batch,
    and the small rows carry most of the gradient. Channel groups give them a step larger than
    their values (``dynamic_layer``'s weight gradient cosine 0.17 on ``knet-s3_swin-t`` without
    ``init_weights()``); row groups hold it at 1.000 (docs/benchmarks.md). The Linears stay
    the Linear handler's to convert (``skip`` and the report apply to them as to any Linear).
    """
    from ..layers.intercept import MesaFunctional

    for child in (module, *(c for c in module.children() if isinstance(c, nn.Linear))):
        child.mesa_row_groups = True
    MesaFunctional.convert(module, config)


def functional_types() -> dict[type, str]:
    """Modules whose own forward calls matmul / softmax / products / F.linear functionally,
    with their layer type.

    ``MesaFunctional`` wraps their forward (it replaces no method), so their subclasses (MAE's
    attention, DANet's PAM, DNL's non-local block) are converted with their own forwards.
    Measured and left out: Hamburger's NMF2D (its multiplicative updates turn 8-bit noise in
    the coefficients into a whole-gradient error of 0.11 on SegNeXt-T, 0.0035 without).
    """
    from mmcv.cnn.bricks.context_block import ContextBlock
    from mmcv.cnn.bricks.non_local import NonLocal2d
    from mmcv.cnn.bricks.scale import Scale
    from mmseg.models.backbones.beit import BEiTTransformerEncoderLayer
    from mmseg.models.backbones.bisenetv1 import AttentionRefinementModule
    from mmseg.models.backbones.bisenetv1 import FeatureFusionModule as BiSeNetFusion
    from mmseg.models.backbones.bisenetv2 import BGALayer
    from mmseg.models.backbones.cgnet import GlobalContextExtractor
    from mmseg.models.backbones.mscan import MSCAAttention, MSCABlock
    from mmseg.models.backbones.pidnet import Bag, LightBag, PagFM
    from mmseg.models.backbones.resnest import SplitAttentionConv2d
    from mmseg.models.backbones.stdc import FeatureFusionModule as STDCFusion
    from mmseg.models.decode_heads.apc_head import ACM
    from mmseg.models.decode_heads.da_head import CAM
    from mmseg.models.decode_heads.dm_head import DCM
    from mmseg.models.decode_heads.knet_head import KernelUpdateHead
    from mmseg.models.decode_heads.ocr_head import SpatialGatherModule
    from mmseg.models.utils.se_layer import SELayer
    from mmseg.models.utils.self_attention_block import SelfAttentionBlock

    from .mmpretrain_modules import attention_types, layer_scale_block_types

    # KernelUpdateHead: the mask softmax, the mask-weighted sum (einsum) and the convolution
    # with its dynamic kernels. Deformable attention (Mask2Former's pixel decoder): its weights'
    # softmax, the sampled feature maps (grid_sample) and their weighted sum, on the pure-PyTorch
    # path mmcv takes off CUDA.
    # DMNet's DCM: convolutions with the filters it generates per image.
    # mmpretrain's MultiheadAttention: F.scaled_dot_product_attention (layers.sdpa).
    attention = (SelfAttentionBlock, SpatialGatherModule, CAM, ACM, NonLocal2d, ContextBlock,
                 KernelUpdateHead, DCM, *mmcv_ops_attention_types(), *attention_types())
    # layer scale (x * gamma; mmcv's Scale: DANet's and CCNet's learned residual weights),
    # gated convolutions (attn * u), channel gates (x * se(x): MobileNetV3's SE blocks, CGNet's
    # context extractor, BiSeNet's and STDC's attention and fusion modules, ResNeSt's split
    # attention) and PIDNet's and BiSeNetV2's sigmoid-gated fusions
    products = (BEiTTransformerEncoderLayer, MSCAAttention, MSCABlock, SELayer,
                GlobalContextExtractor, AttentionRefinementModule, BiSeNetFusion, STDCFusion,
                SplitAttentionConv2d, BGALayer, PagFM, Bag, LightBag, Scale,
                *layer_scale_block_types())
    return {**{t: 'attention' for t in attention}, **{t: 'product' for t in products}}


def mmcv_ops_attention_types() -> tuple[type, ...]:
    """mmcv's ``MultiScaleDeformableAttention`` and CCNet's ``CrissCrossAttention`` (its
    einsums and softmax), where mmcv was built with its ops (``mmcv.ops`` imports them)."""
    try:
        from mmcv.ops.cc_attention import CrissCrossAttention
        from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttention
    except ImportError:  # mmcv-lite: no ops, nothing of them to convert
        return ()
    return MultiScaleDeformableAttention, CrissCrossAttention


def register_functional_handlers() -> None:
    from ..layers.intercept import MesaFunctional
    from .attention import REWRITTEN, convert_attention

    for module_type, layer_type in functional_types().items():
        register_handler(module_type, layer_type, swap_to(MesaFunctional), replaces=())
    from mmseg.models.decode_heads.ham_head import NMF2D
    # Its operands are held by other nodes anyway: packing its matmuls kept 3.1 MB where torch
    # keeps 1.8 (SegNeXt-T, 128x128, batch 2), and its multiplicative updates amplify the noise.
    register_left(NMF2D, 'Hamburger\'s matrix decomposition: packing it keeps more than torch '
                  'does, and its multiplicative updates amplify 8-bit noise')
    # BEiT / MAE / Twins attention: rewritten to keep no maps, or MesaFunctional (a subclass
    # with its own forward, attention_maps='stored'); either way its forward is its own.
    for module_type in REWRITTEN:
        register_handler(module_type, 'attention', convert_attention, replaces=())
