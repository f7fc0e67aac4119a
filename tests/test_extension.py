"""The optional extension ``mmseg_mesa._C``: build state, dispatch, and kernel == reference.

The compiled CPU kernels are held to the pure-PyTorch reference in ``reference.py`` bit for bit
on every machine with a build; the same tests run on the CUDA kernels where a GPU is visible,
and the two kernels' codes are compared with each other there. Philox4x32-10, which both
kernels and the reference draw stochastic rounding from, is checked against Random123's
published known-answer vectors. The CPU-only kernels (observe and quantize in one call, 1-bit
masks) are held to the kernels and torch code they stand in for.
"""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from mmseg_mesa import _backend
from mmseg_mesa.bitpack import pack_bits
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
from mmseg_mesa.reference import (
    REFERENCE,
    dequantize_packed_reference,
    dequantize_reference,
    philox4x32_10,
    quantize_packed_reference,
    quantize_reference,
    rounding_uniforms,
)
from mmseg_mesa.rounding import rounding_counter

BUILD = _backend.build_info()
BUILT = BUILD is not None and BUILD.EXTENSION
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
requires_build = pytest.mark.skipif(not BUILT, reason='package installed without the extension')
DEVICES = [pytest.param('cpu', marks=requires_build),
           pytest.param('cuda', marks=[requires_build, requires_cuda])]


