"""Decode-head losses that keep only the low-resolution logits: the forward values equal the
unfused path bit for bit; gradients equal it bit for bit (whole recomputation) or up to the order
of float sums (banded cross-entropy)."""
import copy

import pytest
import torch
from mmengine.structures import PixelData
from mmseg.models.decode_heads import FCNHead
from mmseg.models.utils import resize
from mmseg.structures import SegDataSample

import mmseg_mesa.layers.banded_loss as banded_loss
from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.memory import count_saved_tensors

CE = 'mmseg.CrossEntropyLoss'
LOSSES = {
    'plain': dict(type=CE, loss_weight=1.0),
    'class_weight': dict(type=CE, loss_weight=0.4, class_weight=[0.5, 1.0, 2.0, 1.5, 0.7]),
    'class_weight_non_ignore': dict(type=CE, class_weight=[0.5, 1.0, 2.0, 1.5, 0.7],
                                    avg_non_ignore=True),
    'avg_non_ignore': dict(type=CE, avg_non_ignore=True),
    'loss_weight_sum': dict(type=CE, loss_weight=0.4, reduction='sum'),
    'two_ce': [dict(type=CE, loss_name='loss_ce'),
               dict(type=CE, loss_name='loss_ce_w', loss_weight=0.3, avg_non_ignore=True)],
    'same_name': [dict(type=CE, loss_name='loss_ce'), dict(type=CE, loss_name='loss_ce',
                                                           loss_weight=0.5)],
    'two_losses': [dict(type=CE, loss_name='loss_ce'),
                   dict(type='mmseg.DiceLoss', loss_name='loss_dice', loss_weight=0.5)],
    'ohem': dict(type=CE),
}
# Losses the banded path cannot compute exactly: recomputed whole, with the reason recorded.
WHOLE = {'two_losses': 'DiceLoss is not a per-pixel cross-entropy',
         'ohem': "OHEMPixelSampler weighs pixels by the whole batch's logits"}


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


def head_with(name, **kw):
    extra = dict(sampler=dict(type='OHEMPixelSampler', thresh=0.7, min_kept=100)) \
        if name == 'ohem' else {}
    return FCNHead(in_channels=8, channels=8, num_convs=1, num_classes=5, dropout_ratio=0.0,
                   loss_decode=LOSSES[name], **extra, **kw)


@pytest.mark.parametrize('band_elements', [5 * 4 * 32, 2 * 5 * 32 * 32])
@pytest.mark.parametrize('name', list(LOSSES))
def test_losses_equal_the_unfused_loss(name, band_elements, monkeypatch):
    # each image by bands of rows (where the kernel allows) or alone, or both images in one band
    monkeypatch.setattr(banded_loss, 'BAND_ELEMENTS', band_elements)
    head = head_with(name)
    ours = copy.deepcopy(head)
    report = convert_to_mesa(ours, config=MesaConfig(layers={'loss'}))
    assert list(report.converted) == ['']
    assert ours.mesa_loss_blocker == WHOLE.get(name)
    # mmseg 1.2.2's cross_entropy indexes class_weight with every label, ignore_index included
    # (an IndexError in mmseg itself), so those cases run without ignored pixels.
    data = samples(ignore='class_weight' not in name)
    logits = torch.randn(2, 5, 8, 8, generator=torch.Generator().manual_seed(1)) * 3
    logits.requires_grad_()
    logits2 = logits.detach().clone().requires_grad_()
    expected = head.loss_by_feat(logits, data)
    got = ours.loss_by_feat(logits2, data)
    assert list(expected) == list(got)
    for key in expected:
        assert expected[key].dtype == got[key].dtype
        assert torch.equal(expected[key], got[key]), key  # the forward is exact either way
    assert not got['acc_seg'].requires_grad
    total = sum(v for k, v in expected.items() if 'loss' in k)
    total_ours = sum(v for k, v in got.items() if 'loss' in k)
    total.backward()
    total_ours.backward()
    if name in WHOLE:
        assert torch.equal(logits.grad, logits2.grad)  # same ops, same order: bit-identical
    else:
        # the halo rows of two bands sum their contributions in two parts: fp32 rounding only
        scale = logits.grad.abs().max()
        assert (logits.grad - logits2.grad).abs().max() <= 1e-6 * scale
        assert not torch.equal(logits.grad, torch.zeros_like(logits.grad))


