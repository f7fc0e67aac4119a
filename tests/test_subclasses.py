"""Conversion never changes a forward: every subclass of a handled type, as installed.

Every subclass of every type with a Mesa handler that torch, mmcv, mmengine or mmseg defines is
either converted, with a forward bit-identical to the original on a random input, or left
unconverted with the reason. A new release that adds a subclass overriding ``forward`` makes
the static part fail only if our rule is wrong; a subclass our rule would convert but that this
test cannot build fails loudly until the table below says how to build it.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import warnings

import pytest
import torch
from torch import nn

from mmseg_mesa import MesaConfig, MesaModule, convert_to_mesa
from mmseg_mesa.registry import handled_types, handler_for_type

LIBRARIES = ('torch', 'mmcv', 'mmengine', 'mmseg')  # mmdet's heads: through mmseg's
PACKAGES = ('torch.nn', 'torch.ao.nn', 'mmcv.cnn', 'mmcv.ops', 'mmengine.model', 'mmseg.models')


def import_all() -> None:
    """Import every submodule of the packages that define modules, so all subclasses exist."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for name in PACKAGES:
            package = importlib.import_module(name)
            for info in pkgutil.walk_packages(package.__path__, f'{name}.'):
                try:
                    importlib.import_module(info.name)
                except Exception:  # optional back ends (e.g. torch.nn.attention's flex kernels)
                    continue


def subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | subclasses(sub)
    return found


def library_subclasses() -> list[type]:
    """Subclasses of the types whose Mesa class replaces methods (``Handler.replaces``).

    Handlers that replace nothing (``MesaFunctional`` wraps the module's own forward) keep any
    subclass's forward by construction; tests/test_zoo.py runs each of them inside mmseg models.
    """
    import_all()
    found = set()
    for handled in handled_types():
        handler, _ = handler_for_type(handled)
        if handler is not None and handler.replaces:
            found |= {handled} | subclasses(handled)
    return sorted((c for c in found
                   if c.__module__.split('.')[0] in LIBRARIES and not issubclass(c, MesaModule)),
                  key=lambda c: f'{c.__module__}.{c.__qualname__}')


CLASSES = library_subclasses()


def seg_samples(n=2, size=16, classes=3):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        sample = SegDataSample()
        labels = torch.randint(0, classes, (1, size, size), generator=gen)
        sample.gt_sem_seg = PixelData(data=labels)
        sample.gt_edge_map = PixelData(data=(labels % 2).to(torch.uint8))  # PIDNet's boundaries
        sample.set_metainfo(dict(img_shape=(size, size), pad_shape=(size, size)))
        out.append(sample)
    return out


class LossOf(nn.Module):
    """Runs a decode head's ``loss_by_feat`` (the one method its Mesa class replaces)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, logits):
        losses = self.head.loss_by_feat(logits, seg_samples())
        return tuple(losses[k] for k in sorted(losses))


class SegmentorLoss(LossOf):
    """Runs a segmentor's ``loss`` (what its Mesa class replaces) on 32x32 images."""

    def forward(self, images):
        losses = self.head.loss(images, seg_samples(len(images), images.shape[-1]))
        return tuple(losses[k] for k in sorted(losses))


def segmentor(cls):
    """A small UPerNet of ``cls``: ResNet-18 with 8 base channels and an FCN auxiliary head."""
    from mmseg.utils import register_all_modules
    register_all_modules()
    channels = [8, 16, 32, 64]
    norm = dict(type='BN', requires_grad=True)
    return SegmentorLoss(cls(
        backbone=dict(type='ResNetV1c', depth=18, stem_channels=8, base_channels=8,
                      norm_cfg=norm),
        decode_head=dict(type='UPerHead', in_channels=channels, in_index=[0, 1, 2, 3],
                         channels=8, num_classes=3, norm_cfg=norm),
        auxiliary_head=dict(type='FCNHead', in_channels=32, in_index=2, channels=8,
                            num_convs=1, num_classes=3, norm_cfg=norm)))


def decode_head(cls):
    """A head of ``cls`` with the attributes ``loss_by_feat`` reads (all set by
    ``BaseDecodeHead.__init__``); heads whose constructor needs more than the base's arguments
    get only the base's initialisation (their own __init__ builds layers loss_by_feat never
    touches)."""
    args = dict(in_channels=8, channels=8, num_classes=3)
    try:
        return cls(**args)
    except (TypeError, ValueError, AssertionError):
        from mmseg.models.decode_heads.decode_head import BaseDecodeHead
        head = cls.__new__(cls)  # TypeError for an abstract class: the test expects that
        BaseDecodeHead.__init__(head, **args)
        return head