def run_info() -> str:
    result = subprocess.run([sys.executable, '-m', 'mmseg_mesa.info'], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


# ---------------------------------------------------------------- every machine

@pytest.mark.slow
def test_info_command_reports_extension_state():
    out = run_info()
    assert torch.__version__ in out
    assert 'extension _C' in out
    assert ('built and loadable' in out) or ('unavailable:' in out)
    assert "backend='auto' for CPU tensors" in out
    assert "backend='auto' for CUDA tensors" in out
    if BUILT:
        assert re.search(r"backend='auto' for CPU tensors +: cpu kernels", out)
        assert "CPU kernel threads" in out


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
    assert BUILD.CPU_KERNELS and kernels.CPU_KERNELS  # every build has the CPU kernels
    # at::parallel_for splits the CPU kernels' work over torch's threads only when the
    # extension was compiled with OpenMP like torch (a build without it ran on one thread)
    openmp_torch = 'parallel backend: OpenMP' in torch.__config__.parallel_info()
    if openmp_torch and sys.platform.startswith('linux'):
        assert BUILD.CPU_OPENMP
    assert kernels.CPU_PARALLEL == (BUILD.CPU_OPENMP or not openmp_torch)
    assert kernels.CUDA_KERNELS == BUILD.CUDA_KERNELS
    if BUILD.CUDA_KERNELS:
        assert BUILD.CUDA_ARCH_LIST and kernels.CUDA_ARCHS
    else:
        assert BUILD.CUDA_SKIP_REASON.startswith('not built')


@requires_build
def test_auto_runs_the_cpu_kernels_for_cpu_tensors():
    kernels, _ = _backend.load_extension()
    assert _backend.select_backend(torch.zeros(1), 'auto') is kernels.CPU
    assert _backend.select_backend(torch.zeros(1), 'torch') is REFERENCE
    assert _backend.select_backend(torch.zeros(1, device='meta'), 'auto') is REFERENCE
    with pytest.raises(RuntimeError, match='needs CUDA tensors'):
        _backend.select_backend(torch.zeros(1), 'cuda')


@requires_build
def test_build_without_cuda_kernels_falls_back_for_cuda_tensors(monkeypatch):
    cpu_only, _ = _backend.load_extension()
    monkeypatch.setattr(cpu_only, 'CUDA_KERNELS', False)
    monkeypatch.setattr(_backend, 'EXTENSION', _backend.ExtensionState(loaded=True,
                                                                       module=cpu_only))
    monkeypatch.setattr(_backend, 'build_info', lambda: SimpleNamespace(
        CUDA_SKIP_REASON='not built: torch 2.13.0+cpu has no CUDA support'))
    fake_cuda = SimpleNamespace(is_cuda=True, is_cpu=False, device=torch.device('cuda', 0))
    with pytest.warns(UserWarning, match='has no CUDA kernels .not built: torch 2.13.0'):
        assert _backend.select_backend(fake_cuda, 'auto') is REFERENCE
    with pytest.raises(RuntimeError, match='has no CUDA kernels'):
        _backend.select_backend(fake_cuda, 'cuda')
    assert _backend.select_backend(torch.zeros(1), 'auto') is cpu_only.CPU


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


def without_extension(monkeypatch):
    """This process as if the extension had not been built."""
    monkeypatch.setattr(_backend, 'EXTENSION', _backend.ExtensionState(
        loaded=True, error='not built: test'))


def test_auto_falls_back_with_one_warning_and_cuda_raises(monkeypatch):
    without_extension(monkeypatch)
    fake_cuda = SimpleNamespace(is_cuda=True, is_cpu=False, device=torch.device('cuda', 0))
    with pytest.warns(UserWarning, match='not built: test'):
        assert _backend.select_backend(fake_cuda, 'auto') is REFERENCE
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _backend.select_backend(fake_cuda, 'auto') is REFERENCE  # warned once only
    with pytest.raises(RuntimeError, match='not built: test'):
        _backend.select_backend(fake_cuda, 'cuda')
    assert _backend.select_backend(torch.zeros(1), 'auto') is REFERENCE  # warned once already
    with pytest.raises(RuntimeError, match='needs CUDA tensors'):
        _backend.select_backend(torch.zeros(1), 'cuda')


def test_auto_warns_once_for_cpu_tensors_without_the_extension(monkeypatch):
    without_extension(monkeypatch)
    with pytest.warns(UserWarning, match='compiled extension unavailable .not built: test'):
        assert _backend.select_backend(torch.zeros(1), 'auto') is REFERENCE
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _backend.select_backend(torch.zeros(1), 'auto') is REFERENCE


# ---------------------------------------------------------------- Philox4x32-10

# Random123's tests/kat_vectors, the "philox4x32 10" lines: counter words, key words, output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize('counter, key, want', PHILOX_KAT)
def test_reference_philox_matches_the_published_known_answers(counter, key, want):
    words = philox4x32_10(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in words) == want


def test_rounding_uniforms_are_uniform_and_split_consistently():
    u = rounding_uniforms(0x1234_5678_9ABC_DEF0, 7, 0, 1 << 20, 'cpu')
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert (counts - u.numel() / 16).abs().max() < 5 * (u.numel() / 16) ** 0.5
    assert (u * 2 ** 24 == (u * 2 ** 24).floor()).all()  # 24 random bits
    # any element's draw depends on its index only: pieces that straddle blocks agree
    assert torch.equal(torch.cat([rounding_uniforms(3, 9, a, b - a, 'cpu')
                                  for a, b in ((0, 5), (5, 6), (6, 17), (17, 40))]),
                       rounding_uniforms(3, 9, 0, 40, 'cpu'))
    # the offset moves the stream by whole blocks
    assert torch.equal(rounding_uniforms(3, 10, 0, 8, 'cpu'), rounding_uniforms(3, 9, 4, 8, 'cpu'))
    # offsets near 2**64 wrap as the kernels' uint64 does
    assert torch.equal(rounding_uniforms(3, 2 ** 64 - 1, 4, 4, 'cpu'),
                       rounding_uniforms(3, 0, 0, 4, 'cpu'))


def test_rounding_counter_advances_by_blocks_and_leaves_the_default_rng_alone():
    torch.manual_seed(5)
    reset_rounding_generators()
    state = torch.get_rng_state()
    seed, first = rounding_counter('cpu', 10)
    assert seed == 5 ^ 0x5EED_3E5A and first == 0
    assert rounding_counter('cpu', 1) == (seed, 3)  # ceil(10 / 4) blocks
    assert rounding_counter('cpu', 0) == (seed, 4)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(6)  # a new seed restarts the stream
    assert rounding_counter('cpu', 4) == (6 ^ 0x5EED_3E5A, 0)


# ---------------------------------------------------------------- kernel == reference

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
    ((3, 1, 7), 1, 1),            # a single channel
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = (1, 2, 4, 8)
BITS_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}  # integer views that compare bit patterns


