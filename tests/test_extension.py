"""The optional CUDA extension ``mmseg_mesa._C``: build state, dispatch, and kernel == reference.

The first tests run everywhere (they need no GPU); the kernel tests need CUDA and compare every
kernel bit for bit with the pure-PyTorch reference in ``reference.py``.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from mmseg_mesa import _backend
from mmseg_mesa.quantizer import (
    ActivationQuantizer,
    Packed,
    QuantSpec,
    ema_update,
    group_min_max,
    reset_rounding_generators,
    scale_from_span,
    unpack,
)
from mmseg_mesa.reference import dequantize_reference, quantize_reference

BUILD = _backend.build_info()
BUILT = BUILD is not None and BUILD.EXTENSION
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
requires_build = pytest.mark.skipif(not BUILT, reason='package installed without the extension')


def run_info() -> str:
    result = subprocess.run([sys.executable, '-m', 'mmseg_mesa.info'], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


# ---------------------------------------------------------------- every machine

def test_info_command_reports_extension_state():
    out = run_info()
    assert torch.__version__ in out
    assert 'extension _C' in out
    assert ('built and loadable' in out) or ('unavailable:' in out)
    assert "backend='auto' for CUDA tensors" in out


def test_extension_is_importable_when_built():
    if not BUILT:
        # Installed without a toolkit (or with MMSEG_MESA_NO_EXT=1): info must say so.
        reason = BUILD.SKIP_REASON if BUILD is not None else 'never installed'
        assert 'unavailable: not built' in run_info()
        pytest.skip(reason)
    import mmseg_mesa._C as ext

    assert ext.TORCH_VERSION == torch.__version__.split('+')[0]
    kernels, error = _backend.load_extension()
    assert kernels is not None, error
    assert BUILD.TORCH_VERSION == torch.__version__
    assert BUILD.CUDA_ARCH_LIST


@requires_build
def test_ops_reject_cpu_tensors_with_a_clear_error():
    kernels, _ = _backend.load_extension()
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match='x must be a CUDA tensor'):
        kernels.quantize(x, torch.zeros(1), torch.ones(1), 8, 1, 8, False)


def test_extension_built_for_another_torch_is_refused(monkeypatch):
    other = SimpleNamespace(EXTENSION=True, TORCH_VERSION='1.0.0+cu00', SKIP_REASON=None)
    monkeypatch.setattr(_backend, 'build_info', lambda: other)
    reason = _backend._unusable_reason()
    assert 'built for torch 1.0.0+cu00' in reason and torch.__version__ in reason
    skipped = SimpleNamespace(EXTENSION=False, SKIP_REASON='not built: no toolkit')
    monkeypatch.setattr(_backend, 'build_info', lambda: skipped)
    assert _backend._unusable_reason() == 'not built: no toolkit'
    monkeypatch.setattr(_backend, 'build_info', lambda: None)
    assert 'never installed' in _backend._unusable_reason()


@pytest.mark.parametrize('archs, capability, covered', [
    ('9.0', (9, 0), True), ('9.0', (10, 0), False), ('9.0+PTX', (10, 0), True),
    ('8.0', (8, 6), True), ('8.6', (8, 0), False), ('8.0;9.0a', (9, 0), True),
    ('9.0a', (9, 1), False), ('7.5 8.0', (8, 9), True), ('Hopper', (9, 0), None),
])
def test_arch_coverage(archs, capability, covered):
    assert _backend.arch_covers(archs, capability) is covered


def test_auto_falls_back_with_one_warning_and_cuda_raises(monkeypatch):
    monkeypatch.setattr(_backend, 'load_extension', lambda: (None, 'not built: test'))
    monkeypatch.setattr(_backend, '_WARNED', False)
    fake_cuda = SimpleNamespace(is_cuda=True, device=torch.device('cuda', 0))
    with pytest.warns(UserWarning, match='not built: test'):
        assert _backend.kernels_for(fake_cuda, 'auto') is None
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _backend.kernels_for(fake_cuda, 'auto') is None  # warned once only
    with pytest.raises(RuntimeError, match='not built: test'):
        _backend.kernels_for(fake_cuda, 'cuda')
    assert _backend.kernels_for(torch.zeros(1), 'auto') is None
    with pytest.raises(RuntimeError, match='needs CUDA tensors'):
        _backend.kernels_for(torch.zeros(1), 'cuda')


# ---------------------------------------------------------------- CUDA: kernel == reference

def kernels():
    module, error = _backend.load_extension()
    assert module is not None, error
    return module


LAYOUTS = [  # shape, group_dim, group_size
    ((4, 37), -1, 8),             # 37 channels: the last group has 5
    ((2, 37, 3, 5), 1, 8),
    ((2, 3, 5, 37), -1, 8),
    ((2, 6, 7, 9), 1, 1),         # one channel per group
    ((3, 5, 4, 6), -1, 1),
    ((1001,), 0, 3),              # 1-d: a single row
    ((8, 3, 49, 49), 1, 1),       # attention map, one group per head
    ((16, 49, 96), -1, 32),       # Swin hidden features
    ((5, 7), 0, 100),             # one group larger than the channel count
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def sample(shape, dtype, offset=0.0, nonfinite=False):
    x = torch.randn(shape, device='cuda') * 3 + offset
    x = x * torch.rand(shape, device='cuda').pow(4) * 10  # uneven ranges, some outliers
    if nonfinite:
        flat = x.view(-1)
        index = torch.randperm(flat.numel(), device='cuda')[:max(3, flat.numel() // 50)]
        flat[index[0::3]] = float('nan')
        flat[index[1::3]] = float('inf')
        flat[index[2::3]] = float('-inf')
    return x.to(dtype)


def reference_observe(x, lower, span, seen, group_dim, group_size, decay):
    lo, hi = group_min_max(x, group_dim, group_size)
    return ema_update(lower, span, seen, lo, hi, decay)


@requires_cuda
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS)
def test_kernels_match_reference(shape, group_dim, group_size, dtype):
    k = kernels()
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    state = {name: [torch.zeros(groups, device='cuda'), torch.zeros(groups, device='cuda'),
                    torch.zeros(groups, dtype=torch.bool, device='cuda')]
             for name in ('kernel', 'reference')}
    for step in range(4):
        x = sample(shape, dtype, offset=step, nonfinite=step > 0)
        if step == 0 and groups > 1:  # a group with no finite value stays unseen
            x.narrow(dim, 0, min(group_size, shape[dim])).fill_(float('nan'))
        cover = k.observe(x, *state['kernel'], dim, group_size, 0.9)
        cover_ref = reference_observe(x, *state['reference'], dim, group_size, 0.9)
        assert torch.equal(cover, cover_ref), (step, cover, cover_ref)
        for got, want in zip(state['kernel'], state['reference']):
            assert torch.equal(got, want), (step, got, want)

        lower, span, _ = state['reference']
        for bits in (2, 4, 8):
            scale = scale_from_span(span, bits)
            spec = QuantSpec(bits=bits, group_dim=dim, group_size=group_size, stochastic=False)
            codes = k.quantize(x, lower, scale, bits, dim, group_size, False)
            want = quantize_reference(x, lower, scale, spec, dim)
            assert codes.dtype == torch.uint8 and codes.shape == x.shape
            assert torch.equal(codes, want), (bits, (codes != want).sum())
            for out_dtype in {dtype, torch.float32}:
                packed = Packed(codes, lower, scale, x.shape, dtype, bits, dim, group_size)
                got = k.dequantize(codes, lower, scale, dim, group_size, out_dtype)
                want = dequantize_reference(codes, packed, out_dtype)
                assert got.dtype == out_dtype
                assert torch.equal(got, want)


@requires_cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_unaligned_input_takes_the_scalar_path_with_same_results(dtype):
    k = kernels()
    base = sample((1 + 6 * 37,), dtype)
    x = base[1:].view(6, 37)  # contiguous, but not 16-byte aligned
    lower = torch.full((5,), -2.0, device='cuda')
    scale = torch.full((5,), 0.05, device='cuda')
    spec = QuantSpec(bits=8, group_dim=1, group_size=8, stochastic=False)
    codes = k.quantize(x, lower, scale, 8, 1, 8, False)
    assert torch.equal(codes, quantize_reference(x, lower, scale, spec, 1))
    offset_codes = torch.zeros(1 + codes.numel(), dtype=torch.uint8, device='cuda')
    offset_codes[1:] = codes.view(-1)
    unaligned = offset_codes[1:].view(6, 37)
    assert torch.equal(k.dequantize(unaligned, lower, scale, 1, 8, dtype),
                       k.dequantize(codes, lower, scale, 1, 8, dtype))


@requires_cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_stochastic_rounding_is_unbiased(dtype):
    k = kernels()
    x = (torch.rand(64, 96, device='cuda') * 4 - 1).to(dtype)
    lower = torch.full((3,), -1.0, device='cuda')
    span = torch.full((3,), 4.0, device='cuda')
    scale = scale_from_span(span, 8)
    step = scale[0].item()
    draws = torch.stack([k.dequantize(k.quantize(x, lower, scale, 8, 1, 32, True), lower, scale,
                                      1, 32, torch.float32) for _ in range(400)])
    error = draws.mean(0) - x.float()
    assert error.abs().mean() < step / 20
    assert abs(error.mean().item()) < step / 200
    assert (draws[0] - x.float()).abs().mean() > step / 8  # single draws are noisy
    floor = torch.floor((x.float() - lower[0]) / scale[0])  # a true division, as the kernel's
    codes = k.quantize(x, lower, scale, 8, 1, 32, True).float()
    assert ((codes == floor) | (codes == floor + 1)).all()


@requires_cuda
def test_stochastic_rounding_is_reproducible_and_leaves_global_rng_alone():
    k = kernels()
    x = torch.randn(33, 70, device='cuda', dtype=torch.float16)
    lower = torch.full((9,), -4.0, device='cuda')
    scale = torch.full((9,), 8 / 255, device='cuda')

    def draw():
        return k.quantize(x, lower, scale, 8, 1, 8, True)

    torch.manual_seed(7)
    reset_rounding_generators()
    first, second = draw(), draw()
    after = torch.cuda.get_rng_state()
    assert not torch.equal(first, second)
    torch.manual_seed(7)
    reset_rounding_generators()
    assert torch.equal(draw(), first) and torch.equal(draw(), second)
    torch.manual_seed(7)
    assert torch.equal(torch.cuda.get_rng_state(), after)  # the model's stream is untouched
    generator = torch.Generator('cuda')
    generator.manual_seed(11)
    own = k.quantize(x, lower, scale, 8, 1, 8, True, generator=generator)
    generator.manual_seed(11)
    assert torch.equal(k.quantize(x, lower, scale, 8, 1, 8, True, generator=generator), own)


@requires_cuda
def test_invalid_arguments_are_rejected_clearly():
    k = kernels()
    x = torch.randn(8, 16, device='cuda')
    lower, scale = torch.zeros(2, device='cuda'), torch.ones(2, device='cuda')
    with pytest.raises(RuntimeError, match='must be contiguous'):
        k.quantize(x.t(), lower, scale, 8, 0, 8, False)
    with pytest.raises(RuntimeError, match=r'must have shape \(2,\)'):
        k.quantize(x, torch.zeros(3, device='cuda'), scale, 8, 1, 8, False)
    with pytest.raises(RuntimeError, match='must be Float'):
        k.quantize(x, lower.double(), scale, 8, 1, 8, False)
    with pytest.raises(RuntimeError, match='group_dim=2 is out of range'):
        k.quantize(x, lower, scale, 8, 2, 8, False)
    with pytest.raises(RuntimeError, match='bits must be in'):
        k.quantize(x, lower, scale, 9, 1, 8, False)
    with pytest.raises(RuntimeError, match='codes must be uint8'):
        k.dequantize(x, lower, scale, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match='x must be float32'):
        k.quantize(x.int(), lower, scale, 8, 1, 8, False)
    with pytest.raises(RuntimeError, match='seen must be Bool'):
        k.observe(x, lower, scale, torch.zeros(2, device='cuda'), 1, 8, 0.9)


@requires_cuda
@pytest.mark.parametrize('bits', [2, 4, 8])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_activation_quantizer_cuda_backend_matches_torch(bits, dtype):
    shape, group_dim = (4, 3, 49, 49), 1
    quantizers = {backend: ActivationQuantizer(QuantSpec(
        bits=bits, group_dim=group_dim, group_size=1, stochastic=False, ema_decay=0.9,
        backend=backend)).cuda() for backend in ('cuda', 'torch')}
    for step in range(3):
        x = sample(shape, dtype, offset=step, nonfinite=step == 2)
        packed = {name: q.pack(x) for name, q in quantizers.items()}
        for name in ('lower', 'span', 'seen'):
            assert torch.equal(getattr(quantizers['cuda'], name),
                               getattr(quantizers['torch'], name))
        assert torch.equal(packed['cuda'].data, packed['torch'].data)
        assert torch.equal(unpack(packed['cuda']), unpack(packed['torch']))
        assert torch.equal(unpack(packed['cuda'], torch.float32),
                           unpack(packed['torch'], torch.float32))


@requires_cuda
def test_activation_quantizer_stochastic_cuda_stays_within_one_step():
    q = ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=32, stochastic=True,
                                      backend='cuda')).cuda()
    x = torch.randn(64, 96, device='cuda')
    packed = q.pack(x)
    step = packed.scale.repeat_interleave(32)
    assert ((unpack(packed) - x).abs() <= step * (1 + 1e-5)).all()


@requires_cuda
@pytest.mark.parametrize('shape, channel_dim', [((2, 16, 19, 13), 1), ((8, 49, 32), -1)])
def test_division_cuda_backend_matches_torch(shape, channel_dim):
    from mmseg_mesa.division import DivisionCompressor, DivisionSpec
    x = torch.randn(shape, device='cuda')
    packed = {backend: DivisionCompressor(DivisionSpec(
        bits=2, channel_dim=channel_dim, stochastic=False, backend=backend)).pack(x)
        for backend in ('cuda', 'torch')}
    assert torch.equal(packed['cuda'].lfc, packed['torch'].lfc)
    assert torch.equal(packed['cuda'].hfc.data, packed['torch'].hfc.data)
    assert torch.equal(unpack(packed['cuda']), unpack(packed['torch']))
