"""UPerHead's lean FPN fusion (``MesaUPerHead``): same forward and gradients, a lower peak."""
import copy

import pytest
import torch
from mmseg.models.decode_heads.uper_head import UPerHead
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.handoff import CODES
from mmseg_mesa.integrations.modules import MesaDecodeHead
from mmseg_mesa.integrations.uper_head import MesaUPerHead, concat_channels
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
    assert saved >= 3.3 * piece, saved / piece  # measured 3.7 (2.8 while the first piece
    # stayed alive to the end of the concatenation)


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
    """With conv2d converted, the bottleneck conv saves the codes of each FPN output before its
    upsampling (FusedCodes): they decode to within one rounding step of its input, cost a
    third of its own codes, and the gradients stay as close to the exact ones."""
    from mmseg_mesa.memory import count_saved_tensors
    from mmseg_mesa.reference import channel_view

    exact, inputs = head_and_inputs(64)
    fused = copy.deepcopy(exact)
    convert_to_mesa(nn.ModuleList([fused]), config=MesaConfig())
    own = copy.deepcopy(fused)
    own.mesa_fused_quantizers = None  # the bottleneck conv packs its input itself
    seen = []
    fused.fpn_bottleneck.conv.register_forward_pre_hook(
        lambda module, args: seen.append((args[0].detach().clone(), CODES.get(args[0])[0])))

    def step(head):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        torch.manual_seed(1)
        with count_saved_tensors(head.fpn_bottleneck) as report:
            out = head(xs).square().sum()
        out.backward()
        return report.total_bytes, [p.grad for p in head.parameters()]

    fused_bytes, fused_grads = step(fused)
    own_bytes, own_grads = step(own)
    _, exact_grads = step(exact)
    buffer, codes = seen[0]
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


def test_bottleneck_input_gradient_is_formed_a_level_at_a_time(monkeypatch):
    """The bottleneck conv hands its input gradient to the FPN levels one channel slice at a
    time: the same gradients (up to the order of float sums) from the same codes, and the whole
    concatenated input gradient never exists in backward."""
    import mmseg_mesa.integrations.uper_head as uper_head
    from mmseg_mesa.quantizer import reset_rounding_generators
    size = 128
    reference, inputs = head_and_inputs(size)
    convert_to_mesa(nn.ModuleList([reference]), config=MesaConfig())
    runs = {}
    for levelwise in (True, False):
        if not levelwise:
            monkeypatch.setattr(uper_head, 'LevelGradients', lambda slices: None)
        head = copy.deepcopy(reference)
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        torch.manual_seed(1)
        reset_rounding_generators()  # the same codes in both
        head(xs).square().sum().backward()
        runs[levelwise] = [x.grad for x in xs] + [p.grad for p in head.parameters()]
        torch.manual_seed(1)
        reset_rounding_generators()
        runs[levelwise, 'peak'] = backward_peak(copy.deepcopy(reference), xs)
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    piece = 2 * CHANNELS * size * size * 4  # one full-resolution FPN output, fp32
    saved = runs[False, 'peak'] - runs[True, 'peak']
    assert saved >= 2.5 * piece, saved / piece
