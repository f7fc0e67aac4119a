import pytest
import torch

from mmseg_mesa.bitpack import pack_bits, pack_mask, unpack_bits, unpack_mask
from mmseg_mesa.quantizer import (
    ActivationQuantizer,
    QuantSpec,
    group_min_max,
    pack,
    reset_rounding_generators,
    unpack,
)


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
