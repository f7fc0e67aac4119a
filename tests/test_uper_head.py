"""UPerHead's lean FPN fusion (``MesaUPerHead``): same forward and gradients, a lower peak."""
import copy
import dataclasses
import functools

import pytest
import torch
from mmseg.models.decode_heads.uper_head import UPerHead
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.integrations.modules import MesaDecodeHead
from mmseg_mesa.integrations.uper_head import MesaUPerHead, concat_channels
from mmseg_mesa.layers import chunking, level_fusion
from mmseg_mesa.registry import handler_for_type

CHANNELS, SIZE = 16, 32


def head_and_inputs(size=SIZE):
    torch.manual_seed(0)
    head = UPerHead(in_channels=[8, 16, 32, 64], channels=CHANNELS, num_classes=5,
                    in_index=[0, 1, 2, 3], pool_scales=(1, 2, 3, 6)).train()
    inputs = [torch.randn(2, c, size >> i, size >> i, requires_grad=True)
              for i, c in enumerate([8, 16, 32, 64])]
    return head, inputs


def only_the_head(head):
    """Convert only decode heads: every other module stays torch's, so the two heads must give
    the same numbers bit for bit."""
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig(layers=['loss']))
    assert isinstance(head, MesaUPerHead)
    return head


def test_forward_and_gradients_are_unchanged():
    reference, inputs = head_and_inputs()
    head = only_the_head(copy.deepcopy(reference))
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(1)  # the same Dropout2d mask in both
    got = head(inputs)
    torch.manual_seed(1)
    want = reference(ref_inputs)
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    for x, y in zip(inputs, ref_inputs):
        assert torch.equal(x.grad, y.grad)
    for (name, p), q in zip(head.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    head.eval()  # eval and no-grad forwards take mmseg's own path
    reference.eval()
    with torch.no_grad():
        assert torch.equal(head(inputs), reference(inputs))


def forward_peak(head, inputs):
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(head, *inputs)
    with tracker:
        out = head(inputs)
    del out
    return tracker.get_tracker_snapshot('peak')[inputs[0].device]['Total']


def test_fusion_never_holds_the_upsampled_outputs_twice():
    """With every layer compressed, what UPerHead's fusion holds is the forward's peak: the list
    of upsampled FPN outputs next to their concatenation, and the laterals."""
    size = 128  # large enough that the quantizer's minimum piece does not decide the peak
    reference, inputs = head_and_inputs(size)
    head = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig())
    without = MesaConfig(layers=[t for t in MesaConfig().layers if t != 'loss'])
    convert_to_mesa(nn.ModuleList([reference]), config=without)
    assert isinstance(head, MesaUPerHead) and not isinstance(reference, MesaDecodeHead)
    piece = 2 * CHANNELS * size * size * 4  # one full-resolution FPN output, fp32
    saved = forward_peak(reference, inputs) - forward_peak(head, inputs)
    # measured 3.0 (the whole batch in one block: the FPN outputs stay alive as the fused
    # conv's inputs; 3.7 when each was freed once written, 2.8 before that)
    assert saved >= 2.9 * piece, saved / piece


