"""Results written into storage nothing else reads again: a forward output into its input's, a
backward's input gradient into its incoming gradient."""
import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from mmseg.models.decode_heads.uper_head import UPerHead
from test_uper_head import head_and_inputs
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.layers import chunking, level_fusion
from mmseg_mesa.layers.base import make_quantizer
from mmseg_mesa.layers.ownership import owned_gradients, sole_reference
from mmseg_mesa.quantizer import reset_rounding_generators


@pytest.fixture
def sample_blocks(monkeypatch):
    """Blocks of one sample in the fused bottleneck (as at 512x512), at the tests' sizes."""
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', 1024)


def test_sole_reference_sees_every_other_reader():
    x = torch.randn(2, 3, requires_grad=True)
    held = [x * 2]
    assert sole_reference(held, 0)
    name = held[0]
    assert not sole_reference(held, 0)  # a second Python reference
    del name
    view = held[0][0]
    assert not sole_reference(held, 0)  # a view shares the storage
    del view
    detached = held[0].detach()
    assert not sole_reference(held, 0)  # so does a detached alias
    del detached
    saved_input = held[0].sin()  # autograd saves sin's input
    assert not sole_reference(held, 0)
    del saved_input
    assert sole_reference(held, 0)
    held = [torch.relu(x * 2)]  # autograd saves relu's output
    assert not sole_reference(held, 0)
    assert not sole_reference([x], 0)  # a leaf that requires grad
    assert not sole_reference([None], 0)
    assert sole_reference([torch.randn(3)], 0)


def fusion_case():
    torch.manual_seed(0)
    leaves = [torch.randn(3, c, 32 >> i, 32 >> i, requires_grad=True)
              for i, c in enumerate((16, 8, 8))]
    weight = torch.randn(16, 32, 3, 3, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    upsample = functools.partial(F.interpolate, size=(32, 32), mode='bilinear',
                                 align_corners=False)
    args = ((1, 1), (1, 1), (1, 1), 1)
    spec = level_fusion.FusionSpec(upsample, args, [make_quantizer(MesaConfig(), 1)
                                                    for _ in leaves])
    return leaves, weight, bias, spec


def test_level_fusion_output_overwrites_an_owned_level_0(sample_blocks):
    """Output written into level 0 once each block has read it: torch's conv of the
    concatenation bit for bit, gradients as torch's and as the fusion's without the overwrite."""
    leaves, weight, bias, spec = fusion_case()
    upsample, args = spec.upsample, spec.conv_args
    x = torch.cat([leaves[0] * 1, *(upsample(t) for t in leaves[1:])], dim=1)
    want = F.conv2d(x, weight, bias, *args)
    grad = torch.randn_like(want)
    expected = torch.autograd.grad(want, [*leaves, weight, bias], grad)
    runs = []
    for overwrite in (False, True):
        torch.manual_seed(1)
        reset_rounding_generators()  # the same codes in both runs
        levels = [leaves[0] * 1, *leaves[1:]]
        address = levels[0].data_ptr()
        run = dataclasses.replace(spec, output_into_first=overwrite, quantizers=[
            make_quantizer(MesaConfig(), 1) for _ in levels])
        out = level_fusion.LevelFusionConvFunction.apply(run, weight, bias, *levels)
        assert (out.data_ptr() == address) == overwrite
        assert torch.equal(out, want)
        runs.append(torch.autograd.grad(out, [*leaves, weight, bias], grad))
    plain, overwritten = runs
    for a, b in zip(overwritten, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the levels' and the bias' gradients are torch's up to float order (the weight's reads
    # the codes)
    for i in (0, 1, 2, 4):
        torch.testing.assert_close(overwritten[i], expected[i], rtol=1e-4, atol=1e-4)


def test_level_fusion_keeps_level_0_of_another_layout(sample_blocks):
    """A level 0 whose strides a new output would not have is left alone."""
    leaves, weight, bias, spec = fusion_case()
    levels = [(leaves[0] * 1).contiguous(memory_format=torch.channels_last), *leaves[1:]]
    kept = levels[0].clone()
    run = dataclasses.replace(spec, output_into_first=True)
    out = level_fusion.LevelFusionConvFunction.apply(run, weight, bias, *levels)
    assert out.data_ptr() != levels[0].data_ptr() and torch.equal(levels[0], kept)


def bottleneck_output_address(head):
    """The address of the fused bottleneck conv's output, as its norm receives it."""
    seen = []
    handle = head.fpn_bottleneck.norm.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].data_ptr()))
    return seen, handle