def sample(shape, dtype, device, offset=0.0, nonfinite=False):
    x = torch.randn(shape, device=device) * 3 + offset
    x = x * torch.rand(shape, device=device).pow(4) * 10  # uneven ranges, some outliers
    if nonfinite:
        flat = x.view(-1)
        index = torch.randperm(flat.numel(), device=device)[:max(3, flat.numel() // 50)]
        flat[index[0::3]] = float('nan')
        flat[index[1::3]] = float('inf')
        flat[index[2::3]] = float('-inf')
    return x.to(dtype)


def reference_observe(x, lower, span, seen, group_dim, group_size, decay):
    lo, hi = group_min_max(x, group_dim, group_size)
    return ema_update(lower, span, seen, lo, hi, decay)


def check_codes(k, x, lower, scale, bits, dim, group_size, stochastic, counter):
    """The kernel's codes (one per byte and packed) and decoded values == the reference's."""
    spec = QuantSpec(bits=bits, group_dim=dim, group_size=group_size, stochastic=stochastic)
    codes = k.quantize(x, lower, scale, bits, dim, group_size, stochastic, counter)
    want = quantize_reference(x, lower, scale, spec, dim, counter)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert torch.equal(codes, want), (bits, stochastic, (codes != want).sum())
    packed = k.quantize(x, lower, scale, bits, dim, group_size, stochastic, counter, pack=True)
    assert torch.equal(packed.view(-1), pack_bits(want, bits))
    assert torch.equal(packed, quantize_packed_reference(x, lower, scale, spec, dim, counter))
    for out_dtype in {x.dtype, torch.float32}:
        meta = Packed(packed, lower, scale, x.shape, x.dtype, bits, dim, group_size)
        got = k.dequantize(codes, lower, scale, dim, group_size, out_dtype)
        assert got.dtype == out_dtype
        assert torch.equal(got, dequantize_reference(codes, meta, out_dtype))
        got = k.dequantize(packed, lower, scale, dim, group_size, out_dtype, bits=bits,
                           shape=x.shape)
        assert torch.equal(got, dequantize_packed_reference(meta, out_dtype))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS)
def test_kernels_match_reference(shape, group_dim, group_size, dtype, device):
    k = kernels()
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    state = {name: [torch.zeros(groups, device=device), torch.zeros(groups, device=device),
                    torch.zeros(groups, dtype=torch.bool, device=device)]
             for name in ('kernel', 'reference')}
    for step in range(3):
        x = sample(shape, dtype, device, offset=step, nonfinite=step > 0)
        if step == 0 and groups > 1:  # a group with no finite value stays unseen
            x.narrow(dim, 0, min(group_size, shape[dim])).fill_(float('nan'))
        cover = k.observe(x, *state['kernel'], dim, group_size, 0.9)
        cover_ref = reference_observe(x, *state['reference'], dim, group_size, 0.9)
        assert torch.equal(cover, cover_ref), (step, cover, cover_ref)
        for got, want in zip(state['kernel'], state['reference']):
            assert torch.equal(got, want), (step, got, want)

        lower, span, _ = state['reference']
        for bits in BITS:
            scale = scale_from_span(span, bits)
            for stochastic in (False, True):
                check_codes(k, x, lower, scale, bits, dim, group_size, stochastic,
                            (0x0123_4567_89AB_CDEF + step, 1000 * step + bits))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('shape, group_dim', [((4, 64, 28, 28), 1), ((4, 784, 96), -1)])
def test_kernels_match_reference_across_threads(shape, group_dim, device, two_threads):
    """Large enough for several threads' shares; odd offsets at a block boundary."""
    k = kernels()
    x = sample(shape, torch.float32, device, nonfinite=True)
    dim = group_dim % len(shape)
    groups = shape[dim]
    state = [torch.zeros(groups, device=device), torch.zeros(groups, device=device),
             torch.zeros(groups, dtype=torch.bool, device=device)]
    ref = [t.clone() for t in state]
    assert torch.equal(k.observe(x, *state, dim, 1, 0.9), reference_observe(x, *ref, dim, 1, 0.9))
    scale = scale_from_span(ref[1], 8)
    for bits in (2, 8):
        check_codes(k, x, ref[0], scale_from_span(ref[1], bits), bits, dim, 1, True,
                    (2 ** 64 - 3, 2 ** 64 - 5))
    check_codes(k, x, ref[0], scale, 8, dim, 1, False, None)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS + [((0, 8), 1, 4)])
