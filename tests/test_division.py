"""DIVISION's compressor: error bounds, layouts, bytes, and layers that use it."""
import copy

import pytest
import torch
from conftest import cosine
from torch import nn

from mmseg_mesa import MesaConfig
from mmseg_mesa.division import DivisionCompressor, DivisionPacked, DivisionSpec, spatial_view
from mmseg_mesa.layers import MesaBatchNorm, MesaConv2d, MesaLinear
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.quantizer import ActivationQuantizer, QuantSpec, unpack


def residual_step(x: torch.Tensor, spec: DivisionSpec, packed: DivisionPacked) -> torch.Tensor:
    """The residual's quantization step per (sample, channel), broadcast to x's (N, C, H, W)."""
    n, c, _, _ = packed.map_shape
    return packed.hfc.scale.view(n, c, 1, 1)


# (shape, channel_dim): conv maps with edges that are not whole blocks, square and non-square
# token sequences, Swin windows (49 tokens = 7x7), channel-last maps, a BatchNorm1d input.
LAYOUTS = [((2, 5, 19, 13), 1), ((2, 64, 7), -1), ((3, 50, 6), -1), ((4, 49, 8), -1),
           ((2, 9, 11, 6), -1), ((3, 6, 10), 1)]


@pytest.mark.parametrize('shape, channel_dim', LAYOUTS)
@pytest.mark.parametrize('bits', [2, 4, 8])
def test_round_to_nearest_error_is_half_a_residual_step(shape, channel_dim, bits):
    spec = DivisionSpec(block=4, bits=bits, channel_dim=channel_dim, stochastic=False)
    x = torch.randn(shape) * 3 + 1
    packed = DivisionCompressor(spec).pack(x)
    x_hat = unpack(packed)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype and x_hat.is_contiguous()
    err = spatial_view(x_hat - x, packed.channel_dim).abs()
    step = residual_step(x, spec, packed)
    assert (err <= step / 2 * (1 + 1e-4) + 1e-6).all()
    assert packed.lfc.dtype == torch.bfloat16


@pytest.mark.parametrize('shape, channel_dim', LAYOUTS[:3])
def test_stochastic_error_is_below_one_step_and_unbiased(shape, channel_dim):
    spec = DivisionSpec(block=4, bits=2, channel_dim=channel_dim, stochastic=True)
    x = torch.randn(shape)
    compressor = DivisionCompressor(spec)
    draws = []
    for _ in range(400):
        packed = compressor.pack(x)
        err = spatial_view(unpack(packed) - x, packed.channel_dim).abs()
        assert (err <= residual_step(x, spec, packed) * (1 + 1e-4) + 1e-6).all()
        draws.append(unpack(packed))
    mean_err = (torch.stack(draws).mean(0) - x).abs().max().item()
    one_draw_err = (draws[0] - x).abs().max().item()
    assert mean_err < one_draw_err / 5  # averaging 400 draws: ~1/20 of one draw's error


def test_smooth_maps_beat_plain_quantization_at_the_same_bits():
    """The point of DIVISION: a smooth map with fine detail keeps its detail at 2 bits."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 32), torch.linspace(0, 1, 32), indexing='ij')
    smooth = torch.stack([torch.sin(xx + k) * 4 + torch.cos(yy * k / 4) for k in range(8)])
    x = (smooth + 0.05 * torch.randn(2, 8, 32, 32)).contiguous()
    division = unpack(DivisionCompressor(DivisionSpec(bits=2, stochastic=False)).pack(x))
    quantizer = ActivationQuantizer(QuantSpec(bits=2, group_dim=1, group_size=1,
                                              stochastic=False))
    plain = unpack(quantizer.pack(x))
    # measured 0.099 of the plain quantizer's squared error (0.03 with 4x4 blocks)
    assert (division - x).pow(2).mean() < 0.2 * (plain - x).pow(2).mean()


def test_bf16_input_comes_back_bf16():
    x = torch.randn(2, 16, 24).to(torch.bfloat16)
    packed = DivisionCompressor(DivisionSpec(channel_dim=-1)).pack(x)
    assert unpack(packed).dtype == torch.bfloat16
    assert unpack(packed, torch.float32).dtype == torch.float32


def test_batch_dimension_cannot_be_the_channel():
    with pytest.raises(ValueError, match='channel dimension'):
        DivisionCompressor(DivisionSpec(channel_dim=0)).pack(torch.randn(4, 4, 4))


def saved_bytes(module, x):
    with count_saved_tensors(module) as report:
        out = module(x)
    return report.total_bytes, out


def test_conv_with_division_saves_about_2_25_bits_per_value_and_keeps_its_gradient():
    ref = nn.Conv2d(32, 16, 3, padding=1)
    ours = MesaConv2d.convert(copy.deepcopy(ref), MesaConfig(compressor='division'))
    assert isinstance(ours.quant_input, DivisionCompressor)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 64), torch.linspace(0, 1, 64), indexing='ij')
    field = torch.stack([torch.sin(4 * xx * (k % 5 + 1) + k) + yy * k / 8 for k in range(32)])
    x = (field + 0.1 * torch.randn(4, 32, 64, 64)).requires_grad_()
    baseline, y = saved_bytes(ref, x)
    mesa, y2 = saved_bytes(ours, x.detach().clone().requires_grad_())
    # codes 2/32, block means 16/(64*32), per-row ranges: 0.066 of fp32 plus the weight
    assert mesa <= 0.08 * baseline, mesa / baseline
    assert torch.equal(y, y2)
    grad = torch.randn_like(y)
    y.backward(grad)
    y2.backward(grad)
    assert cosine(ref.weight.grad, ours.weight.grad) > 0.98  # measured 0.989


def test_linear_on_swin_windows_with_division():
    ref = nn.Linear(32, 96)
    ours = MesaLinear.convert(copy.deepcopy(ref), MesaConfig(compressor='division'))
    ours4 = MesaLinear.convert(copy.deepcopy(ref), MesaConfig(compressor='division',
                                                             division_bits=4))
    x = torch.randn(8, 49, 32, requires_grad=True)
    ours(x).sum().backward()
    ref(x.detach()).sum().backward()
    # white-noise tokens are DIVISION's worst case (no low frequencies): measured 0.855 with
    # 2-bit residuals, and 4-bit residuals bring it close to Mesa's 8 bits
    assert cosine(ref.weight.grad, ours.weight.grad) > 0.8
    ours4(x.detach()).sum().backward()
    assert cosine(ref.weight.grad, ours4.weight.grad) > 0.98
    assert torch.allclose(ref.bias.grad, ours.bias.grad)


def test_batchnorm_with_division_keeps_exact_moments_in_backward():
    ref = nn.BatchNorm2d(16)
    ours = MesaBatchNorm.convert(copy.deepcopy(ref), MesaConfig(compressor='division'))
    assert isinstance(ours.quant_input, DivisionCompressor)
    x = (torch.randn(4, 16, 1, 1) * 3 + torch.randn(4, 16, 24, 24)).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(4, 16, 24, 24)
    ref(x).backward(grad)
    ours(x2).backward(grad)
    # the input gradient of batch norm sums to zero per channel; standardize keeps that exactly
    assert x2.grad.sum((0, 2, 3)).abs().max() < 1e-3
    assert cosine(x.grad, x2.grad) > 0.999  # measured 0.99990
    assert cosine(ref.weight.grad, ours.weight.grad) > 0.97  # measured 0.985 (white noise)