def head_with_norms():
    """UPerHead with BatchNorm in its ConvModules, as Swin-T UPerNet's, and its inputs."""
    _, inputs = head_and_inputs(64)
    torch.manual_seed(0)
    head = UPerHead(in_channels=[8, 16, 32, 64], channels=16, num_classes=5,
                    in_index=[0, 1, 2, 3], pool_scales=(1, 2, 3, 6),
                    norm_cfg=dict(type='BN', requires_grad=True)).train()
    return head, inputs


@pytest.mark.parametrize('keep', [False, True])
def test_fused_bottleneck_overwrites_the_fpn_output_only_where_nobody_keeps_it(sample_blocks,
                                                                               keep):
    """The first FPN output (a Mesa ReLU's, which keeps a bit mask) takes the bottleneck's output;
    where a forward hook keeps it, the bottleneck writes elsewhere and the kept tensor keeps its
    values. Either way the forward is the unconverted head's bit for bit."""
    reference, inputs = head_with_norms()
    head = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig())
    first = []
    fpn = head.fpn_convs[0]
    handle = fpn.register_forward_hook(
        lambda _, __, out: first.append((out, out.clone()) if keep else out.data_ptr()))
    seen, bn_handle = bottleneck_output_address(head)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(1)
    got = head(xs)
    handle.remove()
    bn_handle.remove()
    torch.manual_seed(1)
    want = reference(inputs)
    assert torch.equal(got, want)
    if keep:
        (kept, values), = first
        assert seen != [kept.data_ptr()] and torch.equal(kept, values)
    else:
        assert seen == first
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    for x, y in zip(xs, inputs):
        assert F.cosine_similarity(x.grad.flatten(), y.grad.flatten(), dim=0) > 0.99


class Probe(torch.autograd.Function):
    """Doubles its input; records which gradients its backward was handed as its own."""

    seen = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @owned_gradients
    def backward(ctx, grad):
        Probe.seen.append(ctx.owned_grads[0])
        return grad * 2


def owned_in(run):
    Probe.seen.clear()
    run()
    (owned,) = Probe.seen
    return owned


def test_owned_gradients_sees_every_other_holder():
    x = torch.randn(4, requires_grad=True)
    assert owned_in(lambda: (Probe.apply(x) * 3).sum().backward())  # MulBackward's own
    kept = []

    def keeping():
        y = Probe.apply(x)
        y.register_hook(kept.append)
        (y * 3).sum().backward()

    assert not owned_in(keeping)  # a tensor hook kept it

    def looking():
        y = Probe.apply(x)
        y.register_hook(lambda g: None)
        (y * 3).sum().backward()

    assert owned_in(looking)
    # an addition hands one gradient to both branches; the engine runs the later-made branch
    # first, so the other one reads it afterwards only where it was made first
    assert owned_in(lambda: (Probe.apply(x) + x * 3).mul(5).sum().backward())

    def other_branch_later():
        earlier = x * 3
        (Probe.apply(x) + earlier).mul(5).sum().backward()

    assert not owned_in(other_branch_later)
    given = torch.ones(4)
    assert not owned_in(lambda: Probe.apply(x).backward(given))  # the caller's


def keeping(record):
    """A tensor hook that keeps the gradient and a copy of its values."""
    return lambda g: record.append((g, g.clone()))


def grad_addresses(t, record):
    """Record the address of ``t``'s gradient, keeping no reference to it."""
    t.register_hook(lambda g: record.append(g.data_ptr()))


@pytest.mark.parametrize('keep', [False, True])
def test_relu_backward_writes_into_an_owned_gradient(keep):
    torch.manual_seed(0)
    leaf = torch.randn(2, 3, 4, 4, requires_grad=True)
    relu = nn.ModuleList([nn.ReLU(inplace=True)])
    convert_to_mesa(relu, config=MesaConfig())
    x = leaf * 1
    into, out_of, kept = [], [], []
    grad_addresses(x, out_of)
    y = relu[0](x)
    if keep:
        y.register_hook(keeping(kept))
    else:
        grad_addresses(y, into)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    want = torch.where(leaf > 0, upstream, 0)
    assert torch.equal(leaf.grad, want)
    if keep:
        (g, values), = kept
        assert out_of != [g.data_ptr()] and torch.equal(g, values)
    else:
        assert into == out_of


