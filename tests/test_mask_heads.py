"""Mask2Former's per-layer loss sampled from the ground truth a block of masks at a time, and
mmseg's head keeping its masks as bool: the same losses and gradients as mmdet's, bit for bit,
with a lower peak."""
import copy

import pytest
import torch
from mmengine.structures import InstanceData, PixelData
from mmseg.structures import SegDataSample

import mmseg_mesa.layers.chunking as chunking
from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.integrations import mask2former_loss, mask_heads
from mmseg_mesa.integrations.mask2former_loss import point_losses, sampled_masks

pytest.importorskip('mmdet')

CLASSES = 150


def head_args(**train_cfg):
    """mmseg's ADE20K Mask2Former head (R-50 config), its train_cfg changed by ``train_cfg``."""
    from mmseg.utils import register_all_modules
    from mmseg_models import upstream_config
    register_all_modules()
    args = copy.deepcopy(dict(upstream_config(
        'mask2former/mask2former_r50_8xb2-160k_ade20k-512x512.py').model.decode_head))
    args.pop('type')
    args['train_cfg'].update(train_cfg)
    return args


def seg_head(**train_cfg):
    from mmseg.models.decode_heads import Mask2FormerHead
    torch.manual_seed(0)
    head = Mask2FormerHead(**head_args(**train_cfg))
    head.init_weights()
    return head.train()


@pytest.fixture(scope='module')
def head():
    return seg_head()


def ground_truth(sizes, gts, dtype=torch.long, seed=0):
    """Per image: ``gts`` random labels and as many random masks of ``sizes``."""
    gen = torch.Generator().manual_seed(seed)
    return [InstanceData(labels=torch.randperm(CLASSES, generator=gen)[:n],
                         masks=(torch.rand(n, *sizes, generator=gen) > 0.5).to(dtype))
            for n in gts]


def layer_inputs(batch=2, queries=100, size=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, queries, CLASSES + 1, generator=gen),
            torch.randn(batch, queries, size, size, generator=gen))


def losses_and_grads(loss_fn, cls_scores, mask_preds):
    """The three losses, their gradients (summed) and the next random draw, from seed 0."""
    scores = cls_scores.clone().requires_grad_()
    masks = mask_preds.clone().requires_grad_()
    torch.manual_seed(0)
    losses = loss_fn(scores, masks)
    after = torch.rand(3)
    sum(losses).backward()
    return [v.detach() for v in losses], scores.grad, masks.grad, after


@pytest.mark.parametrize('dtype', [torch.long, torch.bool, torch.uint8])
def test_sampled_masks_are_point_samples_bit_for_bit(monkeypatch, dtype):
    from mmcv.ops import point_sample
    masks = ground_truth((40, 24), [13], dtype)[0].masks
    points = torch.rand(1, 300, 2)
    whole = point_sample(masks.unsqueeze(1).float(), points.repeat(13, 1, 1)).squeeze(1)
    rows = torch.tensor([7, 0, 12, 7, 3])
    row_points = torch.rand(5, 300, 2)
    picked = point_sample(masks[rows].unsqueeze(1).float(), row_points).squeeze(1)
    for chunk_bytes in (1 << 40, 3 * 40 * 24 * 4, 1):  # one block; blocks of 3; one mask each
        monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', chunk_bytes)
        assert torch.equal(sampled_masks(masks, points.expand(13, -1, -1)), whole)
        assert torch.equal(sampled_masks(masks, row_points, rows), picked)
    empty = masks[:0]
    assert sampled_masks(empty, points.expand(0, -1, -1)).shape == (0, 300)


@pytest.mark.parametrize('gts, dtype', [
    ([5, 9], torch.long),
    ([5, 9], torch.bool),
    ([120, 3], torch.long),   # more masks than queries: some stay unmatched
    ([0, 4], torch.long),     # an image without ground truth
    ([0, 0], torch.bool),     # no match at all
])
def test_point_losses_equal_mmdets_bit_for_bit(monkeypatch, head, gts, dtype):
    """Losses, gradients and the random stream after them as mmdet's
    ``Mask2FormerHead._loss_by_feat_single``, with the ground truth at 4x the logits' size (as
    in training) sampled three masks at a time."""
    from mmdet.models.dense_heads import Mask2FormerHead
    cls_scores, mask_preds = layer_inputs()
    batch_gts = ground_truth((64, 64), gts, dtype)
    metas = [dict(img_shape=(64, 64), pad_shape=(64, 64))] * 2

    def mmdet_loss(scores, masks):
        return Mask2FormerHead._loss_by_feat_single(head, scores, masks, batch_gts, metas)

    def ours(scores, masks):
        return point_losses(head, scores, masks, batch_gts, metas)

    expected = losses_and_grads(mmdet_loss, cls_scores, mask_preds)
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', 3 * 64 * 64 * 4)
    got = losses_and_grads(ours, cls_scores, mask_preds)
    for want, have in zip(expected[0], got[0]):
        assert torch.equal(want, have)
    for want, have in zip(expected[1:], got[1:]):
        assert torch.equal(want, have)