class TupleLossOf(LossOf):
    """Runs the ``loss_by_feat`` of a head whose forward returns several logits (DANet's)."""

    def forward(self, *logits):
        losses = self.head.loss_by_feat(logits, seg_samples())
        return tuple(losses[k] for k in sorted(losses))


def da_head(cls):
    return TupleLossOf(decode_head(cls))


class MaskLossOf(LossOf):
    """Runs one decoder layer's loss of a MaskFormer / Mask2Former head (``_loss_by_feat_single``,
    what its Mesa class replaces) on random class scores and mask logits."""

    def forward(self, cls_scores, mask_preds):
        from mmengine.structures import InstanceData
        gen = torch.Generator().manual_seed(0)
        size = mask_preds.shape[-2:]
        gts = [InstanceData(labels=torch.tensor([1, 4, 7]),
                            masks=(torch.rand(3, *size, generator=gen) > 0.5).long())
               for _ in range(len(mask_preds))]
        metas = [dict(img_shape=tuple(size), pad_shape=tuple(size))] * len(mask_preds)
        return self.head._loss_by_feat_single(cls_scores, mask_preds, gts, metas)


def mask_head(cls):
    """A head of ``cls`` as mmseg's ADE20K config of its family builds it."""
    from mmseg.utils import register_all_modules
    from mmseg_models import upstream_config
    register_all_modules()
    name = ('mask2former/mask2former_r50_8xb2-160k_ade20k-512x512.py' if 'Mask2' in cls.__name__
            else 'maskformer/maskformer_r50-d32_8xb2-160k_ade20k-512x512.py')
    args = dict(upstream_config(name).model.decode_head)
    args.pop('type')
    return MaskLossOf(cls(**args))


# Heads with a loss of their own: the upstream config of their family, the logits their
# loss_by_feat reads (shapes at 4x4, batch 2), and channels shrunk to 8.
OWN_LOSS_HEADS = {
    'PIDHead': ('pidnet/pidnet-s_2xb6-120k_1024x1024-cityscapes.py', 'decode_head',
                lambda: [torch.randn(2, 19, 4, 4), torch.randn(2, 19, 4, 4),
                         torch.randn(2, 1, 4, 4)]),
    'DDRHead': ('ddrnet/ddrnet_23-slim_in1k-pre_2xb6-120k_cityscapes-1024x1024.py',
                'decode_head', lambda: [torch.randn(2, 19, 4, 4) for _ in range(2)]),
    'STDCHead': ('stdc/stdc1_4xb12-80k_cityscapes-512x1024.py', 'auxiliary_head',
                 lambda: [torch.randn(2, 1, 4, 4)]),
    'EncHead': ('encnet/encnet_r50-d8_4xb4-80k_ade20k-512x512.py', 'decode_head',
                lambda: [torch.randn(2, 150, 4, 4), torch.randn(2, 150)]),
    'PointHead': ('point_rend/pointrend_r50_4xb4-160k_ade20k-512x512.py', 'decode_head',
                  lambda: [torch.randn(2, 150, 7)]),
}


class PointLossOf(LossOf):
    """Runs PointRend's point-head loss on its point logits at random points."""

    def forward(self, point_logits):
        points = torch.rand(point_logits.shape[0], point_logits.shape[2], 2,
                            generator=torch.Generator().manual_seed(0))
        losses = self.head.loss_by_feat(point_logits, points, seg_samples())
        return tuple(losses[k] for k in sorted(losses))


def own_loss_head(cls):
    from mmseg.utils import register_all_modules
    from mmseg_models import upstream_config
    register_all_modules()
    family = family_of(cls)
    name, key, _ = OWN_LOSS_HEADS[family]
    heads = upstream_config(name).model[key]
    args = dict(next(h for h in heads if h['type'] == family) if isinstance(heads, list)
                else heads)
    args.pop('type')
    in_channels = args['in_channels']
    args.update(channels=8,
                in_channels=[8] * len(in_channels) if isinstance(in_channels, list) else 8)
    if args.get('norm_cfg') is not None:  # SyncBN in the configs: one process here
        args['norm_cfg'] = dict(type='BN')
    head = cls(**args)
    if family == 'PointHead':
        return PointLossOf(head)
    return TupleLossOf(head) if len(OWN_LOSS_HEADS[family][2]()) > 1 else LossOf(head)


def lazy(cls):
    return cls(6, 3) if 'Conv' in cls.__name__ else cls() if 'Norm' in cls.__name__ else cls(6)