def test_fused_observe_quantize_matches_its_two_kernels(shape, group_dim, group_size, dtype,
                                                       device):
    """The op that observes and quantizes in one call (every ``pack``) gives the codes, affine
    and running estimates of ``observe`` then ``quantize``, both roundings, every width, packed
    or not."""
    k = kernels()
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    for bits, stochastic, pack in [(8, True, True), (8, False, False), (4, True, True),
                                   (2, False, True), (1, True, False), (2, True, False)]:
        states = [[torch.zeros(groups, device=device), torch.zeros(groups, device=device),
                   torch.zeros(groups, dtype=torch.bool, device=device)] for _ in range(2)]
        for step in range(3):
            x = sample(shape, dtype, device, offset=step, nonfinite=step > 0)
            if step == 0 and groups > 1:  # a group with no finite value stays unseen
                x.narrow(dim, 0, min(group_size, shape[dim])).fill_(float('nan'))
            counter = (0x0123_4567_89AB_CDEF + step, 2 ** 32 - 7 + 1000 * step)
            args = (dim, group_size, 0.9, bits, stochastic, pack, counter)
            fused = k.observe_quantize(x, *states[0], *args)
            separate = k.observe_then_quantize(x, *states[1], *args)
            for got, want in zip(fused, separate):
                assert torch.equal(got, want), (bits, stochastic, pack, step)
            for got, want in zip(*states):
                assert torch.equal(got, want), (bits, stochastic, pack, step)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('stochastic', [False, True])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
def test_fused_standardized_pack_matches_the_torch_path(dtype, stochastic, device):
    """``pack_standardized`` through the kernels (one op: the range observed in the normalized
    values, x coded over it mapped back) == its torch path, codes, affine and estimates."""
    shape = (4, 6, 5, 7)
    quantizers = {name: ActivationQuantizer(QuantSpec(group_dim=1, stochastic=stochastic,
                                                      backend=name)).to(device)
                  for name in ('auto', 'torch')}
    for step in range(3):
        x = sample(shape, dtype, device, offset=step, nonfinite=step == 2)
        x[:, 2] = 0.5  # a constant channel: zero span
        finite = torch.where(x.isfinite(), x, 0).float()
        mean = finite.mean((0, 2, 3), keepdim=True)
        rstd = torch.rsqrt(finite.var((0, 2, 3), correction=0, keepdim=True) + 1e-5)
        packed = {}
        for name, q in quantizers.items():
            reset_rounding_generators()
            packed[name] = q.pack_standardized(x, mean.to(dtype), rstd.to(dtype))
        for got, want in zip(packed['auto'].tensors(), packed['torch'].tensors()):
            assert torch.equal(got, want), step
        # the same but the backend
        assert replace(packed['auto'], backend='torch').meta() == packed['torch'].meta()
        for name in ('lower', 'span', 'seen'):
            assert torch.equal(getattr(quantizers['auto'], name),
                               getattr(quantizers['torch'], name))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('stochastic', [False, True])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize('shape, group_size, bits', [((4, 9, 37), 1, 8), ((3, 5, 96), 8, 8),
                                                      ((70, 1030), 3, 8), ((5, 33), 4, 4)])
def test_row_standardized_pack_matches_the_torch_path(shape, group_size, bits, dtype, stochastic,
                                                      device):
    """``pack(x, row_moments=(mean, rstd))`` through the kernels (each value standardized by its
    token's moments as it is read, in both passes) == the torch path, which builds the fp32
    ``(x - mean) * rstd`` and packs it: codes, affine and estimates, over steps with non-finite
    values, at one and two threads (the largest shape splits the rows between them)."""
    quantizers = {name: ActivationQuantizer(QuantSpec(bits=bits, group_dim=-1,
                                                      group_size=group_size,
                                                      stochastic=stochastic,
                                                      backend=name)).to(device)
                  for name in ('auto', 'torch')}
    threads = torch.get_num_threads()
    try:
        for step in range(3):
            torch.set_num_threads(1 + step % 2)
            x = sample(shape, dtype, device, offset=step, nonfinite=step == 2)
            finite = torch.where(x.isfinite(), x, 0).float()
            mean = finite.mean(-1, keepdim=True)
            rstd = torch.rsqrt(finite.var(-1, correction=0, keepdim=True) + 1e-5)
            packed = {}
            for name, q in quantizers.items():
                reset_rounding_generators()
                packed[name] = q.pack(x, row_moments=(mean, rstd))
            assert packed['auto'].dtype == torch.promote_types(dtype, torch.float32)
            for got, want in zip(packed['auto'].tensors(), packed['torch'].tensors()):
                assert torch.equal(got, want), step
            for name in ('lower', 'span', 'seen'):
                assert torch.equal(getattr(quantizers['auto'], name),
                                   getattr(quantizers['torch'], name))
    finally:
        torch.set_num_threads(threads)


