"""MesaEncoderDecoder: the decode head drops the feature levels it has read; nothing else
changes."""
import copy
import weakref

import pytest
import torch
from mmseg.models.segmentors.cascade_encoder_decoder import CascadeEncoderDecoder
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules
from mmseg_models import batch, total_loss

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.integrations.segmentor import FeatureList, MesaEncoderDecoder
from mmseg_mesa.registry import handler_for_type

CHANNELS = [16, 32, 64, 128]


def small_upernet(aux_index=2, seed=0):
    """A ResNet-18-shaped UPerNet with 16 base channels and an FCN auxiliary head."""
    register_all_modules()
    head = dict(in_channels=CHANNELS, in_index=[0, 1, 2, 3], num_classes=5, norm_cfg=dict(
        type='BN', requires_grad=True), align_corners=False, loss_decode=dict(
        type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0))
    cfg = dict(
        type='EncoderDecoder',
        backbone=dict(type='ResNetV1c', depth=18, stem_channels=16, base_channels=16,
                      norm_cfg=dict(type='BN', requires_grad=True)),
        decode_head=dict(type='UPerHead', pool_scales=(1, 2, 3, 6), channels=16,
                         dropout_ratio=0.1, **head),
        auxiliary_head=dict(type='FCNHead', in_channels=CHANNELS[aux_index],
                            in_index=aux_index, channels=8, num_convs=1, concat_input=False,
                            dropout_ratio=0.1, num_classes=5, align_corners=False,
                            norm_cfg=dict(type='BN', requires_grad=True),
                            loss_decode=dict(type='CrossEntropyLoss', loss_weight=0.4)),
        train_cfg=dict(), test_cfg=dict(mode='whole'))
    torch.manual_seed(seed)
    return MODELS.build(cfg).train()


def step(model, inputs, samples):
    torch.manual_seed(1)  # the same dropout masks in every model
    losses = model.loss(inputs, samples)
    total_loss(losses).backward()
    return losses, {n: p.grad for n, p in model.named_parameters()}


def test_losses_and_gradients_are_those_of_the_plain_segmentor():
    """The only difference from converting everything but the segmentor is which references
    the training forward holds: losses and gradients bit for bit."""
    model = small_upernet()
    plain_segmentor = copy.deepcopy(model)
    config = MesaConfig(stochastic_rounding=False)  # no rounding stream to keep in step
    report = convert_to_mesa(model, config=config)
    convert_to_mesa(plain_segmentor, config=config,
                    module_filter_fn=lambda module, name: name != '')
    assert isinstance(model, MesaEncoderDecoder) and report.converted[''] == (
        'EncoderDecoder', 'MesaEncoderDecoder')
    assert not isinstance(plain_segmentor, MesaEncoderDecoder)
    plain_segmentor.load_state_dict(model.state_dict())  # the same EMA state from here on
    inputs, samples = batch(64, classes=5)
    got, got_grads = step(model, inputs, samples)
    want, want_grads = step(plain_segmentor, inputs, samples)
    assert got.keys() == want.keys()
    for key in got:
        assert torch.equal(got[key], want[key]), key
    for name, grad in want_grads.items():
        assert (grad is None) == (got_grads[name] is None), name
        assert grad is None or torch.equal(got_grads[name], grad), name
    model.eval()  # inference is mmseg's own
    plain_segmentor.eval()
    with torch.no_grad():
        assert torch.equal(model(inputs, mode='tensor'), plain_segmentor(inputs, mode='tensor'))


@pytest.mark.parametrize('aux_index', [2, 0, -4])
def test_levels_the_decode_head_has_read_are_freed_before_its_fusion(aux_index):
    model = small_upernet(aux_index)
    convert_to_mesa(model, config=MesaConfig())
    levels = []
    model.backbone.register_forward_hook(
        lambda module, args, outputs: levels.extend(weakref.ref(t) for t in outputs))
    alive = []
    model.decode_head.fpn_convs[0].register_forward_pre_hook(
        lambda module, args: alive.extend(ref() is not None for ref in levels))
    losses = model.loss(*batch(64, classes=5))
    kept = aux_index % len(CHANNELS)
    # every level a lateral conv has read is gone but the auxiliary head's (the coarsest one,
    # the PPM's, may stay saved by a pooling left unconverted)
    assert alive[:3] == [i == kept for i in range(3)]
    assert all(v.isfinite().all() for v in losses.values())


def test_feature_list_keeps_what_later_heads_read():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    features = FeatureList((a, b, c), keep=[-1])
    features.release([0, 2, -1])
    assert features[0] is None and features[1] is b and features[2] is c


def test_a_segmentor_that_feeds_its_heads_itself_is_left_with_the_reason():
    handler, reason = handler_for_type(CascadeEncoderDecoder)
    assert handler is not None and '_decode_head_forward_train' in reason
    handler, reason = handler_for_type(MODELS.get('EncoderDecoder'))
    assert handler is not None and reason is None


def test_without_the_loss_layer_type_the_segmentor_is_left():
    model = small_upernet()
    report = convert_to_mesa(model, config=MesaConfig(
        layers=[t for t in MesaConfig().layers if t != 'loss']))
    assert not isinstance(model, MesaEncoderDecoder)
    assert "'loss' not in config.layers" in report.left[''][1]
