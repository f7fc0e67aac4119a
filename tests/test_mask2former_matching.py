"""Mask2Former in a Mesa training step: each decoder layer's matching runs once, in forward, and
the recomputation of its loss in backward reuses it; the step adds no host sync to mmseg's.

Syncs are counted where torch dispatches them (``bench.dispatch``), on CPU with the CPU taking the
branches a device takes (``host.device_path``).
"""
import collections
import copy

import pytest
import torch
from mmengine.structures import PixelData
from mmseg.structures import SegDataSample

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.bench.dispatch import CountDispatch, count_step
from mmseg_mesa.host import device_path
from mmseg_mesa.integrations import mask_heads
from mmseg_mesa.integrations.mask2former_loss import point_losses, point_targets
from mmseg_mesa.layers.recompute import recomputed_losses

pytest.importorskip('mmdet')

CLASSES = 150
BATCH = 2
SIZE = 64


def small_head():
    """mmseg's ADE20K Mask2Former head (R-50 config), shrunk: one pixel-decoder layer, two
    transformer-decoder layers (three layer losses), 20 queries, 256 points."""
    from mmseg.models.decode_heads import Mask2FormerHead
    from mmseg.utils import register_all_modules
    from mmseg_models import upstream_config
    register_all_modules()
    args = copy.deepcopy(dict(upstream_config(
        'mask2former/mask2former_r50_8xb2-160k_ade20k-512x512.py').model.decode_head))
    args.pop('type')
    args['num_queries'] = 20
    args['pixel_decoder']['encoder']['num_layers'] = 1
    args['transformer_decoder']['num_layers'] = 2
    args['train_cfg']['num_points'] = 256
    torch.manual_seed(0)
    head = Mask2FormerHead(**args)
    head.init_weights()
    return head.train()


def samples(n=BATCH, size=SIZE, seed=0, labels=12):
    """Label maps of ``labels`` classes (fewer than the queries, so that some stay unmatched)
    with an ignored band."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        classes = torch.randperm(CLASSES, generator=gen)[:labels]
        label_map = classes[torch.randint(0, labels, (1, size, size), generator=gen)]
        label_map[:, :4] = 255
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=label_map)
        sample.set_metainfo(dict(img_shape=(size, size), pad_shape=(size, size)))
        out.append(sample)
    return out


def features(batch=BATCH, size=SIZE, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, c, size // s, size // s, generator=gen)
            for c, s in ((256, 4), (512, 8), (1024, 16), (2048, 32))]


def training_step(head, feats, data):
    losses = head.loss(feats, data, dict())
    sum(v for k, v in losses.items() if 'loss' in k).backward()
    head.zero_grad(set_to_none=True)


@pytest.fixture(scope='module')
def heads():
    """(mmseg's head, its Mesa conversion with every layer type, with the loss alone)."""
    head = small_head()
    converted = {}
    for name, config in (('mesa', MesaConfig()),
                         ('loss', MesaConfig(layers=frozenset({'loss'})))):
        converted[name] = copy.deepcopy(head)
        convert_to_mesa(converted[name], config=config)
        assert type(converted[name]).__name__ == 'MesaMask2FormerHead'
    return head, converted['mesa'], converted['loss']


def test_the_matching_runs_once_per_decoder_layer(heads, monkeypatch):
    """mmdet assigns and samples once per image and decoder layer; so does a Mesa step (its
    recomputation reuses the forward's matching), and backward does not match at all."""
    from mmdet.models.task_modules.assigners import HungarianAssigner
    from mmdet.models.task_modules.samplers import MaskPseudoSampler
    calls = collections.Counter()

    def counted(cls, method):
        original = getattr(cls, method)

        def wrapper(self, *args, **kwargs):
            calls[method, torch.is_grad_enabled()] += 1
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, method, wrapper)

    counted(HungarianAssigner, 'assign')
    counted(MaskPseudoSampler, 'sample')
    feats, data = features(), samples()
    base, mesa, _ = heads
    per_step = {}
    for name, head in (('baseline', base), ('mesa', mesa)):
        calls.clear()
        training_step(head, feats, data)
        per_step[name] = dict(calls)
    layers = base.num_transformer_decoder_layers + 1
    assert sum(n for (method, _), n in per_step['baseline'].items()
               if method == 'assign') == BATCH * layers
    # Mesa's forward of the loss runs without grad; its recomputation, with grad, matches none
    assert per_step['mesa'] == {('assign', False): BATCH * layers,
                                ('sample', False): BATCH * layers}


def test_the_recomputed_layer_loss_reuses_the_forwards_targets(heads, monkeypatch):
    """``point_targets`` runs once per layer; ``point_losses`` twice (forward, backward), the
    second time with the first's targets."""
    targets_calls, loss_targets = [], []

    def targets(*args):
        targets_calls.append(point_targets(*args))
        return targets_calls[-1]

    def losses(*args):
        loss_targets.append(args[5])
        return point_losses(*args)

    monkeypatch.setattr(mask_heads, 'point_targets', targets)
    monkeypatch.setattr(mask_heads, 'point_losses', losses)
    _, _, head = heads
    training_step(head, features(), samples())
    layers = head.num_transformer_decoder_layers + 1
    assert len(targets_calls) == layers
    assert len(loss_targets) == 2 * layers
    # the forwards run layer by layer, the recomputations in backward in reverse
    assert all(a is b for a, b in zip(loss_targets[:layers], targets_calls))
    assert all(a is b for a, b in zip(loss_targets[layers:], reversed(targets_calls)))