def samples(n=2, size=64, seed=0):
    """Label maps with every class somewhere and an ignored band, as the benchmark's."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        labels = torch.randint(0, CLASSES, (1, size, size), generator=gen)
        labels[:, :4] = 255
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=labels)
        sample.set_metainfo(dict(img_shape=(size, size), pad_shape=(size, size)))
        out.append(sample)
    return out


def features(batch=2, size=64, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, c, size // s, size // s, generator=gen)
            for c, s in ((256, 4), (512, 8), (1024, 16), (2048, 32))]


def test_converted_head_losses_and_gradients_equal_mmsegs(head, monkeypatch):
    """mmseg's whole head (its forward, bool masks, ten layers' point losses recomputed in
    backward) against the unconverted head: losses and every gradient bit for bit."""
    calls = []

    def counted(*args):
        calls.append(args[3][0].masks.dtype)
        return point_losses(*args)

    monkeypatch.setattr(mask_heads, 'point_losses', counted)
    reference = copy.deepcopy(head)
    model = copy.deepcopy(head)
    report = convert_to_mesa(model, config=MesaConfig(layers=frozenset({'loss'})))
    assert type(model).__name__ == 'MesaMask2FormerHead', report
    data = samples()
    results = []
    for module in (reference, model):
        inputs = [x.clone().requires_grad_() for x in features()]
        torch.manual_seed(0)
        losses = module.loss(inputs, data, dict())
        sum(v for k, v in losses.items() if 'loss' in k).backward()
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        results.append((losses, grads, [x.grad for x in inputs]))
    (ref_losses, ref_grads, ref_inputs), (losses, grads, input_grads) = results
    assert ref_losses.keys() == losses.keys()
    assert all(torch.equal(ref_losses[k], losses[k]) for k in ref_losses)
    assert ref_grads.keys() == grads.keys()
    assert all(torch.equal(ref_grads[k], grads[k]) for k in ref_grads)
    assert all(torch.equal(a, b) for a, b in zip(ref_inputs, input_grads))
    # ten decoder layers' losses, each in forward and again in backward, on bool masks
    assert calls == [torch.bool] * 2 * (head.num_transformer_decoder_layers + 1)


def test_seg_head_masks_are_bool_in_a_training_step_only(head):
    model = copy.deepcopy(head)
    convert_to_mesa(model, config=MesaConfig(layers=frozenset({'loss'})))
    data = samples()
    expected, _ = head._seg_data_to_instance_data(data)
    got, _ = model._seg_data_to_instance_data(data)
    for want, have in zip(expected, got):
        assert want.masks.dtype == torch.long and have.masks.dtype == torch.bool
        assert torch.equal(want.labels, have.labels)
        assert torch.equal(want.masks, have.masks.long())
    with torch.no_grad():
        assert model._seg_data_to_instance_data(data)[0][0].masks.dtype == torch.long
    model.eval()
    assert model._seg_data_to_instance_data(data)[0][0].masks.dtype == torch.long


def test_another_sampler_keeps_mmdets_loss(head, monkeypatch):
    """A sampler other than MaskPseudoSampler may read the full masks: mmdet's own loss runs."""
    from mmdet.models.task_modules.samplers import MaskPseudoSampler

    class OtherSampler(MaskPseudoSampler):
        pass

    model = copy.deepcopy(head)
    convert_to_mesa(model, config=MesaConfig(layers=frozenset({'loss'})))
    model.sampler = OtherSampler()
    assert mask2former_loss.supports_point_losses(model) is not None
    called = []
    monkeypatch.setattr(mask_heads, 'point_losses', lambda *a: called.append(a))
    cls_scores, mask_preds = layer_inputs()
    metas = [dict(img_shape=(64, 64), pad_shape=(64, 64))] * 2
    losses = model._loss_by_feat_single(cls_scores.requires_grad_(), mask_preds,
                                        ground_truth((64, 64), [3, 3]), metas)
    sum(losses).backward()
    assert len(losses) == 3 and not called


def test_point_losses_lower_the_peak_of_a_layer_loss(monkeypatch, head):
    """One layer's loss, forward and backward, on 40 int64 masks of 128x128 per image: mmdet's
    path holds the matched masks three times over in int64 (the sampling result's, the
    targets', their concatenation) and once in float at its peak; ours a block of float masks.
    Its peak must be lower by at least the concatenation and its float copy: 12 bytes a pixel
    of every matched mask."""
    from torch.distributed._tools.mem_tracker import MemTracker
    size, gts = 128, [40, 40]
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', 4 * size * size * 4)
    small = copy.deepcopy(head)
    small.num_points = 1024  # keeps the points' own temporaries small beside the masks
    batch_gts = ground_truth((size, size), gts)
    metas = [dict(img_shape=(size, size), pad_shape=(size, size))] * 2
    cls_scores, mask_preds = layer_inputs(size=size // 4)

    def peak(loss_fn):
        scores = cls_scores.clone().requires_grad_()
        masks = mask_preds.clone().requires_grad_()
        tracker = MemTracker()
        tracker.track_external(scores, masks, *[g.masks for g in batch_gts])
        torch.manual_seed(0)
        with tracker:
            sum(loss_fn(small, scores, masks, batch_gts, metas)).backward()
        return tracker.get_tracker_snapshot('peak')[torch.device('cpu')]['Total']

    from mmdet.models.dense_heads import Mask2FormerHead
    mmdet_peak = peak(Mask2FormerHead._loss_by_feat_single)
    our_peak = peak(point_losses)
    concatenation = sum(gts) * size * size * 8
    # measured: 2.1x the int64 concatenation
    assert mmdet_peak - our_peak >= 1.5 * concatenation, (mmdet_peak - our_peak) / concatenation