@pytest.mark.parametrize('in_size, out_size', [
    ((8, 8), (32, 32)), ((16, 12), (128, 96)), ((16, 8), (128, 64)), ((7, 5), (56, 40)),
    ((5, 9), (10, 18)), ((8, 8), (24, 24)), ((9, 8), (32, 32)), ((6, 6), (6, 6)),
    ((32, 32), (128, 128)), ((16, 24), (64, 96))])
@pytest.mark.parametrize('align_corners', [False, True])
@pytest.mark.parametrize('channels', [7, 3])
def test_bands_are_bit_identical_to_mmseg_resize(in_size, out_size, align_corners, channels):
    logits = torch.randn(3, channels, *in_size)
    full = resize(logits, size=out_size, mode='bilinear', align_corners=align_corners)
    by_rows = banded_loss.rows_bandable(logits, out_size, align_corners)
    image_elements = channels * out_size[0] * out_size[1]
    # the smallest bands (one row, or one image), then two images' worth: bands of two images
    # and one, or of several rows
    for band_elements, images in ((1, [1, 1, 1]), (2 * image_elements, [2, 1])):
        bands = banded_loss.plan_bands(3, channels, in_size, out_size, by_rows, band_elements)
        covered = torch.zeros(3, out_size[0], dtype=torch.int)
        for band in bands:
            up = banded_loss._upsampled(banded_loss._source(logits, band), band, out_size[1],
                                        align_corners)
            assert torch.equal(up, full[band.batch, :, band.out_start:band.out_stop])
            covered[band.batch, band.out_start:band.out_stop] += 1
        assert (covered == 1).all()
        if not by_rows:
            assert [band.images for band in bands] == images
    factor = out_size[0] // in_size[0]
    expect_rows = (not align_corners and channels != 3 and out_size[0] == factor * in_size[0]
                   and factor & (factor - 1) == 0 and sum(out_size) > 128)
    assert by_rows is expect_rows


def test_banded_loss_bounds_the_full_resolution_transients(monkeypatch):
    from torch.distributed._tools.mem_tracker import MemTracker
    monkeypatch.setattr(banded_loss, 'BAND_ELEMENTS', 19 * 4 * 128 * 4)  # 4 input rows
    head = FCNHead(in_channels=8, channels=8, num_convs=1, num_classes=19, dropout_ratio=0.0)
    ours = copy.deepcopy(head)
    convert_to_mesa(ours, config=MesaConfig(layers={'loss'}))
    data = samples(size=128, classes=19)
    peaks = {}
    for name, module in (('unfused', head), ('banded', ours)):
        logits = torch.randn(2, 19, 32, 32, requires_grad=True)
        tracker = MemTracker()
        tracker.track_external(logits, *[s.gt_sem_seg.data for s in data])
        with tracker:
            losses = module.loss_by_feat(logits, data)
            losses['loss_ce'].backward()
            del losses
        peaks[name] = tracker.get_tracker_snapshot('peak')[logits.device]['Total']
    full = 2 * 19 * 128 * 128 * 4  # one full-resolution logits tensor of the batch
    assert peaks['unfused'] > 2 * full, (peaks, full)
    assert peaks['banded'] < 0.25 * peaks['unfused'], (peaks, full)


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


def test_heads_with_a_loss_mesa_does_not_know_are_left_with_a_reason():
    class OwnLossHead(FCNHead):
        def loss_by_feat(self, seg_logits, batch_data_samples):
            return dict(loss_own=seg_logits.square().mean())

    head = OwnLossHead(in_channels=8, channels=8, num_convs=1, num_classes=2, dropout_ratio=0.0)
    report = convert_to_mesa(head, config=MesaConfig(layers={'loss', 'conv2d'}))
    kind, reason = report.left['']
    assert kind == 'OwnLossHead' and 'OwnLossHead' in reason and 'loss_by_feat' in reason


