"""Every Mesa layer against the torch layer it replaces.

SQNR floors: 8-bit codes over a channel's full range give ~40 dB on the saved activation for
Gaussian data (step = range/255, error <= one step with stochastic rounding). Measured here on the
first step: 39.9-59 dB (fp32 and bf16; bf16 gradients are compared with torch's own bf16
gradients); over 5 steps with running estimates: >= 37.7 dB. The floor is 35 dB for both; peaked
attention maps (logits with std 3) lose their smallest probabilities to the 8-bit step and measure
29.3-29.8 dB, so their floor is 27 dB (see SETTLE_CASES).
"""
import copy

import pytest
import torch
from conftest import cosine, drawn, sqnr_db
from layer_cases import (
    CASES,
    backward_both,
    check_autocast,
    check_disabled_and_eval,
    check_forward_is_bit_identical,
    clones,
    grad_pairs,
    pair,
    run,
    saved_bytes,
)
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.layers import MesaLayerNorm, MesaLinear, MesaReLU

FIRST_STEP_SQNR_DB = 35.0
SETTLED_SQNR_DB = 35.0
IDS = [c.name for c in CASES]


@pytest.mark.parametrize('case', CASES, ids=IDS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('train', [True, False])
def test_forward_is_bit_identical(case, dtype, train):
    check_forward_is_bit_identical(case, dtype, train)


@pytest.mark.parametrize('case', CASES, ids=IDS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gradients_match(case, dtype):
    ref, ours = pair(case, dtype)
    xs = case.inputs(dtype)
    xs2 = clones(xs)
    y, y2 = run(ref, xs), run(ours, xs2)
    backward_both(y, y2)
    for expected, got in grad_pairs(ref, ours, xs, xs2):
        assert got is not None and got.dtype == expected.dtype and got.shape == expected.shape
        if case.exact_grad:
            assert torch.equal(expected, got)
        else:
            assert cosine(expected, got) >= 0.999
            assert sqnr_db(expected, got) >= FIRST_STEP_SQNR_DB


# (name, module, inputs, floor): six steps through the same module, so running estimates move.
SETTLE_CASES = [
    ('linear', lambda: nn.Linear(96, 384), lambda: [torch.randn(4, 49, 96)], SETTLED_SQNR_DB),
    ('layernorm', lambda: nn.LayerNorm(96), lambda: [torch.randn(4, 49, 96) * 2 + 1],
     SETTLED_SQNR_DB),
    ('softmax', lambda: nn.Softmax(-1), lambda: [torch.randn(4, 3, 49, 49) * 3], 27.0),
    ('gelu', lambda: nn.GELU(), lambda: [torch.randn(4, 49, 384)], SETTLED_SQNR_DB),
]


@pytest.mark.parametrize('name, make, inputs, floor', SETTLE_CASES,
                         ids=[c[0] for c in SETTLE_CASES])
def test_gradients_after_running_estimates_settle(name, make, inputs, floor):
    case = next(c for c in CASES if c.name == name)
    ref = make()
    ours = case.mesa(copy.deepcopy(ref), MesaConfig())
    for step in range(6):
        xs = [x.requires_grad_() for x in inputs()]
        xs2 = clones(xs)
        y, y2 = run(ref, xs, step), run(ours, xs2, step)
        backward_both(y, y2)
        for expected, got in grad_pairs(ref, ours, xs, xs2):
            assert sqnr_db(expected, got) >= floor, step
        ref.zero_grad()
        ours.zero_grad()


@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_saved_bytes_ratio(case):
    ref, ours = pair(case)
    xs = case.inputs(big=True)
    baseline, _ = saved_bytes(ref, xs)
    mesa, _ = saved_bytes(ours, clones(xs))
    assert baseline > 0
    limit = 0.05 if case.exact_grad else 0.27
    assert mesa <= limit * baseline, (mesa, baseline)


@pytest.mark.parametrize('bits, limit', [(4, 0.145), (2, 0.085)])
def test_sub_byte_saved_bytes(bits, limit):
    ref = nn.Linear(128, 64)
    ours = MesaLinear.convert(copy.deepcopy(ref), MesaConfig(bits=bits))
    x = torch.randn(16, 49, 128, requires_grad=True)
    baseline, _ = saved_bytes(ref, [x])
    mesa, y = saved_bytes(ours, [x])
    assert mesa <= limit * baseline
    y.sum().backward()
    assert torch.isfinite(ours.weight.grad).all()


@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_disabled_and_eval_run_the_torch_path(case):
    check_disabled_and_eval(case)


@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_autocast(case):
    check_autocast(case)


def test_inplace_relu_modifies_its_input():
    ours = MesaReLU.convert(nn.ReLU(inplace=True), MesaConfig())
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    y = ours(h)
    assert y is h and (h >= 0).all()
    y.sum().backward()
    assert torch.equal(x.grad, (x > 0).float())


def test_batchnorm_updates_running_statistics_and_checks_its_input_as_torch_does():
    """Mesa's batch norm takes its moments from torch's own kernel where it can (CPU): the
    output, the running statistics and the error for one value per channel stay torch's."""
    from mmseg_mesa.layers import MesaBatchNorm2d
    ref = nn.BatchNorm2d(16, momentum=None)
    ours = MesaBatchNorm2d.convert(copy.deepcopy(ref), MesaConfig())
    for _ in range(3):
        x = torch.randn(4, 16, 9, 9).to(memory_format=torch.channels_last).requires_grad_()
        y, y2 = ref(x), ours(x)
        assert torch.equal(y, y2)
        y2.sum().backward()
    for name in ('running_mean', 'running_var', 'num_batches_tracked'):
        assert torch.equal(getattr(ref, name), getattr(ours, name)), name
    one = torch.randn(1, 16, 1, 1, requires_grad=True)
    with pytest.raises(ValueError) as expected:
        ref(one)
    with pytest.raises(ValueError) as got:
        ours(one)
    assert str(got.value) == str(expected.value)


def small_and_large_backward(monkeypatch, layer, x, grad, owner, sequential_step):
    """The gradients of ``layer`` (input, then parameters) with the fused backward of small
    tensors and with the in-place, chunked one, from the same codes and rounding draws; each
    run checks which path it took by counting the calls of ``owner.sequential_step``, a
    function only the in-place path calls."""
    import mmseg_mesa.layers.formulas as formulas
    import mmseg_mesa.layers.norm_backward as norm_backward
    from mmseg_mesa.quantizer import reset_rounding_generators
    step = getattr(owner, sequential_step)
    calls = []
    monkeypatch.setattr(owner, sequential_step,
                        lambda *args, **kwargs: calls.append(1) or step(*args, **kwargs))
    results = []
    for limit, expected_calls in ((1 << 40, 0), (0, 1)):
        for module in (formulas, norm_backward):
            monkeypatch.setattr(module, 'FUSED_BACKWARD_BYTES', limit)
        ours = copy.deepcopy(layer)  # the same running estimates
        reset_rounding_generators()
        inp = x.detach().clone().requires_grad_(x.requires_grad)
        calls.clear()
        ours(inp).backward(grad)
        assert len(calls) == expected_calls, (limit, len(calls))
        results.append([inp.grad] + [p.grad for p in ours.parameters()])
    return results


@pytest.mark.parametrize('kwargs', [dict(kernel_size=3, padding=1),
                                    dict(kernel_size=3, padding=2, dilation=2, stride=2, groups=4),
                                    dict(kernel_size=1, bias=False)])
@pytest.mark.parametrize('input_grad', [True, False])
def test_small_conv_backward_in_one_call_matches_the_sequential_one(monkeypatch, kwargs,
                                                                    input_grad):
    """Below ``FUSED_BACKWARD_BYTES`` a convolution's three gradients come from one
    ``convolution_backward`` call (it shares work between them: 10-35% faster at the demo's
    sizes); above it the weight gradient comes first and frees the decoded input. Both give
    the same gradients from the same codes (the bias gradient up to summation order)."""
    from mmseg_mesa.layers.conv import MesaConv2d
    torch.manual_seed(0)
    layer = MesaConv2d(8, 8, mesa_config=MesaConfig(), **kwargs)
    x = torch.randn(3, 8, 9, 9, requires_grad=input_grad)
    grad = torch.randn_like(layer(x))
    fused, sequential = small_and_large_backward(monkeypatch, layer, x, grad, torch.nn.grad,
                                                 'conv2d_weight')
    assert len(fused) == len(sequential) == 2 + (kwargs.get('bias', True))
    for a, b in zip(fused, sequential):
        if b is None:
            assert a is None
        else:
            assert a is not None and (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize('affine', [True, False])
def test_small_batchnorm_backward_through_torch_kernels_matches_the_in_place_one(monkeypatch,
                                                                                 affine):
    """Below ``FUSED_BACKWARD_BYTES`` batch norm's backward re-standardizes the decoded input
    and forms the gradients with torch's fused batch-norm kernels; above it with in-place
    formulas by chunks of samples. The same gradients to float rounding, and the input gradient
    stays orthogonal to per-channel constants either way."""
    from mmseg_mesa.layers import MesaBatchNorm2d
    torch.manual_seed(0)
    layer = MesaBatchNorm2d(16, affine=affine, mesa_config=MesaConfig()).train()
    if affine:
        nn.init.uniform_(layer.weight, 0.5, 1.5)
    x = torch.randn(4, 16, 6, 6) * torch.logspace(-3, 1, 16).view(1, -1, 1, 1) + 2.0
    x.requires_grad_()
    grad = torch.randn(4, 16, 6, 6)
    import mmseg_mesa.layers.norm_backward as norm_backward
    fused, in_place = small_and_large_backward(monkeypatch, layer, x, grad, norm_backward,
                                               'channel_input_grad')
    for a, b in zip(fused, in_place):
        assert (a - b).norm() <= 1e-5 * b.norm()
    scale = fused[0].abs().amax((0, 2, 3))
    assert (fused[0].sum((0, 2, 3)).abs() <= 1e-4 * scale * x[0].numel()).all()
    want = torch.autograd.grad(torch.nn.functional.batch_norm(
        x, None, None, layer.weight, layer.bias, True, 0.0, layer.eps), x, grad)[0]
    assert cosine(fused[0], want) > 0.999


@pytest.mark.parametrize('bits', [8, 4])
def test_layernorm_gradients_hold_for_tokens_of_any_spread(bits):
    """ViT's class token and position embeddings start at zero or std 0.02: tokens whose spread
    is tiny next to their channels' ranges. Every token's input gradient must hold, whatever its
    spread, including a constant token (normalized input exactly 0)."""
    ref = nn.LayerNorm(64)
    ours = MesaLayerNorm.convert(copy.deepcopy(ref), MesaConfig(bits=bits))
    spread = torch.logspace(-4, 1, 31).view(1, 31, 1)
    x = torch.cat([torch.full((2, 1, 64), 0.3), torch.randn(2, 31, 64) * spread
                   + torch.randn(2, 31, 1)], dim=1).requires_grad_()
    x2 = clones([x])[0]
    y, y2 = ref(x), ours(x2)
    assert torch.equal(y, y2)
    backward_both(y, y2)
    floor = 0.999 if bits == 8 else 0.99
    for token in range(1, 32):
        assert cosine(x.grad[:, token], x2.grad[:, token]) >= floor, token
    # a constant token's gradient is rstd * (the centred upstream gradient), exactly as torch's
    assert cosine(x.grad[:, 0], x2.grad[:, 0]) >= 0.9999
    # the weight gradient sums 2 x 32 tokens' noise: 4-bit codes measured 0.987 here
    assert cosine(ref.weight.grad, ours.weight.grad) >= (0.999 if bits == 8 else 0.98)


@pytest.mark.parametrize('transposed', [False, True])
def test_layernorm_runs_its_norm_once(transposed):
    """The normalized input is packed as the kernels read ``x`` (``pack(row_moments=...)``):
    a forward is one ``native_layer_norm`` and one pack, and a strided input (a transposed
    patch map) is copied once (the pack's equality with the torch path: test_extension)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in ('detach', 'view', 'alias'):
                self.calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ref = nn.LayerNorm(48)
    ours = MesaLayerNorm.convert(copy.deepcopy(ref), MesaConfig())
    x = torch.randn(2, 48, 30) * 3 + 1
    x = (x.transpose(1, 2) if transposed else x.view(2, 30, 48)).requires_grad_()
    ours(x)  # the first call sizes the running estimates
    with Ops() as ops:
        y = ours(x)
    assert torch.equal(y, ref(x))
    assert ops.calls == ['clone'] * transposed + ['native_layer_norm', 'observe_quantize']


def _attention_map_step(modify_map: bool = False):
    """softmax then ``attn @ v`` (Mesa modules): the bytes saved, the gradients, and exact ones."""
    from mmseg_mesa.layers.matmul import MesaMatMul
    from mmseg_mesa.layers.softmax import MesaSoftmax
    from mmseg_mesa.memory import count_saved_tensors
    gen = torch.Generator().manual_seed(0)
    scores, v, grad = (drawn(torch.randn, *shape, generator=gen)
                       for shape in ((2, 4, 64, 64), (2, 4, 64, 16), (2, 4, 64, 16)))
    softmax = MesaSoftmax(dim=-1, mesa_config=MesaConfig()).train()
    av = MesaMatMul(mesa_config=MesaConfig()).train()
    inputs = [scores.clone().requires_grad_(), v.clone().requires_grad_()]
    with count_saved_tensors(nn.ModuleList([softmax, av])) as report:
        attn = softmax(inputs[0] * 3)
        if modify_map:
            attn = attn.mul_(1.0)  # an in-place change: the softmax's codes no longer match
        av(attn, inputs[1]).backward(grad)
    exact = [scores.clone().requires_grad_(), v.clone().requires_grad_()]
    (torch.softmax(exact[0] * 3, -1) @ exact[1]).backward(grad)
    return report, [x.grad for x in inputs], [x.grad for x in exact]


def test_attention_map_codes_are_saved_once_for_softmax_and_matmul():
    report, grads, exact = _attention_map_step()
    modified, _, _ = _attention_map_step(modify_map=True)
    one_map = 2 * 4 * 64 * 64  # its uint8 codes
    assert report.by_type['MesaSoftmax'] >= one_map
    assert report.by_type['MesaMatMul'] < one_map / 2  # v's codes only: the map's were reused
    assert modified.by_type['MesaMatMul'] >= one_map  # changed in place: packed again
    assert cosine(grads[0], exact[0]) > 0.999 and cosine(grads[1], exact[1]) > 0.999


def _ffn_step(modify_hidden=False):
    """fc1 -> GELU -> fc2 of a transformer MLP, converted, one step; saved bytes by type."""
    from mmseg_mesa.memory import count_saved_tensors
    torch.manual_seed(0)
    exact = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    model = copy.deepcopy(exact)
    convert_to_mesa(model, config=MesaConfig())
    x = torch.randn(4, 64, 32)
    with count_saved_tensors(model) as report:
        hidden = model[1](model[0](x))
        if modify_hidden:
            hidden = hidden.mul_(1.0)  # an in-place change: the GELU's codes no longer match
        model[2](hidden).sum().backward()
    exact(x).sum().backward()
    return report, model, exact


def test_linear_after_gelu_saves_its_input_as_the_gelus_codes():
    """fc2's input is gelu(fc1's output): the codes GELU keeps of its input serve both, and fc2
    decodes gelu() of them. Gradients stay as close as with codes of its own."""
    report, model, exact = _ffn_step()
    modified, model_own, _ = _ffn_step(modify_hidden=True)
    hidden = 4 * 64 * 128  # uint8 codes of the hidden features
    assert report.by_type['GELU'] >= hidden
    assert report.by_type['Linear'] < hidden / 2  # fc1's input only (weights are not counted)
    assert modified.by_type['Linear'] >= hidden  # changed in place: fc2 packed its own
    for shared, own, want in zip(model.parameters(), model_own.parameters(),
                                 exact.parameters()):
        assert cosine(shared.grad, want.grad) > 0.9999
        error = (shared.grad - want.grad).norm() / want.grad.norm()
        assert error < 2 * (own.grad - want.grad).norm() / want.grad.norm() + 1e-4


def _norm_linear_step(modify_output=False, affine=True, layer_bits=None):
    """LayerNorm -> Linear (a transformer's norm and first MLP layer), converted, one step."""
    from mmseg_mesa.memory import count_saved_tensors
    torch.manual_seed(0)
    exact = nn.Sequential(nn.LayerNorm(32, elementwise_affine=affine), nn.Linear(32, 64))
    if affine:  # a trained norm's affine: signs and scales differ by channel
        nn.init.uniform_(exact[0].weight, -2.0, 2.0)
        nn.init.uniform_(exact[0].bias, -1.0, 1.0)
    model = copy.deepcopy(exact)
    convert_to_mesa(model, config=MesaConfig(layer_bits=layer_bits or {}))
    x = (torch.randn(4, 64, 32) * torch.linspace(0.1, 3.0, 32) + 1.0).requires_grad_()
    grad = torch.randn(4, 64, 64)
    with count_saved_tensors(model) as report:
        normed = model[0](x)
        if modify_output:
            normed = normed.mul_(1.0)  # an in-place change: the norm's codes no longer match
        out = model[1](normed)
        out.backward(grad)
    assert torch.equal(out, exact(x))
    exact(x).backward(grad)
    return report, model, exact


@pytest.mark.parametrize('affine', [True, False])
def test_linear_after_layernorm_saves_its_input_as_the_norms_codes(affine):
    """The Linear after a LayerNorm reads ``x_norm * weight + bias``: a per-channel affine of the
    normalized input, whose codes LayerNorm keeps anyway. The Linear saves its input as those
    codes mapped through the affine, and its gradients stay as close as with codes of its own."""
    report, model, exact = _norm_linear_step(affine=affine)
    modified, model_own, _ = _norm_linear_step(modify_output=True, affine=affine)
    codes = 4 * 64 * 32  # uint8 codes of the normalized tokens
    assert report.by_type['LayerNorm'] >= codes
    assert report.by_type['Linear'] == 0  # its input's codes are the norm's
    assert modified.by_type['Linear'] >= codes  # changed in place: the Linear packed its own
    for shared, own, want in zip(model.parameters(), model_own.parameters(),
                                 exact.parameters()):
        assert cosine(shared.grad, want.grad) > 0.9999
        error = (shared.grad - want.grad).norm() / want.grad.norm()
        assert error < 2 * (own.grad - want.grad).norm() / want.grad.norm() + 1e-4


def test_layernorm_codes_serve_a_linear_only_at_its_bit_width():
    """At another width (a 4-bit LayerNorm, ``layer_bits``) the Linear keeps 8-bit codes of its
    own: reusing the norm's would store its input at 4 bits."""
    report, model, exact = _norm_linear_step(layer_bits={'layernorm': 4})
    assert report.by_type['Linear'] >= 4 * 64 * 32
    assert cosine(model[1].weight.grad, exact[1].weight.grad) > 0.9999


def test_mapped_codes_decode_to_the_function_of_the_codes():
    from mmseg_mesa.quantizer import ActivationQuantizer, Mapped, QuantSpec, sample_range, unpack
    x = torch.randn(3, 5, 8)
    packed = ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=1)).pack(x)
    mapped = Mapped(packed, torch.nn.functional.gelu, torch.bfloat16)
    decoded = unpack(mapped)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    want = torch.nn.functional.gelu(unpack(packed, torch.float32))
    assert torch.equal(decoded, want.bfloat16())
    assert torch.equal(unpack(sample_range(mapped, 1, 3)), want[1:3].bfloat16())


def test_a_division_linear_after_gelu_packs_its_own_input():
    """GELU's codes are offered to the next layer; one whose compressor is DIVISION packs its
    own copy (at GELU's bit width, so only the compressor differs; this used to raise)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    convert_to_mesa(model, config=MesaConfig(division=['linear'], division_bits=8))
    packed = []
    pack = model[2].quant_input.pack
    model[2].quant_input.pack = lambda x: packed.append(x.shape) or pack(x)
    model(torch.randn(2, 5, 8)).sum().backward()
    assert packed == [torch.Size((2, 5, 16))]
    assert torch.isfinite(model[2].weight.grad).all()


@pytest.mark.parametrize('batch_first', [False, True])
@pytest.mark.parametrize('aliasing', ['q is k is v', 'k is v', 'distinct'])
def test_multihead_attention_is_bit_identical_for_each_aliasing(aliasing, batch_first):
    """torch picks its in-projection by which of q, k, v are the same tensor (one packed matmul,
    a q / kv split, or three); the converted module takes the same branch for the same
    arguments, so it is compared with torch on exactly those arguments."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=batch_first).train()
    ours = copy.deepcopy(ref)
    convert_to_mesa(nn.Sequential(ours))
    shape = (2, 5, 16) if batch_first else (5, 2, 16)
    q = torch.randn(shape)
    k = q if aliasing == 'q is k is v' else torch.randn(shape)
    v = k if aliasing != 'distinct' else torch.randn(shape)

    def call(module, args):
        copies = {}
        args = [copies.setdefault(id(x), x.clone().requires_grad_()) for x in args]
        out, weights = module(*args)
        return args, out, weights

    args, out, weights = call(ref, (q, k, v))
    args2, out2, weights2 = call(ours, (q, k, v))
    assert torch.equal(out, out2) and torch.equal(weights, weights2)
    backward_both(out, out2)
    for a, b in zip(args, args2):
        assert cosine(a.grad, b.grad) >= 0.999
    assert cosine(ref.in_proj_weight.grad, ours.in_proj_weight.grad) >= 0.999