@requires_build
def test_row_standardized_pack_refuses_moments_of_another_shape():
    """The op names what is wrong: rows=True without moments, or not one per row."""
    x = torch.randn(6, 16)
    lower, span, seen = torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.bool)
    op = torch.ops.mmseg_mesa.observe_quantize
    with pytest.raises(RuntimeError, match='needs a mean and an rstd per row'):
        op(x, lower, span, seen, None, None, 1, 8, 0.9, 8, False, 0, 0, True, True)
    with pytest.raises(RuntimeError, match='one value per row'):
        op(x, lower, span, seen, torch.zeros(5), torch.ones(5), 1, 8, 0.9, 8, False, 0, 0, True,
           True)


@requires_build
@pytest.mark.parametrize('shape', [(0,), (1,), (7,), (8,), (9,), (3, 5, 7), (4, 64, 33, 31)])
def test_mask_kernels_match_bitpack(shape):
    """The CPU mask kernels (``PackedMask`` on CPU) write and read bitpack's 1-bit layout."""
    from mmseg_mesa.bitpack import pack_mask, unpack_mask
    from mmseg_mesa.saved import PackedMask
    k = kernels()
    mask = torch.rand(shape) > 0.3
    data = k.pack_mask(mask)
    assert torch.equal(data, pack_mask(mask))
    assert torch.equal(k.unpack_mask(data, mask.shape), mask)
    assert torch.equal(unpack_mask(data, mask.shape), mask)
    saved = PackedMask.of(mask)
    assert torch.equal(saved.data, data) and torch.equal(saved.unpack(), mask)
    with pytest.raises(RuntimeError, match='mask must be bool'):
        k.pack_mask(mask.to(torch.uint8))
    with pytest.raises(RuntimeError, match='takes'):
        k.unpack_mask(torch.zeros(data.numel() + 1, dtype=torch.uint8), mask.shape)