def own_loss_heads():
    """STDC's detail head (sigmoid cross-entropy and Dice on Laplacian boundary targets, one
    logit map) and DDRNet's head (OHEM cross-entropy on two logit maps)."""
    from mmseg.registry import MODELS
    ohem = dict(type='OhemCrossEntropy', thres=0.9, min_kept=500)
    return {
        'stdc': (MODELS.build(dict(
            type='STDCHead', in_channels=8, channels=8, num_convs=1, num_classes=2,
            boundary_threshold=0.1, concat_input=False, align_corners=True, loss_decode=[
                dict(type='CrossEntropyLoss', loss_name='loss_ce', use_sigmoid=True),
                dict(type='DiceLoss', loss_name='loss_dice')])), 1),
        'ddrnet': (MODELS.build(dict(
            type='DDRHead', in_channels=8, channels=8, num_classes=5, dropout_ratio=0.0,
            loss_decode=[ohem, dict(ohem, loss_weight=0.4)])), 5),
    }


@pytest.mark.parametrize('name', ['stdc', 'ddrnet'])
def test_heads_with_their_own_loss_keep_only_their_logits(name):
    """Their loss runs whole through RecomputedLoss: values and gradients bit-identical, and
    only the logits saved (the unconverted head keeps full-resolution maps)."""
    head, channels = own_loss_heads()[name]
    ours = copy.deepcopy(head)
    report = convert_to_mesa(ours, config=MesaConfig(layers={'loss'}))
    assert report.converted[''][0] == type(head).__name__
    data = samples(size=64, classes=min(channels, 5) if channels > 1 else 2)
    gen = torch.Generator().manual_seed(1)
    maps = [torch.randn(2, channels, 16, 16, generator=gen) for _ in range(2 if name == 'ddrnet'
                                                                           else 1)]
    results = []
    for model in (head, ours):
        leaves = [m.clone().requires_grad_() for m in maps]
        logits = tuple(leaves) if len(leaves) > 1 else leaves[0]
        with count_saved_tensors() as saved:
            losses = model.loss_by_feat(logits, data)
        sum(v for k, v in losses.items() if 'loss' in k).backward()
        results.append((losses, [leaf.grad for leaf in leaves], saved.total_bytes))
    (expected, exact, unfused), (got, grads, fused) = results
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert all(torch.equal(a, b) for a, b in zip(exact, grads))
    assert fused == sum(m.numel() * 4 for m in maps)
    assert unfused >= 2 * 64 * 64 * 4 * channels  # a full-resolution map at least


class SampledLoss(torch.nn.Module):
    """A loss of two inputs that samples (as Mask2Former's point losses do) and runs a child
    module on a view of an input."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.SmoothL1Loss()

    def forward(self, scores, masks):
        points = torch.randint(0, masks.shape[-1], (7,))
        picked = masks.flatten(1)[:, points]
        return dict(loss_a=self.inner(scores.flatten(0, 1), torch.zeros_like(scores).flatten(0, 1)),
                    loss_b=(picked.sigmoid() * scores[:, :1]).sum(), acc=picked.mean())


def test_recomputed_loss_of_several_inputs_replays_the_random_state():
    from mmseg_mesa.layers.recompute import recomputed_losses
    from mmseg_mesa.memory import track_step_peak
    loss = SampledLoss()
    gen = torch.Generator().manual_seed(3)
    scores, masks = torch.randn(4, 5, generator=gen), torch.randn(4, 6, 6, generator=gen)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        a, b = scores.clone().requires_grad_(), masks.clone().requires_grad_()
        result = recomputed_losses(loss, a, b) if recompute else loss(a, b)
        after_forward = torch.rand(1)
        (result['loss_a'] + result['loss_b']).backward()
        assert not (recompute and result['acc'].requires_grad)  # a metric, not a loss
        grads.append((a.grad, b.grad, after_forward, {k: v.detach() for k, v in result.items()}))
    (ga, gb, r0, v0), (ha, hb, r1, v1) = grads
    assert torch.equal(ga, ha) and torch.equal(gb, hb)  # the same points in backward
    assert torch.equal(r0, r1)  # the model's stream goes on as without recomputation
    assert all(torch.equal(v0[k], v1[k]) for k in v0)
    # MemTracker's module hooks see no tensor that claims a gradient without a grad_fn
    model = torch.nn.Sequential(torch.nn.Linear(5, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = scores.clone()

    def step_loss():
        out = model(x)
        result = recomputed_losses(loss, out, masks.clone().requires_grad_())
        return result['loss_a'] + result['loss_b']

    assert track_step_peak(model, optimizer, step_loss, x).peak_bytes > 0