def no_args(cls):
    return cls()


# How to build one module of a handled family and a random input for it (None: found below).
FAMILIES = {
    'Linear': (lambda c: c(8, 6), lambda: [torch.randn(2, 5, 8)]),
    'Conv2d': (lambda c: c(4, 6, 3, padding=1), lambda: [torch.randn(2, 4, 9, 7)]),
    'ConvTranspose2d': (lambda c: c(4, 6, 3, stride=2), lambda: [torch.randn(2, 4, 5, 6)]),
    'MaxPool2d': (lambda c: c(3, 2, 1), lambda: [torch.randn(2, 4, 9, 7)]),
    'AvgPool2d': (lambda c: c(3, 2, 1), lambda: [torch.randn(2, 4, 9, 7)]),
    'LayerNorm': (lambda c: c(8), lambda: [torch.randn(2, 5, 8)]),
    'GroupNorm': (lambda c: c(2, 8), lambda: [torch.randn(2, 8, 4, 3)]),
    '_BatchNorm': (lambda c: c(4), None),  # input rank from _check_input_dim
    'Dropout': (lambda c: c(0.3), lambda: [torch.randn(2, 5, 8)]),
    'MultiheadAttention': (lambda c: c(8, 2), lambda: [torch.randn(5, 2, 8)] * 3),
    'WindowMSA': (lambda c: c(8, 2, (2, 2)), lambda: [torch.randn(3, 4, 8)]),
    'DropPath': (lambda c: c(0.3), lambda: [torch.randn(4, 5, 8)]),
    'MatMul': (no_args, lambda: [torch.randn(2, 3, 4), torch.randn(2, 4, 5)]),
    'Softmax': (lambda c: c(dim=-1), lambda: [torch.randn(2, 3, 5, 5)]),
    'PReLU': (lambda c: c(4), lambda: [torch.randn(2, 4, 5, 3)]),
    'BaseDecodeHead': (decode_head, lambda: [torch.randn(2, 3, 4, 4)]),
    'EncoderDecoder': (segmentor, lambda: [torch.randn(2, 3, 32, 32)]),
    'DAHead': (da_head, lambda: [torch.randn(2, 3, 4, 4) for _ in range(3)]),
    'Conv1d': (lambda c: c(4, 6, 3, padding=1), lambda: [torch.randn(2, 4, 9)]),
    'AdaptiveAvgPool2d': (lambda c: c((3, 2)), lambda: [torch.randn(2, 4, 9, 7)]),
    'Encoding': (lambda c: c(4, 3), lambda: [torch.randn(2, 4, 5, 3)]),
    **{head: (own_loss_head, inputs) for head, (_, _, inputs) in OWN_LOSS_HEADS.items()},
    # mmseg's Mask2Former / MaskFormer heads (their handled bases are mmdet's)
    'MaskFormerHead': (mask_head, lambda: [torch.randn(2, 100, 151),
                                           torch.randn(2, 100, 16, 16)]),
}
def family_of(cls: type) -> str:
    """The nearest base with a recipe in ``FAMILIES``, else the nearest handled type (the
    activations: built without arguments, on a feature map)."""
    names = [base.__name__ for base in cls.__mro__]
    handled = {t.__name__ for t in handled_types()}
    return next((n for n in names if n in FAMILIES), None) or next(n for n in names if n in handled)


def build(cls: type) -> tuple[nn.Module, list[torch.Tensor]] | None:
    """A module of ``cls`` and inputs for it; None for an abstract class (no input rank)."""
    family = family_of(cls)
    if 'Lazy' in cls.__name__:
        return lazy(cls), []
    make, inputs = FAMILIES.get(family, (no_args, lambda: [torch.randn(2, 4, 5, 3)]))
    module = make(cls)
    if inputs is None:
        ranks = [r for r in range(2, 6) if _accepts(module, r)]
        if not ranks:
            return None
        return module, [torch.randn(3, 4, *([5] * (ranks[0] - 2)))]
    if family == 'BaseDecodeHead':
        module = LossOf(module)
    return module, inputs()