def test_concat_channels_is_torch_cat():
    """Mixed dtypes and widths: the buffer is ``torch.cat``'s result, gradients its slices."""
    pieces = [torch.randn(2, 3, 4, 4, requires_grad=True),
              torch.randn(2, 5, 2, 2, dtype=torch.float16).requires_grad_(),
              torch.randn(2, 1, 1, 1, dtype=torch.float64).requires_grad_()]
    def up(t):
        return t.repeat_interleave(4 // t.shape[2], 2).repeat_interleave(4 // t.shape[3], 3)

    want = torch.cat([pieces[0], *(up(p) for p in pieces[1:])], dim=1)
    got = concat_channels(list(pieces), up)
    assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
    grad = torch.randn_like(want)
    expected = torch.autograd.grad(want, pieces, grad)
    actual = torch.autograd.grad(got, pieces, grad)
    for a, b in zip(actual, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


class OwnFusionHead(UPerHead):
    def _forward_feature(self, inputs):
        return super()._forward_feature(inputs) * 2


def test_a_subclass_with_its_own_fusion_keeps_it_and_the_banded_loss():
    handler, reason = handler_for_type(OwnFusionHead)
    assert reason is None and handler.replaces == ('loss_by_feat',)  # BaseDecodeHead's
    torch.manual_seed(0)
    head = OwnFusionHead(in_channels=[8, 16], channels=8, num_classes=3, in_index=[0, 1],
                         pool_scales=(1, 2)).train()
    reference = copy.deepcopy(head)
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig(layers=['loss']))
    assert isinstance(head, MesaDecodeHead) and not isinstance(head, MesaUPerHead)
    inputs = [torch.randn(2, 8, 8, 8, requires_grad=True), torch.randn(2, 16, 4, 4)]
    torch.manual_seed(1)
    got = head(inputs)
    torch.manual_seed(1)
    assert torch.equal(got, reference(inputs))


@pytest.mark.parametrize('layers', [['loss'], ['conv2d', 'batchnorm', 'relu']])
def test_uperhead_is_converted_only_with_the_loss(layers):
    head, _ = head_and_inputs()
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig(layers=layers))
    assert isinstance(head, MesaUPerHead) == ('loss' in layers)


def test_bottleneck_saves_its_input_as_the_fpn_outputs_codes():
    """With conv2d converted, the bottleneck saves the codes of each FPN output before its
    upsampling (FusedCodes): they decode to within one rounding step of its input, cost a
    third of its own codes, and the gradients stay as close to the exact ones."""
    from mmseg_mesa.memory import count_saved_tensors
    from mmseg_mesa.reference import channel_view

    exact, inputs = head_and_inputs(64)
    fused = copy.deepcopy(exact)
    convert_to_mesa(nn.ModuleList([fused]), config=MesaConfig())
    own = copy.deepcopy(fused)
    own.mesa_fused_quantizers = None  # the bottleneck conv packs its whole input itself
    seen = []
    own.fpn_bottleneck.conv.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].detach().clone()))
    codes = []
    real_save = level_fusion.save
    def spy(ctx, *items, **kwargs):
        codes.extend(item for item in items if isinstance(item, level_fusion.FusedCodes))
        return real_save(ctx, *items, **kwargs)

    def step(head):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        torch.manual_seed(1)
        with count_saved_tensors(head) as report:
            out = head(xs).square().sum()
        out.backward()
        return report.total_bytes, [p.grad for p in head.parameters()]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(level_fusion, 'save', spy)
        fused_bytes, fused_grads = step(fused)
    own_bytes, own_grads = step(own)
    _, exact_grads = step(exact)
    buffer, (codes,) = seen[0], codes
    step_size = torch.cat([channel_view(part.scale, part.shape[1], 1, 1, 4) for part
                           in codes.parts], dim=1)
    decoded = codes.restore(torch.float32)
    assert ((decoded - buffer).abs() <= step_size * 1.0001).all()
    assert torch.equal(codes.sample_range(1, 2).restore(torch.float32), decoded[1:2])
    full = buffer.numel()  # one byte per value of the bottleneck input
    assert own_bytes - fused_bytes >= 0.6 * full, (own_bytes - fused_bytes) / full
    def error(grads):
        return sum((g - e).square().sum() for g, e in zip(grads, exact_grads)).sqrt()

    assert error(fused_grads) <= 1.5 * error(own_grads)


