"""Decode-head losses that keep only the low-resolution logits: gradients equal the unfused path."""
import copy

import pytest
import torch
from mmengine.structures import PixelData
from mmseg.models.decode_heads import FCNHead
from mmseg.structures import SegDataSample

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.memory import count_saved_tensors

LOSSES = {
    'plain': dict(type='mmseg.CrossEntropyLoss', loss_weight=1.0),
    'class_weight': dict(type='mmseg.CrossEntropyLoss', loss_weight=0.4,
                         class_weight=[0.5, 1.0, 2.0, 1.5, 0.7]),
    'avg_non_ignore': dict(type='mmseg.CrossEntropyLoss', avg_non_ignore=True),
    'two_losses': [dict(type='mmseg.CrossEntropyLoss', loss_name='loss_ce'),
                   dict(type='mmseg.DiceLoss', loss_name='loss_dice', loss_weight=0.5)],
}


def samples(n=2, size=32, classes=5, ignore=True):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        labels = torch.randint(0, classes, (1, size, size), generator=gen)
        if ignore:
            labels[:, :5] = 255  # ignore_index
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=labels)
        sample.set_metainfo(dict(img_shape=(size, size), pad_shape=(size, size)))
        out.append(sample)
    return out


@pytest.mark.parametrize('name', list(LOSSES))
def test_gradients_equal_the_unfused_loss(name):
    head = FCNHead(in_channels=8, channels=8, num_convs=1, num_classes=5, dropout_ratio=0.0,
                   loss_decode=LOSSES[name])
    ours = copy.deepcopy(head)
    report = convert_to_mesa(ours, config=MesaConfig(layers={'loss'}))
    assert list(report.converted) == ['']
    # mmseg 1.2.2's cross_entropy indexes class_weight with every label, ignore_index included
    # (an IndexError in mmseg itself), so that case runs without ignored pixels.
    data = samples(ignore=name != 'class_weight')
    logits = torch.randn(2, 5, 8, 8, requires_grad=True)
    logits2 = logits.detach().clone().requires_grad_()
    expected = head.loss_by_feat(logits, data)
    got = ours.loss_by_feat(logits2, data)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert not got['acc_seg'].requires_grad
    total = sum(v for k, v in expected.items() if 'loss' in k)
    total_ours = sum(v for k, v in got.items() if 'loss' in k)
    total.backward()
    total_ours.backward()
    assert torch.equal(logits.grad, logits2.grad)  # same ops, same order: bit-identical


def test_only_low_resolution_logits_are_saved():
    head = FCNHead(in_channels=8, channels=8, num_convs=1, num_classes=5, dropout_ratio=0.0)
    ours = copy.deepcopy(head)
    convert_to_mesa(ours, config=MesaConfig(layers={'loss'}))
    data = samples(size=64)
    logits = torch.randn(2, 5, 16, 16, requires_grad=True)
    with count_saved_tensors() as unfused:
        head.loss_by_feat(logits, data)
    with count_saved_tensors() as fused:
        ours.loss_by_feat(logits, data)
    assert fused.total_bytes == logits.numel() * 4
    assert unfused.total_bytes >= 2 * 5 * 64 * 64 * 4  # the full-resolution log-softmax


def test_autocast_and_eval():
    head = FCNHead(in_channels=8, channels=8, num_convs=1, num_classes=5, dropout_ratio=0.0)
    ours = copy.deepcopy(head)
    convert_to_mesa(ours, config=MesaConfig(layers={'loss'}))
    data = samples()
    logits = torch.randn(2, 5, 8, 8, requires_grad=True)
    logits2 = logits.detach().clone().requires_grad_()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        expected = head.loss_by_feat(logits * 1.0, data)
        got = ours.loss_by_feat(logits2 * 1.0, data)
    assert torch.equal(expected['loss_ce'], got['loss_ce'])
    expected['loss_ce'].backward()
    got['loss_ce'].backward()
    assert torch.equal(logits.grad, logits2.grad)
    ours.eval()
    with torch.no_grad():
        assert torch.equal(ours.loss_by_feat(logits, data)['loss_ce'],
                           head.loss_by_feat(logits, data)['loss_ce'])


def test_heads_with_their_own_loss_are_left_with_a_reason():
    from mmseg.models.decode_heads import STDCHead
    head = STDCHead(in_channels=8, channels=8, num_convs=1, num_classes=2, dropout_ratio=0.0,
                    boundary_threshold=0.1)
    report = convert_to_mesa(head, config=MesaConfig(layers={'loss', 'conv2d'}))
    assert report.left[''] == ('STDCHead', 'STDCHead has its own loss_by_feat')