@pytest.fixture
def chunked_batch_norm(monkeypatch):
    """BatchNorm backward by chunks of one sample and off torch's fused kernels, at test sizes."""
    from mmseg_mesa.layers import norm_backward
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', 4096)
    monkeypatch.setattr(norm_backward, 'FUSED_BACKWARD_BYTES', 1024)


def test_batch_norm_backward_writes_into_an_owned_gradient(chunked_batch_norm):
    """BatchNorm then an in-place ReLU (a ConvModule's norm and act): the ReLU's gradient is
    BatchNorm's own, which writes its input gradient into it: the gradients of the whole-tensor
    backward up to float order, torch's up to the codes' error. A hook that keeps the gradient
    keeps its values."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(inplace=True)).train()
    model = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([model]), config=MesaConfig())
    x0 = torch.randn(4, 8, 16, 16) * 3 + 1
    upstream = torch.randn(4, 8, 16, 16)
    runs = []
    for owned in (True, False):
        leaf = x0.clone().requires_grad_()
        x = leaf * 1
        into, out_of, kept = [], [], []
        grad_addresses(x, out_of)
        y = model[0](x)
        if owned:
            grad_addresses(y, into)
        else:
            y.register_hook(keeping(kept))
        (model[1](y) * upstream).sum().backward()
        if owned:
            assert into == out_of
        else:
            (g, values), = kept
            assert out_of != [g.data_ptr()] and torch.equal(g, values)
        runs.append([leaf.grad, *(p.grad.clone() for p in model.parameters())])
        model.zero_grad()
    leaf = x0.clone().requires_grad_()
    (reference(leaf) * upstream).sum().backward()
    exact = [leaf.grad, *(p.grad for p in reference.parameters())]
    for owned, whole, want in zip(*runs, exact):
        torch.testing.assert_close(owned, whole, rtol=1e-5, atol=1e-5)
        assert F.cosine_similarity(owned.flatten(), want.flatten(), dim=0) > 0.999


@pytest.mark.parametrize('keep', [False, True])
def test_feature_dropout_is_torchs_and_writes_into_an_owned_gradient(keep):
    """``FeatureDropoutFunction``: ``F.dropout2d``'s output and gradient bit for bit; the input
    gradient overwrites the incoming one unless a hook keeps that."""
    from mmseg_mesa.layers.dropout import FeatureDropoutFunction
    leaf = torch.randn(3, 5, 6, 6, requires_grad=True)
    upstream = torch.randn(3, 5, 6, 6)
    torch.manual_seed(2)
    want = F.dropout2d(leaf * 1, 0.3, training=True)
    (want * upstream).sum().backward()
    expected, leaf.grad = leaf.grad, None
    x = leaf * 1
    into, out_of, kept = [], [], []
    grad_addresses(x, out_of)
    torch.manual_seed(2)
    got = FeatureDropoutFunction.apply(x, 0.3)
    assert torch.equal(got, want)
    got.register_hook(keeping(kept) if keep else lambda g: into.append(g.data_ptr()))
    (got * upstream).sum().backward()
    assert torch.equal(leaf.grad, expected)
    if keep:
        (g, values), = kept
        assert out_of != [g.data_ptr()] and torch.equal(g, values)
    else:
        assert into == out_of


@pytest.mark.parametrize('shared', [False, True])
def test_classifier_dropout_writes_into_features_nothing_else_holds(shared):
    """``classified``: the head's ``Dropout2d`` multiplies the features in their own storage when
    the holder was their only reference (torch's output and gradient bit for bit), and into a
    new tensor when something else still reads them."""
    from torch import nn

    from mmseg_mesa.integrations.fusion import classified
    head = nn.Module()
    head.dropout, head.conv_seg = nn.Dropout2d(0.3), nn.Conv2d(5, 2, 1)
    leaf = torch.randn(3, 5, 6, 6, requires_grad=True)
    torch.manual_seed(2)
    want = head.conv_seg(F.dropout2d(leaf * 1, 0.3, training=True))
    want.sum().backward()
    expected, leaf.grad = leaf.grad, None
    features = [leaf * 1]
    storage = features[0].data_ptr()
    keep = features[0] if shared else None
    written = []
    hook = head.conv_seg.register_forward_pre_hook(lambda m, args: written.append(
        args[0].data_ptr() == storage) and None)
    torch.manual_seed(2)
    got = classified(head, features)
    hook.remove()
    assert torch.equal(got, want) and written == [not shared]
    got.sum().backward()
    assert torch.equal(leaf.grad, expected)
    if shared:
        assert torch.equal(keep, leaf * 1)  # untouched