def test_releasing_input_frees_the_input_once_the_conv_has_run():
    """``releasing_input`` runs a plain ConvModule's steps with no reference to its input left
    after the conv (a module call would hold it to the end); anything else is called as is."""
    import weakref

    from mmcv.cnn import ConvModule

    from mmseg_mesa.integrations.uper_head import releasing_input
    torch.manual_seed(0)
    module = ConvModule(4, 6, 3, padding=1, norm_cfg=dict(type='BN')).train()
    x = torch.randn(2, 4, 8, 8)
    want = module(x.clone())
    for hooked in (False, True):
        if hooked:
            module.register_forward_hook(lambda *args: None)
        alive = []
        probe = weakref.ref(x)
        handle = module.norm.register_forward_pre_hook(
            lambda m, args, alive=alive, probe=probe: alive.append(probe() is not None))
        with torch.no_grad():  # nothing is saved for backward: only references keep x
            holder = [x]
            del x
            got = releasing_input(module, holder)
        handle.remove()
        assert alive == [hooked] and torch.allclose(got, want, atol=1e-6)
        x = torch.randn(2, 4, 8, 8)
        want = module(x.clone())


def backward_peak(head, inputs):
    """The peak of what the head's backward allocates (its temporaries and gradients)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    out = head(inputs)
    tracker = MemTracker()
    with tracker:
        out.square().sum().backward()
    return tracker.get_tracker_snapshot('peak')[inputs[0].device]['Total']


@pytest.fixture
def sample_blocks(monkeypatch):
    """Blocks of one sample in the fused bottleneck (as at 512x512), at the tests' sizes."""
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', 1024)


def test_fused_bottleneck_is_bit_identical_a_sample_at_a_time(sample_blocks):
    """Every layer converted and the bottleneck built and convolved one sample at a time: the
    forward is the unconverted head's bit for bit, the gradients within the codes' error."""
    reference, inputs = head_and_inputs(64)
    head = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig())
    calls = []
    concatenated = level_fusion.concatenated
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(level_fusion, 'concatenated',
                      lambda *args: calls.append(args[2]) or concatenated(*args))
        got = head(xs)
    torch.manual_seed(1)
    want = reference(inputs)
    assert calls == [slice(0, 1), slice(1, 2)]  # the bottleneck, one sample at a time
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    for x, y in zip(xs, inputs):
        assert torch.nn.functional.cosine_similarity(x.grad.flatten(), y.grad.flatten(),
                                                     dim=0) > 0.99


def test_level_fusion_gradients_are_the_convs(sample_blocks):
    """``LevelFusionConvFunction`` against ``conv(cat(...))``: output bit for bit (fp32 and bf16
    autocast), level and bias gradients up to float order, the weight gradient exactly what the
    conv gives for the decoded codes."""
    from mmseg_mesa.layers.base import make_quantizer
    torch.manual_seed(0)
    levels = [torch.randn(3, c, 32 >> i, 32 >> i, requires_grad=True)
              for i, c in enumerate((16, 8, 8))]
    weight = torch.randn(5, 32, 3, 3, requires_grad=True)
    bias = torch.randn(5, requires_grad=True)
    upsample = functools.partial(torch.nn.functional.interpolate, size=(32, 32),
                                 mode='bilinear', align_corners=False)
    args = ((1, 1), (1, 1), (1, 1), 1)
    quantizers = [make_quantizer(MesaConfig(), 1) for _ in levels]
    spec = level_fusion.FusionSpec(upsample, args, quantizers)
    shape, _, blocks = level_fusion.fusion_blocks(levels, weight, args)
    assert len(blocks) == 3  # a sample at a time: torch convolves one as it does three
    for autocast in (True, False):
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            x = torch.cat([levels[0], *(upsample(t) for t in levels[1:])], dim=1)
            want = torch.nn.functional.conv2d(x, weight, bias, *args)
            got = level_fusion.LevelFusionConvFunction.apply(spec, weight, bias, *levels)
        assert got.dtype == want.dtype and torch.equal(got, want)
    grad = torch.randn_like(got)
    expected = torch.autograd.grad(want, [*levels, bias], grad)
    codes = []
    real_save = level_fusion.save
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(level_fusion, 'save', lambda ctx, *items: (
            codes.extend(items[:1]), real_save(ctx, *items))[1])
        got = level_fusion.LevelFusionConvFunction.apply(spec, weight, bias, *levels)
    actual = torch.autograd.grad(got, [*levels, bias, weight], grad)
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    weight_grad = torch.nn.grad.conv2d_weight(codes[0].restore(torch.float32), weight.shape,
                                              grad, *args)
    torch.testing.assert_close(actual[-1], weight_grad, rtol=1e-5, atol=1e-4)
    # Owning the output's gradient (as many channels as level 0), level 0's gradient is written
    # into it: the same values, no new tensor
    square = torch.randn(16, 32, 3, 3)
    owning = dataclasses.replace(spec, owns_output_grad=True)
    runs = []
    for run_spec in (spec, owning):
        out = level_fusion.LevelFusionConvFunction.apply(run_spec, square, None, *levels)
        given = torch.ones_like(out)
        runs.append((given, torch.autograd.grad(out, levels, given)))
    (_, plain), (given, owned) = runs
    assert owned[0].data_ptr() == given.data_ptr() != plain[0].data_ptr()
    for a, b in zip(owned, plain):
        assert torch.equal(a, b)