def test_point_losses_with_given_targets_are_the_same_bits(heads):
    """Targets matched beforehand, then the loss from the random state after the matching:
    the losses and gradients of the loss that matches itself."""
    _, _, head = heads
    gen = torch.Generator().manual_seed(1)
    cls_scores = torch.randn(BATCH, head.num_queries, CLASSES + 1, generator=gen)
    mask_preds = torch.randn(BATCH, head.num_queries, SIZE // 4, SIZE // 4, generator=gen)
    gts, metas = head._seg_data_to_instance_data(samples())

    def run(given):
        scores, masks = cls_scores.clone().requires_grad_(), mask_preds.clone().requires_grad_()
        torch.manual_seed(0)
        targets = point_targets(head, scores, masks, gts, metas) if given else None
        losses = point_losses(head, scores, masks, gts, metas, targets)
        sum(losses).backward()
        return [*losses, scores.grad, masks.grad, torch.rand(3)]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_targets_fn_runs_once_and_backward_replays_the_draws_after_it():
    """``recomputed_losses(..., targets_fn=...)``: the targets once, in forward; backward
    replays the random draws the loss made after them, so the gradients are exact."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen)
    calls = []

    def targets_fn(t):
        calls.append(torch.is_grad_enabled())
        return torch.rand(t.shape[0]).argsort()  # draws, as a matching's points do

    def loss_fn(order, t):
        noise = torch.rand(t.shape)
        return dict(loss=((t[order] * noise) ** 2).sum(), other=t.sum().detach())

    def run(recompute):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(0)
        if recompute:
            result = recomputed_losses(loss_fn, leaf, targets_fn=targets_fn)
        else:
            result = loss_fn(targets_fn(leaf), leaf)
        result['loss'].backward()
        return result['loss'].detach(), leaf.grad, torch.rand(2)

    expected = run(False)
    calls.clear()
    got = run(True)
    assert calls == [False]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize('ignore_index', [255, 5, 0])
@pytest.mark.parametrize('kind', ['band', 'none ignored', 'all ignored'])
def test_gt_labels_as_mmsegs_reading_only_the_unique_values(heads, ignore_index, kind):
    """mmseg's labels (its ``unique`` and a bool mask) from the ``unique`` alone, in its order,
    wherever ``ignore_index`` falls among the labels and whether or not any pixel has it."""
    base, _, head = heads
    data = samples(labels=8)
    for sample in data:
        label_map = sample.gt_sem_seg.data
        label_map[label_map == 255] = ignore_index if kind == 'band' else 7
        if kind == 'all ignored':
            label_map.fill_(ignore_index)
    base, head = copy.copy(base), copy.copy(head)
    base.ignore_index = head.ignore_index = ignore_index
    expected, _ = base._seg_data_to_instance_data(data)
    with device_path(), CountDispatch() as mode:
        got, _ = head._seg_data_to_instance_data(data)
    assert dict(mode.count.sync_names()) == {'_unique2': len(data)}
    for want, have in zip(expected, got):
        assert torch.equal(want.labels, have.labels)
        assert want.masks.shape == have.masks.shape
        assert torch.equal(want.masks, have.masks.long())


def step_syncs(head, feats, data):
    """The syncs of a training step after a first one, on the device's branches."""
    with device_path():
        training_step(head, feats, data)
        return count_step(lambda: training_step(head, feats, data))


@pytest.mark.parametrize('which', ['mesa', 'loss'])
def test_a_training_step_adds_no_host_sync(heads, which):
    """By op name, no more syncs than mmseg's step; and none called from Mesa's code but the
    ``unique`` that finds each image's labels, which stands in for mmseg's own."""
    base, mesa, loss = heads
    feats, data = features(), samples()
    baseline = step_syncs(base, feats, data)
    counts = step_syncs(mesa if which == 'mesa' else loss, feats, data)
    added = counts.sync_names()
    added.subtract(baseline.sync_names())
    assert {name: n for name, n in added.items() if n > 0} == {}
    assert baseline.sync_names()['_unique2'] >= BATCH
    own = counts.mesa_syncs()
    assert set(own) <= {key for key in own if key[0] == '_unique2'
                        and key[1].startswith('mmseg_mesa/integrations/mask_heads.py:')}, own
    assert sum(own.values()) == BATCH
    # the sampler's syncs (mmdet's), once per image and layer as in mmseg's step
    layers = base.num_transformer_decoder_layers + 1
    assert counts.sync_names()['nonzero'] == baseline.sync_names()['nonzero'] == 2 * BATCH * layers