def special_values(shape, dtype):
    """Random values of ``shape`` with zeros of both signs, NaN and infinities mixed in."""
    x = torch.randn(shape, dtype=torch.float64)
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, float('nan'), float('inf'), -float('inf'), 1e-300])
    flat[::5] = specials.repeat(-(-flat[::5].numel() // 6))[:flat[::5].numel()]
    return x.to(dtype)


@requires_build
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(0,), (1,), (7,), (8,), (9,), (3, 5, 7), (4, 64, 33, 31)])
def test_relu_mask_kernels(shape, dtype):
    """``pack_positive`` is ``pack_mask(x > 0)`` (NaN is not positive); ``mask_select`` is
    ``torch.where(mask, values, 0)`` bit for bit (NaN kept, +0 where the mask is clear)."""
    from mmseg_mesa.bitpack import pack_mask
    from mmseg_mesa.saved import PackedMask
    k = kernels()
    x = special_values(shape, dtype)
    data = k.pack_positive(x)
    assert torch.equal(data, pack_mask(x > 0))
    assert torch.equal(PackedMask.positive(x).data, data)
    values = special_values(shape, dtype).flip(-1) if x.dim() else x
    want = torch.where(x > 0, values, 0)
    got = k.mask_select(values, data)
    assert got.dtype == dtype and got.shape == values.shape
    assert torch.equal(got.view(-1).view(BITS_OF[dtype]), want.view(-1).view(BITS_OF[dtype]))
    assert torch.equal(PackedMask.positive(x).select(values).view(-1).view(BITS_OF[dtype]),
                       want.view(-1).view(BITS_OF[dtype]))
    written = values.clone()
    k.mask_select_(written, data)  # in place
    assert torch.equal(written.view(-1).view(BITS_OF[dtype]), want.view(-1).view(BITS_OF[dtype]))
    written = values.clone()
    assert PackedMask.positive(x).select_(written) is written
    assert torch.equal(written.view(-1).view(BITS_OF[dtype]), want.view(-1).view(BITS_OF[dtype]))
    if x.dim() == 4:  # channels last: the mask in the map's own order, written through it
        last = torch.channels_last
        mask = PackedMask.positive(x.contiguous(memory_format=last))
        assert mask.order is not None
        written = values.contiguous(memory_format=last)
        assert mask.select_(written) is written
        assert written.is_contiguous(memory_format=last)
        assert torch.equal(written.contiguous().view(-1).view(BITS_OF[dtype]),
                           want.view(-1).view(BITS_OF[dtype]))
    with pytest.raises(RuntimeError, match='must be float32'):
        k.pack_positive(x.to(torch.int32))
    with pytest.raises(RuntimeError, match='take'):
        k.mask_select(values, torch.zeros(data.numel() + 1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match='contiguous'):
        k.mask_select(torch.zeros(4, 3).t(), torch.zeros(2, dtype=torch.uint8))


def test_relu_mask_without_kernels(monkeypatch):
    """Where no kernel runs (other devices, no extension), ``PackedMask`` computes the same with
    torch ops."""
    import mmseg_mesa.saved as saved
    x = special_values((5, 13), torch.float32)
    values = torch.randn(5, 13)
    with_kernels = saved.PackedMask.positive(x)
    monkeypatch.setattr(saved, '_mask_backend', lambda t: REFERENCE)
    plain = saved.PackedMask.positive(x)
    assert torch.equal(plain.data, with_kernels.data)
    assert torch.equal(plain.select(values), torch.where(x > 0, values, 0))


PORTABLE_MASK = """
import sys, torch
from mmseg_mesa import kernels
assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'
torch.save(kernels.pack_positive(torch.load(sys.argv[1])), sys.argv[2])
"""


def on_the_portable_path(tmp_path, script: str, x: torch.Tensor) -> torch.Tensor:
    """What ``script`` (reading ``x`` from ``argv[1]``, writing its result to ``argv[2]``)
    computes in a process under ATEN_CPU_CAPABILITY=default: the kernels' portable loops."""
    import os
    torch.save(x, tmp_path / 'x.pt')
    (tmp_path / 'script.py').write_text(script)
    env = dict(os.environ, ATEN_CPU_CAPABILITY='default')
    result = subprocess.run([sys.executable, str(tmp_path / 'script.py'), str(tmp_path / 'x.pt'),
                             str(tmp_path / 'out.pt')], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return torch.load(tmp_path / 'out.pt')


@pytest.mark.slow
@requires_build
def test_positive_mask_is_the_same_on_the_portable_path(tmp_path):
    """``pack_positive`` compares eight floats at a time with AVX2 where torch's CPU capability
    allows; under ATEN_CPU_CAPABILITY=default the portable loop gives the same bits."""
    x = special_values((3, 41, 29), torch.float32)
    assert torch.equal(on_the_portable_path(tmp_path, PORTABLE_MASK, x),
                       kernels().pack_positive(x))


PORTABLE_DRAWS = """
import sys, torch
from mmseg_mesa import kernels
assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'
x = torch.load(sys.argv[1])
lower, scale = torch.zeros(x.shape[1]), torch.full((x.shape[1],), 1 / 7)
codes = kernels.quantize(x, lower, scale, 8, 1, 1, True, (2 ** 64 - 3, 2 ** 32 - 9))
torch.save(codes, sys.argv[2])
"""


@pytest.mark.slow
@requires_build
def test_stochastic_rounding_draws_the_same_on_the_portable_path(tmp_path):
    """Where torch's CPU capability is AVX2 the draws are made eight blocks at a time with AVX2,
    sixteen with AVX-512 where it is AVX512; under ATEN_CPU_CAPABILITY=default the portable loop
    makes them. Same codes, across the counter's 32-bit carry."""
    x = torch.randn(4, 37, 41, 29)
    portable = on_the_portable_path(tmp_path, PORTABLE_DRAWS, x)
    k = kernels()
    lower, scale = torch.zeros(37), torch.full((37,), 1 / 7)
    counter = (2 ** 64 - 3, 2 ** 32 - 9)
    codes = k.quantize(x, lower, scale, 8, 1, 1, True, counter)
    assert torch.equal(codes, portable)
    spec = QuantSpec(group_dim=1, stochastic=True)
    assert torch.equal(codes, quantize_reference(x, lower, scale, spec, 1, counter))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('shape', [(0, 8), (3, 0, 5), (2, 8, 0)])
def test_empty_tensors(shape, device):
    k = kernels()
    x = torch.empty(shape, device=device)
    groups = -(-shape[1] // 4) if shape[1] else 0
    lower, span = torch.full((groups,), 1.0, device=device), torch.full((groups,), 2.0,
                                                                        device=device)
    seen = torch.zeros(groups, dtype=torch.bool, device=device)
    cover = k.observe(x, lower, span, seen, 1, 4, 0.9)
    assert torch.equal(cover, torch.stack([lower, span]))
    for bits in BITS:
        codes = k.quantize(x, lower, span, bits, 1, 4, True, pack=True)
        assert codes.numel() == 0
        assert k.dequantize(codes, lower, span, 1, 4, torch.float32, bits=bits,
                            shape=x.shape).shape == x.shape


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_unaligned_input_gives_the_same_results(dtype, device):
    k = kernels()
    base = sample((1 + 6 * 37,), dtype, device)
    x = base[1:].view(6, 37)  # contiguous, but not 16-byte aligned
    lower = torch.full((5,), -2.0, device=device)
    scale = torch.full((5,), 0.05, device=device)
    for stochastic in (False, True):
        spec = QuantSpec(bits=8, group_dim=1, group_size=8, stochastic=stochastic)
        codes = k.quantize(x, lower, scale, 8, 1, 8, stochastic, (1, 2))
        assert torch.equal(codes, quantize_reference(x, lower, scale, spec, 1, (1, 2)))
    offset_codes = torch.zeros(1 + codes.numel(), dtype=torch.uint8, device=device)
    offset_codes[1:] = codes.view(-1)
    unaligned = offset_codes[1:].view(6, 37)
    assert torch.equal(k.dequantize(unaligned, lower, scale, 1, 8, dtype),
                       k.dequantize(codes, lower, scale, 1, 8, dtype))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_stochastic_rounding_is_unbiased(dtype, device):
    k = kernels()
    x = (torch.rand(64, 96, device=device) * 4 - 1).to(dtype)
    lower = torch.full((3,), -1.0, device=device)
    span = torch.full((3,), 4.0, device=device)
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


@pytest.mark.parametrize('device', DEVICES)
def test_stochastic_rounding_is_reproducible_and_leaves_global_rng_alone(device):
    k = kernels()
    x = torch.randn(33, 70, device=device, dtype=torch.float16)
    lower = torch.full((9,), -4.0, device=device)
    scale = torch.full((9,), 8 / 255, device=device)

    def draw():
        return k.quantize(x, lower, scale, 8, 1, 8, True)

    def rng_state():
        return torch.cuda.get_rng_state() if device == 'cuda' else torch.get_rng_state()

    torch.manual_seed(7)
    reset_rounding_generators()
    first, second = draw(), draw()
    after = rng_state()
    assert not torch.equal(first, second)
    torch.manual_seed(7)
    reset_rounding_generators()
    assert torch.equal(draw(), first) and torch.equal(draw(), second)
    torch.manual_seed(7)
    assert torch.equal(rng_state(), after)  # the model's stream is untouched
    own = k.quantize(x, lower, scale, 8, 1, 8, True, counter=(11, 0))
    assert torch.equal(k.quantize(x, lower, scale, 8, 1, 8, True, counter=(11, 0)), own)
    assert not torch.equal(k.quantize(x, lower, scale, 8, 1, 8, True, counter=(12, 0)), own)


@pytest.mark.parametrize('device', DEVICES)
def test_invalid_arguments_are_rejected_clearly(device):
    k = kernels()
    x = torch.randn(8, 16, device=device)
    lower, scale = torch.zeros(2, device=device), torch.ones(2, device=device)
    with pytest.raises(RuntimeError, match='must be contiguous'):
        k.quantize(x.t(), lower, scale, 8, 0, 8, False)
    with pytest.raises(RuntimeError, match=r'must have shape \(2,\)'):
        k.quantize(x, torch.zeros(3, device=device), scale, 8, 1, 8, False)
    with pytest.raises(RuntimeError, match='must be Float'):
        k.quantize(x, lower.double(), scale, 8, 1, 8, False)
    with pytest.raises(RuntimeError, match='group_dim=2 is out of range'):
        k.quantize(x, lower, scale, 8, 2, 8, False)
    with pytest.raises(RuntimeError, match='bits must be in'):
        k.quantize(x, lower, scale, 9, 1, 8, False)
    with pytest.raises(RuntimeError, match='can be packed, got bits=3'):
        k.quantize(x, lower, scale, 3, 1, 8, False, pack=True)
    with pytest.raises(RuntimeError, match='codes must be uint8'):
        k.dequantize(x, lower, scale, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match='codes hold 64 bytes, but 128 codes of 2 bits take 32'):
        k.dequantize(torch.zeros(64, dtype=torch.uint8, device=device), lower, scale, 1, 8,
                     torch.float32, bits=2, shape=x.shape)
    with pytest.raises(RuntimeError, match='x must be float32'):
        k.quantize(x.int(), lower, scale, 8, 1, 8, False)
    with pytest.raises(RuntimeError, match='seen must be Bool'):
        k.observe(x, lower, scale, torch.zeros(2, device=device), 1, 8, 0.9)
    with pytest.raises(ValueError, match='need the shape'):
        k.dequantize(torch.zeros(32, dtype=torch.uint8, device=device), lower, scale, 1, 8,
                     torch.float32, bits=2)
    state = (lower.clone(), scale.clone(), torch.zeros(2, dtype=torch.bool, device=device))
    with pytest.raises(RuntimeError, match='bits must be in'):
        k.observe_quantize(x, *state, 1, 8, 0.9, 0, False)
    with pytest.raises(RuntimeError, match='mean and rstd are given together'):
        k.observe_quantize(x, *state, 1, 8, 0.9, 8, False, mean=lower)
    with pytest.raises(RuntimeError, match=r'rstd must have shape \(2,\)'):
        k.observe_quantize(x, *state, 1, 8, 0.9, 8, False, mean=lower,
                           rstd=torch.ones(3, device=device))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('stochastic', [False, True])
@pytest.mark.parametrize('bits', [1, 2, 4, 8])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_activation_quantizer_kernels_match_torch(bits, dtype, stochastic, device):
    shape, group_dim = (4, 3, 49, 49), 1
    backend = 'cuda' if device == 'cuda' else 'auto'
    quantizers = {name: ActivationQuantizer(QuantSpec(
        bits=bits, group_dim=group_dim, group_size=1, stochastic=stochastic, ema_decay=0.9,
        backend=name)).to(device) for name in (backend, 'torch')}
    for step in range(3):
        x = sample(shape, dtype, device, offset=step, nonfinite=step == 2)
        packed = {}
        for name, q in quantizers.items():
            reset_rounding_generators()  # both draw from the start of the stream
            packed[name] = q.pack(x)
        for name in ('lower', 'span', 'seen'):
            assert torch.equal(getattr(quantizers[backend], name),
                               getattr(quantizers['torch'], name))
        assert torch.equal(packed[backend].data, packed['torch'].data)
        assert torch.equal(unpack(packed[backend]), unpack(packed['torch']))
        assert torch.equal(unpack(packed[backend], torch.float32),
                           unpack(packed['torch'], torch.float32))


@pytest.mark.parametrize('device', DEVICES)
def test_activation_quantizer_stochastic_stays_within_one_step(device):
    backend = 'cuda' if device == 'cuda' else 'auto'
    q = ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=32, stochastic=True,
                                      backend=backend)).to(device)
    x = torch.randn(64, 96, device=device)
    packed = q.pack(x)
    step = packed.scale.repeat_interleave(32)
    assert ((unpack(packed) - x).abs() <= step * (1 + 1e-5)).all()


# ---------------------------------------------------------------- CUDA against CPU

@requires_build
@requires_cuda
@pytest.mark.parametrize('stochastic', [False, True])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS)
def test_cuda_and_cpu_kernels_give_the_same_codes(shape, group_dim, group_size, dtype,
                                                  stochastic):
    k = kernels()
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    x = sample(shape, dtype, 'cuda', nonfinite=True)
    lower = torch.randn(groups, device='cuda') - 3
    for bits in BITS:
        scale = torch.rand(groups, device='cuda') * 6 / (2 ** bits - 1) + 1e-3
        args = (bits, dim, group_size, stochastic, (0xFEED_FACE_CAFE_BEEF, 12345), True)
        on_gpu = k.quantize(x, lower, scale, *args)
        on_cpu = k.quantize(x.cpu(), lower.cpu(), scale.cpu(), *args)
        assert torch.equal(on_gpu.cpu(), on_cpu), (bits, (on_gpu.cpu() != on_cpu).sum())
        decoded = k.dequantize(on_gpu, lower, scale, dim, group_size, dtype, bits=bits,
                               shape=x.shape)
        assert torch.equal(decoded.cpu(), k.dequantize(on_cpu, lower.cpu(), scale.cpu(), dim,
                                                       group_size, dtype, bits=bits,
                                                       shape=x.shape))


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


@pytest.mark.parametrize('shape, channel_dim', [((2, 16, 19, 13), 1), ((8, 49, 32), -1)])
def test_division_auto_backend_matches_torch_on_cpu(shape, channel_dim):
    from mmseg_mesa.division import DivisionCompressor, DivisionSpec
    x = torch.randn(shape)
    packed = {backend: DivisionCompressor(DivisionSpec(
        bits=2, channel_dim=channel_dim, stochastic=False, backend=backend)).pack(x)
        for backend in ('auto', 'torch')}
    assert torch.equal(packed['auto'].lfc, packed['torch'].lfc)
    assert torch.equal(packed['auto'].hfc.data, packed['torch'].hfc.data)
    assert torch.equal(unpack(packed['auto']), unpack(packed['torch']))