def test_level_fusion_keeps_the_batch_whole_where_torch_would_convolve_a_sample_otherwise(
        sample_blocks):
    """A single sample of a small map runs another CPU kernel than a batch (``slow_conv2d``
    against oneDNN), with other float sums: then the batch is not split, and the output stays
    bit-identical."""
    torch.manual_seed(0)
    levels = [torch.randn(3, 4, 16, 16), torch.randn(3, 8, 8, 8)]
    weight = torch.randn(5, 12, 3, 3)
    args = ((1, 1), (1, 1), (1, 1), 1)
    _, _, blocks = level_fusion.fusion_blocks(levels, weight, args)
    assert blocks == [slice(None)]
    sample = torch.nn.functional.conv2d(levels[0][:1].repeat(1, 3, 1, 1), weight, None, *args)
    batch = torch.nn.functional.conv2d(levels[0].repeat(1, 3, 1, 1), weight, None, *args)
    assert not torch.equal(sample, batch[:1])  # what splitting would have changed


def test_fused_bottleneck_holds_one_sample_of_the_concatenation():
    """The forward's peak grows by less than the concatenation per image: with blocks of one
    sample, four images cost less above two than two concatenations."""
    size = 128
    reference, inputs = head_and_inputs(size)
    head = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([head]), config=MesaConfig())
    whole = copy.deepcopy(head)
    whole.mesa_fused_quantizers = None  # the whole-batch buffer (concat_channels)
    concat = 4 * CHANNELS * size * size * 4  # one image's concatenation, fp32
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunking, 'DECODE_CHUNK_BYTES', concat)
        fused, plain = (
            forward_peak(h, [x.repeat(2, 1, 1, 1).detach().requires_grad_() for x in inputs])
            - forward_peak(h, inputs) for h in (head, whole))
    assert plain - fused >= 1.5 * concat, (plain - fused) / concat




@pytest.mark.slow
def test_level_fusion_at_swin_t_uperhead_widths_is_bit_identical(sample_blocks):
    """Swin-T UPerNet's bottleneck (four 512-channel levels into a 3x3 conv to 512) one sample
    at a time gives the batched conv's bits (at 32x32 instead of 128x128: the same kernels)."""
    from mmseg_mesa.layers.base import make_quantizer
    torch.manual_seed(0)
    levels = [torch.randn(2, 512, 32 >> i, 32 >> i) for i in range(4)]
    weight = torch.randn(512, 2048, 3, 3) * 0.01
    upsample = functools.partial(torch.nn.functional.interpolate, size=(32, 32),
                                 mode='bilinear', align_corners=False)
    args = ((1, 1), (1, 1), (1, 1), 1)
    spec = level_fusion.FusionSpec(upsample, args, [make_quantizer(MesaConfig(), 1)] * 4)
    assert len(level_fusion.fusion_blocks(levels, weight, args)[2]) == 2
    want = torch.nn.functional.conv2d(
        torch.cat([levels[0], *(upsample(t) for t in levels[1:])], dim=1), weight, None, *args)
    assert torch.equal(level_fusion.LevelFusionConvFunction.apply(spec, weight, None, *levels),
                       want)


