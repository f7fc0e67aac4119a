import pytest
import torch
from conftest import drawn

from mmseg_mesa.bitpack import pack_bits, pack_mask, unpack_bits, unpack_mask
from mmseg_mesa.quantizer import (
    ActivationQuantizer,
    QuantSpec,
    group_min_max,
    pack,
    reset_rounding_generators,
    unpack,
    unpack_divided,
)
from mmseg_mesa.reference import rounding_uniforms


def spec(**kw):
    base = dict(bits=8, group_dim=-1, group_size=4, stochastic=False, ema_decay=0.9,
                backend='torch')
    base.update(kw)
    return QuantSpec(**base)


@pytest.mark.parametrize('bits', [1, 2, 4, 8])
@pytest.mark.parametrize('numel', [1, 7, 64, 1001])
def test_bitpack_round_trip(bits, numel):
    codes = torch.randint(0, 2 ** bits, (numel,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == -(-numel * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


def test_mask_round_trip():
    mask = torch.rand(3, 5, 7) > 0.5
    assert torch.equal(unpack_mask(pack_mask(mask), mask.shape), mask)


def test_bitpack_rejects_bad_bits():
    with pytest.raises(ValueError, match='bits=3'):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)


@pytest.mark.parametrize('bits', [2, 4, 8])
@pytest.mark.parametrize('group_dim, shape', [(-1, (3, 5, 37)), (1, (2, 13, 4, 5))])
def test_deterministic_error_is_at_most_half_a_step(bits, group_dim, shape):
    x = torch.randn(shape) * torch.linspace(0.1, 5, shape[group_dim]).view(
        [-1 if d == group_dim % len(shape) else 1 for d in range(len(shape))])
    q = ActivationQuantizer(spec(bits=bits, group_dim=group_dim))
    packed = q.pack(x)  # first step: the range is exactly this batch's
    x_hat = unpack(packed)
    step = packed.scale.repeat_interleave(4)[:shape[group_dim]]
    step = step.view([-1 if d == group_dim % len(shape) else 1 for d in range(len(shape))])
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert ((x_hat - x).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()


def test_stochastic_rounding_is_unbiased():
    x = torch.rand(64, 32)
    q = ActivationQuantizer(spec(stochastic=True, group_size=32))
    q.observe(x)
    draws = torch.stack([unpack(pack(x, q.spec, q.lower, q.span)) for _ in range(400)])
    step = (q.span / 255).item()
    mean_error = (draws.mean(0) - x)
    # Each draw errs by up to one step; the mean of 400 draws must be ~0 (std <= step / 40).
    assert mean_error.abs().mean() < step / 20
    assert abs(mean_error.mean().item()) < step / 200
    # ... whereas each single draw is visibly noisy (so the test could fail).
    assert (draws[0] - x).abs().mean() > step / 8


def test_stochastic_rounding_is_reproducible_and_leaves_global_rng_alone():
    x = torch.randn(8, 32)
    q = ActivationQuantizer(spec(stochastic=True))
    torch.manual_seed(3)
    reset_rounding_generators()
    first = q.pack(x).data.clone()
    after_first = torch.rand(1)
    torch.manual_seed(3)
    reset_rounding_generators()
    q2 = ActivationQuantizer(spec(stochastic=True))
    assert torch.equal(q2.pack(x).data, first)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(1), after_first)


def test_running_estimates_first_batch_then_ema():
    q = ActivationQuantizer(spec(group_size=2, ema_decay=0.75))
    a = torch.tensor([[0.0, 1.0, -2.0, 2.0]])
    b = torch.tensor([[4.0, 5.0, 0.0, 8.0]])
    q.observe(a)
    assert torch.equal(q.lower, torch.tensor([0.0, -2.0]))
    assert torch.equal(q.span, torch.tensor([1.0, 4.0]))
    q.observe(b)
    assert torch.allclose(q.lower, torch.tensor([0.75 * 0 + 0.25 * 4, 0.75 * -2 + 0.25 * 0]))
    assert torch.allclose(q.span, torch.tensor([0.75 * 1 + 0.25 * 1, 0.75 * 4 + 0.25 * 8]))


def test_non_finite_values_never_poison_estimates():
    q = ActivationQuantizer(spec(group_size=2))
    q.observe(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    before = (q.lower.clone(), q.span.clone())
    q.observe(torch.tensor([[float('nan'), float('inf'), float('-inf'), 2.5]]))
    assert torch.isfinite(q.lower).all() and torch.isfinite(q.span).all()
    # group 0 had no finite value: unchanged; group 1 saw only 2.5.
    assert q.lower[0] == before[0][0] and q.span[0] == before[1][0]
    assert abs(q.lower[1].item() - (0.9 * 2.0 + 0.1 * 2.5)) < 1e-6
    x_hat = unpack(pack(torch.tensor([[float('nan'), 0.5, 2.0, 3.0]]), q.spec, q.lower, q.span))
    assert torch.isfinite(x_hat).all()


def test_group_min_max_uneven_groups():
    x = torch.arange(10.0).view(1, 10)
    lo, hi = group_min_max(x, 1, 4)
    assert lo.tolist() == [0, 4, 8] and hi.tolist() == [3, 7, 9]


def test_estimates_are_buffers_outside_state_dict_and_parameters():
    q = ActivationQuantizer(spec())
    q.observe(torch.randn(3, 8))
    assert dict(q.state_dict()) == {}
    assert list(q.parameters()) == []
    assert {n for n, _ in q.named_buffers()} == {'lower', 'span', 'seen'}


def test_buffers_resize_in_place():
    q = ActivationQuantizer(spec(group_size=4))
    lower = q.lower
    q.observe(torch.randn(2, 16))
    assert q.lower is lower and q.lower.numel() == 4


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
def test_unpack_returns_packed_dtype(dtype):
    x = torch.randn(4, 33).to(dtype)
    packed = ActivationQuantizer(spec()).pack(x)
    assert packed.data.dtype == torch.uint8 and packed.data.numel() == x.numel()
    assert unpack(packed).dtype == dtype


def one_pass_codes(x, lower, scale, spec, group_dim, counter=None):
    """The documented numerics in one expression over the whole tensor (the contract); the
    stochastic draws are one call's Philox stream at ``counter``."""
    shape = [1] * x.dim()
    shape[group_dim] = x.shape[group_dim]
    lower_c = lower.repeat_interleave(spec.group_size)[:x.shape[group_dim]].view(shape)
    scale_c = scale.repeat_interleave(spec.group_size)[:x.shape[group_dim]].view(shape)
    v = (x.float() - lower_c) / scale_c
    if spec.stochastic:
        seed, offset = counter
        v = torch.floor(v + rounding_uniforms(seed, offset, 0, v.numel(), v.device).view(v.shape))
    else:
        v = torch.round(v)
    return v.nan_to_num_(nan=0.0).clamp_(0, 2 ** spec.bits - 1).to(torch.uint8)


@pytest.mark.parametrize('stochastic', [False, True])
@pytest.mark.parametrize('bits', [2, 4, 8])
@pytest.mark.parametrize('shape, group_dim, group_size', [
    ((6, 7, 9, 5), 1, 2), ((3, 50, 33), -1, 4), ((2, 3, 41, 43), 1, 1), ((1001,), 0, 7)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_piecewise_torch_path_equals_one_pass(monkeypatch, stochastic, bits, shape, group_dim,
                                              group_size, dtype):
    import mmseg_mesa.reference as reference
    # tiny pieces: boundaries inside rows, inside channels and inside packed bytes
    monkeypatch.setattr(reference, 'PIECE_MIN_ELEMENTS', 37)
    monkeypatch.setattr(reference, 'PIECE_FRACTION', 10 ** 6)
    x = (torch.randn(shape) * 3).to(dtype)
    x.view(-1)[[1, 4]] = torch.tensor([float('nan'), float('inf')], dtype=dtype)
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    lower, span = torch.randn(groups) - 2, torch.rand(groups) * 4 + 0.5
    s = spec(bits=bits, group_dim=group_dim, group_size=group_size, stochastic=stochastic)
    torch.manual_seed(4)
    reset_rounding_generators()
    packed = pack(x, s, lower, span)
    want = one_pass_codes(x, lower, packed.scale, s, dim, (torch.initial_seed() ^ 0x5EED_3E5A, 0))
    assert len(reference._pieces(x.shape, dim)[1]) > 3
    assert torch.equal(packed.data.reshape(-1),
                       want.reshape(-1) if bits == 8 else pack_bits(want, bits))
    for out_dtype in (dtype, torch.float32):
        shape_c = [1] * x.dim()
        shape_c[dim] = shape[dim]
        lower_c = lower.repeat_interleave(group_size)[:shape[dim]].view(shape_c)
        scale_c = packed.scale.repeat_interleave(group_size)[:shape[dim]].view(shape_c)
        expected = (want.float() * scale_c + lower_c).to(out_dtype)
        assert torch.equal(unpack(packed, out_dtype), expected)


@pytest.mark.slow
@pytest.mark.parametrize('bits', [4, 8])
def test_torch_path_temporaries_are_a_small_fraction_of_the_activation(bits):
    from torch.distributed._tools.mem_tracker import MemTracker
    x = torch.randn(8, 96, 96, 96)  # 27 MiB
    q = ActivationQuantizer(spec(bits=bits, group_dim=1, group_size=1, stochastic=True))
    q.observe(x)
    size = x.numel() * x.element_size()
    tracker = MemTracker()
    tracker.track_external(x, q)
    with tracker:
        packed = q.pack(x)
    extra = tracker.get_tracker_snapshot('peak')[x.device]['Total'] - size - packed.data.numel()
    # one pass made ~3-4 fp32 copies (shifted values, noise, their sum); pieces keep < 1/12
    assert extra < size / 12, extra / size
    tracker = MemTracker()
    tracker.track_external(x, q, packed.data)
    with tracker:
        restored = unpack(packed, torch.float32)
    extra = (tracker.get_tracker_snapshot('peak')[x.device]['Total'] - size
             - packed.data.numel() - restored.numel() * 4)
    assert extra < size / 12, extra / size


def test_bit_packing_temporaries_are_a_fraction_of_the_mask():
    """A 1-bit mask of a large activation (ReLU, Dropout) is packed without widening its codes:
    the int32 lanes it used cost 8 bytes per element, 176 MB for one mask of Swin-T UPerNet's
    bottleneck at 512x512, at the step's peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from mmseg_mesa.bitpack import pack_mask, unpack_mask
    mask = torch.rand(4, 64, 96, 96) > 0.5  # 2.25 MiB of bools
    tracker = MemTracker()
    tracker.track_external(mask)
    with tracker:
        packed = pack_mask(mask)
    extra = tracker.get_tracker_snapshot('peak')[mask.device]['Total'] - mask.numel()
    assert extra <= mask.numel() / 4, extra / mask.numel()  # the packed bits plus one byte lane
    assert torch.equal(unpack_mask(packed, mask.shape), mask)


@pytest.mark.parametrize('stochastic', [True, False])
def test_pack_standardized_decodes_to_the_normalized_tensor(stochastic):
    """``pack_standardized(x, mean, rstd)`` stands for ``pack((x - mean) * rstd)``: same ranges
    and running estimates, codes within one step of the normalized values, unbiased rounding."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-3, 1.0, 50.0, 0.2]).view(1, 4, 1, 1)
    shifts = torch.tensor([5.0, -2, 0, 1e3]).view(1, 4, 1, 1)
    x = drawn(torch.randn, 3, 4, 9, 7, generator=gen) * scales + shifts
    var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0, keepdim=True)
    rstd = torch.rsqrt(var + 1e-5)
    x_norm = (x - mean) * rstd
    direct = ActivationQuantizer(spec(bits=8, group_dim=1, group_size=1, stochastic=stochastic))
    fused = ActivationQuantizer(spec(bits=8, group_dim=1, group_size=1, stochastic=stochastic))
    want = direct.pack(x_norm)
    got = fused.pack_standardized(x, mean, rstd)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.lower, want.lower, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fused.lower, direct.lower, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.span, direct.span, rtol=1e-5, atol=1e-5)
    step = got.scale.view(1, 4, 1, 1)
    error = unpack(got, torch.float32) - x_norm
    assert (error.abs() <= step * (1.0 if stochastic else 0.5) + 1e-5).all()
    if stochastic:  # the mean of many draws converges to the value
        draws = torch.stack([unpack(fused.pack_standardized(x, mean, rstd), torch.float32)
                             for _ in range(200)])
        assert ((draws.mean(0) - x_norm).abs() <= step * 0.25).all()


def test_pack_standardized_refuses_groups_it_cannot_map():
    q = ActivationQuantizer(spec(bits=8, group_dim=1, group_size=2))
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match='one group per channel'):
        q.pack_standardized(x, torch.zeros(1, 4, 1), torch.ones(1, 4, 1))


def test_batchnorm_forward_makes_no_full_size_temporary():
    """MesaBatchNorm's forward holds its input, its output and the codes: its normalized input
    is packed straight from x (at Swin-T UPerNet's 512x512 peak that temporary was 64 MiB)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from mmseg_mesa import MesaConfig
    from mmseg_mesa.layers.norm import MesaBatchNorm2d
    bn = MesaBatchNorm2d(64, mesa_config=MesaConfig()).train()
    x = torch.randn(8, 64, 96, 96)  # 18 MiB
    size = x.numel() * x.element_size()
    bn(x)  # the running estimates exist, as after the first step
    tracker = MemTracker()
    tracker.track_external(bn, x)
    with tracker:
        y = bn(x)
    extra = tracker.get_tracker_snapshot('peak')[x.device]['Total'] - 2 * size - x.numel()
    assert extra < size / 12, extra / size
    assert torch.equal(y, torch.nn.functional.batch_norm(
        x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps))


@pytest.mark.parametrize('bits', [8, 4, 2])
def test_sample_range_decodes_to_the_same_samples(bits):
    """A range of samples of a packed tensor decodes to those samples of the whole decode."""
    from mmseg_mesa.quantizer import sample_range
    q = ActivationQuantizer(spec(bits=bits, group_dim=1, group_size=1))
    x = torch.randn(5, 6, 4, 3)
    packed = q.pack(x)
    whole = unpack(packed)
    part = sample_range(packed, 1, 4)
    assert part is not None and part.shape == (3, 6, 4, 3)
    assert part.data.data_ptr() >= packed.data.data_ptr()  # a view: no copy of the codes
    assert torch.equal(unpack(part), whole[1:4])


def test_sample_range_refuses_what_it_cannot_slice():
    from mmseg_mesa.quantizer import sample_range
    odd = ActivationQuantizer(spec(bits=4, group_dim=1, group_size=1)).pack(torch.randn(3, 5, 3))
    assert sample_range(odd, 0, 1) is None  # 15 four-bit codes per sample end inside a byte
    by_sample = ActivationQuantizer(spec(bits=8, group_dim=0, group_size=1)).pack(
        torch.randn(4, 6))
    assert sample_range(by_sample, 0, 2) is None  # its groups are the samples


@pytest.mark.parametrize('backend', ['torch', 'auto'])
@pytest.mark.parametrize('bits', [8, 4])
def test_a_dense_tensor_in_another_layout_is_packed_as_it_lies(backend, bits):
    """A channels-last map or transposed tokens are packed in their own layout, without a
    copy: the same codes as their contiguous copy would get, decoded to the same layout;
    samples still slice where they are outermost, and a tensor that is not dense is copied."""
    from mmseg_mesa.quantizer import sample_range
    x = torch.randn(3, 8, 5, 4)
    layouts = {'channels last': (x.to(memory_format=torch.channels_last), (0, 2, 3, 1)),
               'tokens transposed': (x.flatten(2).transpose(1, 2), (0, 2, 1))}
    for name, (view, order) in layouts.items():
        q = ActivationQuantizer(spec(bits=bits, group_dim=1, group_size=1, backend=backend))
        plain = ActivationQuantizer(spec(bits=bits, group_dim=1, group_size=1, backend=backend))
        packed, copied = q.pack(view), plain.pack(view.contiguous())
        assert packed.order == order and copied.order is None, name
        assert packed.data.numel() == copied.data.numel()
        decoded = unpack(packed)
        assert decoded.stride() == view.stride(), name
        assert torch.equal(decoded, unpack(copied)), name
        part = sample_range(packed, 1, 3)
        assert part is not None and torch.equal(unpack(part), decoded[1:3]), name
    tokens_first = x.flatten(2).permute(2, 0, 1)  # (L, N, C) stored (N, C, L): samples inside
    packed = ActivationQuantizer(spec(group_dim=-1, group_size=1)).pack(tokens_first)
    assert packed.order == (1, 2, 0) and sample_range(packed, 0, 2) is None
    strided = x[:, ::2]
    packed = ActivationQuantizer(spec(group_dim=1, group_size=1)).pack(strided)
    assert packed.order is None and torch.equal(unpack(packed), unpack(
        ActivationQuantizer(spec(group_dim=1, group_size=1)).pack(strided.contiguous())))


def test_a_mask_of_a_dense_tensor_in_another_layout_is_packed_as_it_lies():
    """``PackedMask`` of a channels-last map: its bits in the map's own order (no copy), and
    unpack / select / select_ give what the contiguous map's mask gives, in the map's layout."""
    from mmseg_mesa.saved import PackedMask
    x = torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)
    grad = torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)
    for mask in (PackedMask.positive(x), PackedMask.of(x > 0)):
        assert mask.order == (0, 2, 3, 1)
        assert torch.equal(mask.unpack(), x > 0)
        selected = mask.select(grad)
        assert torch.equal(selected, torch.where(x > 0, grad, 0))
        assert selected.stride() == grad.stride()
        assert torch.equal(mask.select(grad.contiguous()), selected)  # other layout: still right
        assert torch.equal(mask.select_(grad.clone()), selected)


def test_batchnorm_backward_holds_two_full_size_tensors(monkeypatch):
    """MesaBatchNorm's backward holds the incoming gradient and one fp32 tensor (the decoded
    normalized input, turned into the input gradient in place); the channel sum of products is
    taken a chunk of samples at a time. The out-of-place formulas held about five."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import mmseg_mesa.layers.chunking as chunking
    from mmseg_mesa import MesaConfig
    from mmseg_mesa.layers.norm import MesaBatchNorm2d
    bn = MesaBatchNorm2d(64, mesa_config=MesaConfig()).train()
    x = torch.randn(8, 64, 48, 48, requires_grad=True)  # 4.5 MiB
    size = x.numel() * x.element_size()
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', size // 8)
    y = bn(x)
    grad = torch.randn_like(y)
    tracker = MemTracker()
    tracker.track_external(bn, x, grad)
    with tracker:
        y.backward(grad)
    del y
    extra = tracker.get_tracker_snapshot('peak')[x.device]['Total'] - 3 * size  # x, grad, x.grad
    assert extra < size / 2, extra / size  # measured 0.38 (a chunk's product, the codes' decode)
    want = torch.autograd.grad(torch.nn.functional.batch_norm(
        x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps), x, grad)[0]
    assert torch.nn.functional.cosine_similarity(x.grad.flatten(), want.flatten(), 0) > 0.999


def test_quantizer_chooses_its_backend_once_per_device(monkeypatch):
    """``select_backend`` is asked once per device a quantizer runs on; copies and pickles
    choose again where they run (a pickle may load where the extension is missing)."""
    import copy
    import pickle

    import mmseg_mesa.quantizer as quantizer
    from mmseg_mesa.reference import REFERENCE
    asked = []

    def select(x, requested):
        asked.append(requested)
        return REFERENCE

    q = ActivationQuantizer(spec(group_dim=1, group_size=1))
    monkeypatch.setattr(quantizer, 'select_backend', select)
    for _ in range(3):
        q.pack(torch.randn(2, 3, 4))
    q.observe(torch.randn(2, 3, 4))
    assert asked == ['torch'] and q.backend_for(torch.zeros(1)) is REFERENCE
    assert copy.deepcopy(q)._backends == {} and pickle.loads(pickle.dumps(q))._backends == {}
    assert q._backends == {'cpu': REFERENCE}


@pytest.mark.parametrize('stochastic', [False, True])
def test_refined_codes_hold_a_255th_of_a_step(stochastic):
    """A second 8-bit pass over what 8-bit codes miss keeps every value within 1/255 of a coarse
    step (about 16 bits, ``quantizer.refine``); the codes slice by samples and rebuild from
    what they save, and the pure-PyTorch backend refines to the same codes."""
    import dataclasses

    from mmseg_mesa.quantizer import Refined, refine
    gen = torch.Generator().manual_seed(0)
    x = drawn(torch.randn, 4, 50, 24, generator=gen) * drawn(torch.rand, 24, generator=gen) * 5 \
        + drawn(torch.randn, 24, generator=gen)
    packed = ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, stochastic=stochastic)).pack(x)
    refined = refine(packed, x)
    assert refined.bits == 16 and refined.shape == x.shape

    def steps(codes):
        return ((unpack(codes, torch.float32) - x).abs() / packed.scale).max()

    assert steps(packed) > 0.45 and steps(refined) <= 1.01 / 255  # fp32 rounding: 1%
    assert torch.equal(unpack(refined.sample_range(1, 3)), unpack(refined)[1:3])
    assert torch.equal(unpack(Refined.rebuild(refined.tensors(), refined.meta())),
                       unpack(refined))
    reference = refine(dataclasses.replace(packed, backend='torch'), x)
    assert all(torch.equal(a, b) for a, b in zip(reference.tensors(), refined.tensors()))
    assert unpack(refine(packed, x.bfloat16()), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize('backend', ['auto', 'torch'])
@pytest.mark.parametrize('kind', ['plain', 'permuted', 'refined', 'four_bits'])
def test_unpack_divided_divides_each_row_of_the_decoded_values(backend, kind):
    """``unpack_divided``: the decoded values, each row divided by its own value in fp32, in one
    backend call for plain codes and through the decoded tensor for any others."""
    torch.manual_seed(0)
    x = torch.randn(6, 10, 16)
    if kind == 'permuted':  # codes kept in the tensor's own (tokens-first) layout
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    quantizer = ActivationQuantizer(spec(bits=4 if kind == 'four_bits' else 8, backend=backend))
    packed = quantizer.pack(x, refined=kind == 'refined')
    divisor = torch.rand(6, 10, 1) * 3 + 0.1
    want = (unpack(packed, torch.float32).contiguous() / divisor)
    for dtype in (torch.float32, torch.bfloat16):
        got = unpack_divided(packed, divisor, dtype)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, want.to(dtype))