def same_aliasing(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``inputs`` that require grad and alias as the originals do.

    torch takes other code paths for one tensor passed several times (``nn.MultiheadAttention``
    projects ``q is k is v`` with one packed matmul, distinct tensors with three), and whether
    those give the same bits depends on the CPU's BLAS blocking: the converted module is
    promised the original's forward for the same arguments, so both get the same aliasing.
    """
    copies: dict[int, torch.Tensor] = {}
    return [copies.setdefault(id(x), x.clone().requires_grad_()) for x in inputs]


def _accepts(bn, ndim) -> bool:
    try:
        bn._check_input_dim(torch.zeros([1] * ndim))
    except (ValueError, NotImplementedError):
        return False
    return True


def test_every_handled_type_has_library_subclasses_enumerated():
    names = {c.__name__ for c in CLASSES}
    # the cases the rule exists for are found ...
    assert {'Conv2dAdaptivePadding', 'ConvWS2d', 'ConvAWS2d', '_BatchNormXd', 'LazyLinear',
            'UPerHead', 'FCNHead'} <= names
    # ... and so are the handled bases themselves
    assert {'Linear', 'Conv2d', 'LayerNorm', 'GELU', 'Softmax', 'BatchNorm2d'} <= names


@pytest.mark.parametrize('cls', CLASSES, ids=lambda c: f'{c.__module__}.{c.__qualname__}')
def test_subclass_is_converted_exactly_or_left_with_a_reason(cls):
    handler, reason = handler_for_type(cls)
    assert handler is not None
    if reason is not None:
        assert 'overrides' in reason and 'forward would be lost' in reason
        return
    if inspect.isabstract(cls):  # nothing of it can run: its subclasses are enumerated too
        with pytest.raises(TypeError, match='abstract'):
            build(cls)
        return
    built = build(cls)
    if built is None:  # abstract: _check_input_dim raises for every input rank
        with pytest.raises(NotImplementedError):
            cls(4)._check_input_dim(torch.zeros(1, 4))
        return
    module, inputs = built
    module.train()
    if 'Lazy' in cls.__name__:
        report = convert_to_mesa(nn.Sequential(module, nn.Linear(1, 1)))
        assert report.left['0'][1] == ('lazy module with uninitialized parameters '
                                       '(run one forward first)')
        return
    reference = copy.deepcopy(module)
    holder = nn.Sequential(module, nn.Linear(1, 1))  # never "nothing to convert"
    report = convert_to_mesa(holder, config=MesaConfig())
    target = module.head if isinstance(module, LossOf) else module
    if not isinstance(target, MesaModule):
        name = '0.head' if isinstance(module, LossOf) else '0'
        assert report.left[name][1], report.left  # left, and the report says why
        return
    torch.manual_seed(0)
    expected = reference(*inputs)
    torch.manual_seed(0)
    got = module(*same_aliasing(inputs))
    expected, got = (o if isinstance(o, tuple) else (o,) for o in (expected, got))
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert (a is None and b is None) or torch.equal(a, b)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """As LayerNorm2d classes in the ecosystem do: normalize NCHW over channels."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_a_subclass_overriding_forward_is_not_swapped_and_keeps_its_forward():
    """The handler would drop its forward: without the generic path it is left with the
    reason; with it, its own forward runs with its ``F.layer_norm`` through Mesa."""
    model = nn.Sequential(ChannelsFirstLayerNorm(4), nn.Conv2d(4, 4, 1))
    reference = copy.deepcopy(model)
    report = convert_to_mesa(model, config=MesaConfig(layers=MesaConfig().layers - {'generic'}))
    assert report.left['0'] == ('ChannelsFirstLayerNorm', 'ChannelsFirstLayerNorm overrides '
                                'forward of LayerNorm: its own forward would be lost')
    x = torch.randn(2, 4, 3, 5)
    assert torch.equal(model(x), reference(x))
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model)
    assert '0' in report.generic and '0' not in report.left
    x = torch.randn(2, 4, 3, 5, requires_grad=True)
    assert torch.equal(model(x), reference(x))
    assert [key.split('_', 1)[1] for key in model[0].mesa_sites] == ['layernorm_input']


def test_mmcv_convs_with_their_own_forward_are_handled_exactly():
    from mmcv.cnn.bricks.conv2d_adaptive_padding import Conv2dAdaptivePadding
    from mmcv.cnn.bricks.conv_ws import ConvWS2d
    for module in (Conv2dAdaptivePadding(4, 6, 3, stride=2), ConvWS2d(4, 6, 3, padding=1)):
        reference = copy.deepcopy(module)
        convert_to_mesa(nn.Sequential(module))
        assert isinstance(module, MesaModule)
        x = torch.randn(2, 4, 9, 8)
        x2 = x.clone().requires_grad_()
        y_ref = reference(x.requires_grad_())
        y = module(x2)
        assert torch.equal(y, y_ref)
        grad = torch.randn(y.shape)
        y_ref.backward(grad)
        y.backward(grad)
        for a, b in ((x.grad, x2.grad), (reference.weight.grad, module.weight.grad)):
            assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0) > 0.999