def _top_down(batch=3, dtype=torch.float32, coarse_dtype=None):
    torch.manual_seed(0)
    fine = torch.randn(batch, 4, 16, 16, dtype=dtype, requires_grad=True)
    coarse = torch.randn(batch, 4, 8, 8, dtype=coarse_dtype or dtype, requires_grad=True)
    upsample = functools.partial(torch.nn.functional.interpolate, size=(16, 16), mode='bilinear',
                                 align_corners=False)
    return fine, coarse, upsample


def test_upsample_add_writes_into_the_finer_level_bit_identically(sample_blocks):
    """A block of one sample at a time, into the finer level's storage: torch's sum bit for bit,
    torch's gradients exactly (the sum's passes on, the coarse level's is the upsampling's)."""
    from mmseg_mesa.layers import upsample_add as module
    fine, coarse, upsample = _top_down()
    want = fine * 1 + upsample(coarse)
    levels = [fine * 1]  # a non-leaf only the list holds
    storage = levels[0].data_ptr()
    blocks = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, 'sample_slices',
                      lambda *a: blocks.extend(chunking.sample_slices(*a)) or blocks)
        got = module.upsample_add(levels, 0, coarse, upsample)
    assert blocks == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert levels == [None] and got.data_ptr() == storage
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    (want_fine, want_coarse) = torch.autograd.grad(want, (fine, coarse), grad)
    (got_fine, got_coarse) = torch.autograd.grad(got, (fine, coarse), grad)
    assert torch.equal(got_fine, want_fine) and torch.equal(got_coarse, want_coarse)


@pytest.mark.parametrize('case', ['shared', 'leaf', 'promoted'])
def test_upsample_add_stays_out_of_place_where_in_place_could_differ(case):
    """Another holder of the finer level, a leaf, or an upsampled level of another dtype (the
    sum promotes): torch's out-of-place sum, the finer level untouched."""
    from mmseg_mesa.layers.upsample_add import upsample_add
    fine, coarse, upsample = _top_down(coarse_dtype=torch.float64 if case == 'promoted' else None)
    levels = [fine if case == 'leaf' else fine * 1]
    keep = levels[0] if case == 'shared' else None
    before = levels[0].detach().clone()
    got = upsample_add(levels, 0, coarse, upsample)
    assert torch.equal(levels[0].detach(), before) and got.data_ptr() != levels[0].data_ptr()
    assert got.dtype == torch.promote_types(fine.dtype, coarse.dtype)
    assert torch.equal(got, levels[0] + upsample(coarse))
    del keep


def test_upsample_add_holds_one_block_of_the_upsampled_level(sample_blocks):
    """Out of place the step holds the upsampled level and the sum beside the finer level; in
    place, one sample of the upsampled level."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from mmseg_mesa.layers.upsample_add import upsample_add
    fine, coarse, upsample = _top_down(batch=4)
    level_bytes = fine.numel() * fine.element_size()

    def growth(step):
        levels = [fine.detach() * 1]
        tracker = MemTracker()
        tracker.track_external(coarse, *levels)
        with tracker:
            start = tracker.get_tracker_snapshot('current')[fine.device]['Total']
            out = step(levels)
            del out
        return tracker.get_tracker_snapshot('peak')[fine.device]['Total'] - start

    plain = growth(lambda levels: levels[0] + upsample(coarse))
    lean = growth(lambda levels: upsample_add(levels, 0, coarse, upsample))
    assert plain >= 2 * level_bytes
    assert lean <= level_bytes / 4 + 4096, lean / level_bytes
