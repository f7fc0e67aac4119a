"""The CUDA kernels of ``csrc/mesa_kernels.cu``, executed on the CPU by the emulator in
``tests/cuda_emu`` and held bit for bit to the CPU kernels and to ``reference.py``.

No GPU is needed: every test here runs everywhere. The emulator runs the file's host entry
points and every ``__global__`` kernel as written (launch shapes, warp shuffles, atomics, grid-
stride loops, tails), each CUDA thread a fiber and blocks spread over several OS threads. It
cannot check the device branch of ``mesa_numerics.h``, speed, or memory ordering weaker than
sequential consistency; tests/test_extension.py runs the real kernels where a GPU is visible.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_emu import build as emu_build

from mmseg_mesa import _backend, kernels, selfcheck
from mmseg_mesa.bitpack import pack_bits
from mmseg_mesa.quantizer import Packed, QuantSpec, ema_update, group_min_max, scale_from_span
from mmseg_mesa.reference import (
    REFERENCE,
    channel_view,
    dequantize_packed_reference,
    dequantize_reference,
    dequantize_refined_reference,
    norm_terms_reference,
    quantize_packed_reference,
    quantize_reference,
    refine_reference,
)

SANITIZED = os.environ.get('MESA_EMU_SANITIZE') == '1'
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def emu():
    ops = emu_build.load(sanitize=SANITIZED)
    yield ops
    ops.configure(8, 2)


@pytest.fixture(scope='module')
def cpu():
    module, error = _backend.load_extension()
    assert module is not None, error
    return torch.ops.mmseg_mesa


# Emulated machines: (multiprocessors, OS threads running blocks). One SM makes the grid-stride
# loops and row strides run several times; several threads make the atomics race.
MACHINES = [(1, 1), (3, 2), (8, 4)]

LAYOUTS = [  # shape, group_dim, group_size
    ((4, 37), -1, 8),             # the last group has 5 channels; groups straddle warps
    ((2, 37, 3, 5), 1, 8),        # a group spans 120 columns: several warps, a partial block
    ((3, 5, 4, 6), -1, 1),        # several groups in a warp
    ((1, 45), -1, 1),             # a group per element
    ((45,), 0, 1),                # a group per element, 1-d
    ((7, 40), 1, 24),             # groups of 24 across 32-lane warps, one partial warp
    ((1,), 0, 1),                 # one element
    ((1001,), 0, 3),              # a single row
    ((8, 3, 49, 49), 1, 1),       # attention map, a group per head
    ((16, 49, 96), -1, 32),       # Swin hidden features
    ((5, 7), 0, 100),             # one group larger than the channel count
    ((3, 1, 7), 1, 1),            # a single channel
    ((600, 2), -1, 1),            # many short rows: several blocks along the rows
    ((2, 300, 70), 1, 1),         # 42000 elements: at one SM, the grid-stride loops repeat
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = (1, 2, 4, 8)
SEED_AND_OFFSET = [(0x0123_4567_89AB_CDEF, 1000), (2 ** 64 - 3, 2 ** 32 - 9)]


def _int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def sample(shape, dtype, step):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(shape, generator=generator) * 3 + step
    x = x * torch.rand(shape, generator=generator).pow(4) * 10  # uneven ranges, outliers
    if step > 0 and x.numel() > 3:  # NaN and +-inf among the values
        flat = x.view(-1)
        index = torch.randperm(flat.numel(), generator=generator)[:max(3, flat.numel() // 50)]
        flat[index[0::3]] = float('nan')
        flat[index[1::3]] = float('inf')
        flat[index[2::3]] = float('-inf')
    return x.to(dtype)


def fresh_state(groups):
    return [torch.zeros(groups), torch.zeros(groups), torch.zeros(groups, dtype=torch.bool)]


def assert_codes_agree(emu, cpu, x, lower, span, dim, group_size, bit_widths=BITS):
    """Codes (one per byte and packed) and decoded values: emulated CUDA == CPU == reference."""
    for bits in bit_widths:
        scale = scale_from_span(span, bits)
        for stochastic in (False, True):
            for seed, offset in SEED_AND_OFFSET[:1 + (stochastic and bits == 8)]:
                args = (bits, dim, group_size, stochastic, _int64(seed), _int64(offset))
                counter = (seed, offset)
                spec = QuantSpec(bits=bits, group_dim=dim, group_size=group_size,
                                 stochastic=stochastic)
                codes = emu.quantize(x, lower, scale, *args, False)
                assert torch.equal(codes, cpu.quantize(x, lower, scale, *args, False))
                assert torch.equal(codes, quantize_reference(x, lower, scale, spec, dim, counter))
                if bits < 8:
                    packed = emu.quantize(x, lower, scale, *args, True)
                    assert torch.equal(packed, cpu.quantize(x, lower, scale, *args, True))
                    assert torch.equal(packed.view(-1), pack_bits(codes, bits))
                    assert torch.equal(packed, quantize_packed_reference(x, lower, scale, spec,
                                                                         dim, counter))
                else:
                    packed = codes
                meta = Packed(packed, lower, scale, x.shape, x.dtype, bits, dim, group_size)
                for out_dtype in {x.dtype, torch.float32}:
                    got = emu.dequantize(packed, lower, scale, bits, list(x.shape), dim,
                                         group_size, out_dtype)
                    assert got.dtype == out_dtype
                    assert torch.equal(got, cpu.dequantize(packed, lower, scale, bits,
                                                           list(x.shape), dim, group_size,
                                                           out_dtype))
                    want = (dequantize_packed_reference(meta, out_dtype) if bits < 8 else
                            dequantize_reference(codes, meta, out_dtype))
                    assert torch.equal(got, want)
                    # rows (the first dim's) divided by their own values before the cast
                    divisor = torch.rand(x.shape[0]) * 4 + 0.01
                    got = emu.dequantize(packed, lower, scale, bits, list(x.shape), dim,
                                         group_size, out_dtype, divisor)
                    assert torch.equal(got, cpu.dequantize(packed, lower, scale, bits,
                                                           list(x.shape), dim, group_size,
                                                           out_dtype, divisor))
                    assert torch.equal(got, REFERENCE.dequantize(
                        packed, lower, scale, dim, group_size, out_dtype, bits, x.shape, divisor))


def observe_three(emu, cpu, x_of_step, dim, group_size, groups):
    """Three observe steps (the first with an all-NaN group), emulated == CPU == reference."""
    states = {name: fresh_state(groups) for name in ('emu', 'cpu', 'ref')}
    for step in range(3):
        x = x_of_step(step)
        cover = emu.observe(x, *states['emu'], dim, group_size, 0.9)
        assert torch.equal(cover, cpu.observe(x, *states['cpu'], dim, group_size, 0.9))
        lo, hi = group_min_max(x, dim, group_size)
        assert torch.equal(cover, ema_update(*states['ref'], lo, hi, 0.9)), step
        for got, *wants in zip(states['emu'], states['cpu'], states['ref']):
            assert all(torch.equal(got, want) for want in wants), (step, got, wants)
        yield x, states['ref']


@pytest.mark.parametrize('machine', MACHINES, ids=lambda m: f'{m[0]}sm-{m[1]}w')
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS)
def test_emulated_kernels_match_cpu_and_reference(emu, cpu, shape, group_dim, group_size,
                                                   machine):
    emu.configure(*machine)
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    # Every dtype on one machine; on the others (and for the largest layouts) fewer.
    large = math.prod(shape) > 20000
    dtypes = (DTYPES[:2] if large else DTYPES) if machine == MACHINES[0] else DTYPES[::3]

    for dtype in dtypes:
        def x_of_step(step, dtype=dtype):
            x = sample(shape, dtype, step)
            if step == 0 and groups > 1:  # a group with no finite value stays unseen
                x.narrow(dim, 0, min(group_size, shape[dim])).fill_(float('nan'))
            return x

        for step, (x, (lower, span, _)) in enumerate(
                observe_three(emu, cpu, x_of_step, dim, group_size, groups)):
            if step > 0:  # the range of step 0 leaves a group unseen; later steps see NaN, inf
                widths = BITS if step == 2 or x.numel() < 20000 else (8,)
                assert_codes_agree(emu, cpu, x, lower, span, dim, group_size, widths)


PACKS = [(8, True, False), (8, False, False), (4, True, True), (2, False, True),
         (1, True, True)]  # bits, stochastic, pack


@pytest.mark.parametrize('standardized', [None, 'groups', 'rows'])
@pytest.mark.parametrize('machine', MACHINES[::2], ids=lambda m: f'{m[0]}sm-{m[1]}w')
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS[:8] + LAYOUTS[-2:])
def test_emulated_observe_quantize_matches_cpu(emu, cpu, shape, group_dim, group_size, machine,
                                                standardized):
    """A pack in one op (memset, range + EMA + affines, quantize): codes, affine and estimates
    equal the CPU op's, plain, standardized per group (``pack_standardized``) or per row of the
    (rows, channels * inner) view (``pack(row_moments=...)``)."""
    emu.configure(*machine)
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    generator = torch.Generator().manual_seed(groups)
    mean = rstd = None
    moments = {None: 0, 'groups': groups, 'rows': math.prod(shape[:dim])}[standardized]
    if standardized:
        mean = torch.randn(moments, generator=generator)
        rstd = torch.rand(moments, generator=generator) * 3 + 0.01
    large = math.prod(shape) > 20000
    for dtype in (DTYPES[:1 + 3 * (not large)] if machine == MACHINES[0] else DTYPES[:1]):
        for bits, stochastic, pack in PACKS[:2 + 3 * (not large)]:
            states = {name: fresh_state(groups) for name in ('emu', 'cpu')}
            for step in range(3):
                x = sample(shape, dtype, step)
                if step == 0 and groups > 1:
                    x.narrow(dim, 0, min(group_size, shape[dim])).fill_(float('nan'))
                args = (mean, rstd, dim, group_size, 0.9, bits, stochastic, _int64(2 ** 64 - 3),
                        1000 * step, pack, standardized == 'rows')
                got = emu.observe_quantize(x, *states['emu'], *args)
                want = cpu.observe_quantize(x, *states['cpu'], *args)
                # laid out as the CPU op's (and the fake kernel's): three tensors of their own
                assert [(t.stride(), t.storage_offset()) for t in got] == [
                    (t.stride(), t.storage_offset()) for t in want]
                assert got[1].untyped_storage().data_ptr() != got[2].untyped_storage().data_ptr()
                for a, b in zip(got + tuple(states['emu']), want + tuple(states['cpu'])):
                    assert torch.equal(a, b), (dtype, bits, stochastic, pack, step)


@pytest.mark.parametrize('standardized', [False, True])
@pytest.mark.parametrize('machine', MACHINES[::2], ids=lambda m: f'{m[0]}sm-{m[1]}w')
@pytest.mark.parametrize('shape, group_dim, group_size', LAYOUTS)
def test_emulated_refine_matches_cpu_and_reference(emu, cpu, shape, group_dim, group_size,
                                                   machine, standardized):
    """Refined codes in one op each way (``quantizer.refine``, ``unpack`` of ``Refined``): the
    fine codes, their lower and scale, and both decoded, emulated == CPU == reference; NaN and
    infinities among the values, standardized (``pack_standardized``) or not."""
    emu.configure(*machine)
    dim = group_dim % len(shape)
    groups = -(-shape[dim] // group_size)
    generator = torch.Generator().manual_seed(groups + 1)
    mean = rstd = None
    if standardized:
        mean = torch.randn(groups, generator=generator)
        rstd = torch.rand(groups, generator=generator) * 3 + 0.01
    large = math.prod(shape) > 20000
    for dtype in (DTYPES[:1] if large else DTYPES):
        x = sample(shape, dtype, 1)
        values = x.float() if mean is None else (
            (x.float() - channel_view(mean, shape[dim], group_size, dim, x.dim()))
            * channel_view(rstd, shape[dim], group_size, dim, x.dim()))
        lo, hi = group_min_max(values, dim, group_size)
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        lower = torch.where(finite, lo, 0.0)
        scale = scale_from_span(torch.where(finite, hi - lo, 0.0), 8)
        spec = QuantSpec(bits=8, group_dim=dim, group_size=group_size, stochastic=True)
        codes = quantize_reference(values, lower, scale, spec, dim, (5, 7))
        got = emu.refine(x, codes, lower, scale, mean, rstd, dim, group_size)
        want = refine_reference(x, codes, lower, scale, dim, group_size, mean, rstd)
        for a, b, c in zip(got, cpu.refine(x, codes, lower, scale, mean, rstd, dim, group_size),
                           want):
            assert torch.equal(a, b) and torch.equal(a, c), dtype
        fine, fine_lower, fine_scale = got
        for out_dtype in {dtype, torch.float32}:
            args = (codes, fine, lower, scale, fine_lower, fine_scale, list(shape), dim,
                    group_size, out_dtype)
            decoded = emu.dequantize_refined(*args)
            assert decoded.dtype == out_dtype
            assert torch.equal(decoded, cpu.dequantize_refined(*args))
            assert torch.equal(decoded, dequantize_refined_reference(
                codes, fine, lower, scale, fine_lower, fine_scale, dim, group_size, out_dtype,
                torch.Size(shape)))
        # what the fine codes buy: within a fine step of the values the codes cover
        near = torch.isfinite(values) & (values >= channel_view(lower, shape[dim], group_size,
                                                                dim, x.dim()))
        error = (dequantize_refined_reference(codes, fine, lower, scale, fine_lower, fine_scale,
                                              dim, group_size, torch.float32,
                                              torch.Size(shape)) - values)[near].abs()
        step = channel_view(fine_scale, shape[dim], group_size, dim, x.dim()).expand(shape)
        assert (error <= step[near] * 0.5001 + 1e-6 * values[near].abs()).all()


@pytest.mark.parametrize('machine', MACHINES, ids=lambda m: f'{m[0]}sm-{m[1]}w')
@pytest.mark.parametrize('channels', [1, 37, 300, 5000])
def test_emulated_norm_terms_match_cpu_and_reference(emu, cpu, machine, channels):
    """BatchNorm's per-channel backward terms: emulated == CPU == reference, variances on both
    sides of the reliable bound (and below 0 by rounding), with and without a weight."""
    emu.configure(*machine)
    generator = torch.Generator().manual_seed(channels)
    rstd = 10.0 ** (torch.rand(channels, generator=generator) * 5 - 1)
    rstd[::7] = 1 / math.sqrt(1e-5)  # variance 0: 1 - eps * rstd**2 rounds to about 0
    decoded = torch.rand(channels, generator=generator) * 2 + 1e-3
    weight = torch.randn(channels, generator=generator)
    for eps in (1e-5, 1e-3):
        for w in (None, weight):
            args = (rstd, decoded, w, eps, 1e-4)
            got = emu.norm_terms(*args)
            for a, b, c in zip(got, cpu.norm_terms(*args), norm_terms_reference(*args)):
                assert torch.equal(a, b) and torch.equal(a, c), (eps, w is None)


@pytest.mark.parametrize('dtype', DTYPES)
def test_constant_and_nonfinite_groups(emu, cpu, dtype):
    """Groups that are constant, all NaN, all +inf, only -inf and +inf, or finite with NaN."""
    emu.configure(3, 2)
    columns = [torch.full((64,), 2.5), torch.full((64,), float('nan')),
               torch.full((64,), float('inf')),
               torch.tensor([float('-inf'), float('inf')]).repeat(32),
               torch.arange(64.0).where(torch.arange(64) % 5 > 0, torch.tensor(float('nan')))]
    base = torch.stack(columns, dim=1)  # (64, 5), a group per column

    def x_of_step(step):
        return (base + step).to(dtype)

    for x, (lower, span, seen) in observe_three(emu, cpu, x_of_step, 1, 1, 5):
        assert seen.tolist() == [True, False, False, False, True]
        assert_codes_agree(emu, cpu, x, lower, span, 1, 1)


@pytest.mark.parametrize('shape', [(0, 8), (3, 0, 5), (2, 8, 0)])
def test_empty_tensors(emu, cpu, shape):
    emu.clear_launch_log()
    groups = -(-shape[1] // 4) if shape[1] else 0
    lower, span = torch.full((groups,), 1.0), torch.full((groups,), 2.0)
    seen = torch.zeros(groups, dtype=torch.bool)
    x = torch.empty(shape)
    assert torch.equal(emu.observe(x, lower, span, seen, 1, 4, 0.9), torch.stack([lower, span]))
    for bits in BITS:
        for pack in (False, True):
            codes = emu.quantize(x, lower, span, bits, 1, 4, True, 1, 2, pack and bits < 8)
            assert codes.shape == cpu.quantize(x, lower, span, bits, 1, 4, True, 1, 2,
                                               pack and bits < 8).shape
            out = emu.dequantize(codes, lower, span, bits, list(shape), 1, 4, torch.float16)
            assert out.shape == shape and out.dtype == torch.float16
    assert emu.launch_log() == []  # nothing to do launches nothing
    states = {name: [lower.clone(), span.clone(), seen.clone()] for name in ('emu', 'cpu')}
    args = (None, None, 1, 4, 0.9, 8, True, 1, 2, False)
    got = emu.observe_quantize(x, *states['emu'], *args)
    want = cpu.observe_quantize(x, *states['cpu'], *args)
    for a, b in zip(got + tuple(states['emu']), want + tuple(states['cpu'])):
        assert torch.equal(a, b)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.float64])
def test_unaligned_tensors_take_the_scalar_path_with_the_same_results(emu, cpu, dtype):
    emu.configure(2, 2)
    base = sample((1 + 6 * 37,), dtype, 1)
    x = base[1:].view(6, 37)  # contiguous, not 16-byte aligned
    lower, scale = torch.full((5,), -2.0), torch.full((5,), 0.05)
    for stochastic in (False, True):
        args = (8, 1, 8, stochastic, 1, 2, False)
        codes = emu.quantize(x, lower, scale, *args)
        assert torch.equal(codes, cpu.quantize(x, lower, scale, *args))
    shifted = torch.zeros(1 + codes.numel(), dtype=torch.uint8)
    shifted[1:] = codes.view(-1)
    unaligned = shifted[1:].view(6, 37)
    want = cpu.dequantize(codes, lower, scale, 8, [6, 37], 1, 8, dtype)
    assert torch.equal(emu.dequantize(unaligned, lower, scale, 8, [6, 37], 1, 8, dtype), want)


def test_invalid_arguments_are_refused_as_on_cpu(emu, cpu):
    x = torch.randn(8, 16)
    lower, scale = torch.zeros(2), torch.ones(2)
    seen = torch.zeros(2, dtype=torch.bool)
    cases = [
        ('quantize', (x.t(), lower, scale, 8, 0, 8, False, 0, 0, False), 'must be contiguous'),
        ('quantize', (x, torch.zeros(3), scale, 8, 1, 8, False, 0, 0, False), 'must have shape'),
        ('quantize', (x, lower, scale, 3, 1, 8, False, 0, 0, True), 'can be packed'),
        ('quantize', (x.int(), lower, scale, 8, 1, 8, False, 0, 0, False), 'x must be'),
        ('dequantize', (x, lower, scale, 8, [8, 16], 1, 8, torch.float32), 'codes must be'),
        ('dequantize', (x.byte(), lower, scale, 8, [8, 16], 1, 8, torch.float32,
                        torch.ones(3)), 'one value per row'),
        ('observe', (x, lower, scale, lower.clone(), 1, 8, 0.9), 'seen must be Bool'),
        ('observe', (x, lower, scale, seen, 2, 8, 0.9), 'out of range'),
        ('refine', (x, x, lower, scale, None, None, 1, 8), 'codes must be uint8'),
        ('refine', (x, x.byte(), lower, scale, lower, None, 1, 8), 'given together'),
        ('dequantize_refined', (x.byte(), x.byte()[:4], lower, scale, lower, scale, [8, 16],
                                1, 8, torch.float32), 'fine must be uint8'),
    ]
    for op, args, message in cases:
        for ops in (emu, cpu):
            with pytest.raises(RuntimeError, match=message):
                getattr(ops, op)(*args)


def test_first_use_check_passes_on_the_emulated_cuda_backend(emu, monkeypatch):
    """``selfcheck`` (``info --check``, ``MesaHook`` on a GPU) over the CUDA backend's Python
    wrappers and the CUDA host code and kernels, every op agreeing with the reference."""
    monkeypatch.setattr(kernels, '_ops', emu)
    emu.configure(4, 2)
    emu.clear_launch_log()
    checks = selfcheck.check_backend(kernels.CUDA, torch.device('cpu'))
    assert [check.op for check in checks] == list(selfcheck.OPS)
    assert all(check.ok for check in checks), [check for check in checks if not check.ok]
    assert set(launched(emu.launch_log())) >= kernel_names()


# ---------------------------------------------------------------- launches

def kernel_names() -> set[str]:
    return set(re.findall(r'__global__\s+void\s+(\w+)', emu_build.KERNELS.read_text()))


def launched(log) -> list[str]:
    return [name.split('<')[0] for name in log]


def test_every_kernel_and_host_entry_point_runs(emu):
    """Each ``__global__`` kernel of the file is launched by some entry point exercised here,
    and each host entry point is reachable as an emulated op."""
    emu.configure(2, 2)
    emu.clear_launch_log()
    x = sample((4, 37), torch.float32, 1)
    state = fresh_state(5)
    emu.observe(x, *state, 1, 8, 0.9)
    scale = scale_from_span(state[1], 2)
    for stochastic in (False, True):
        codes = emu.quantize(x, state[0], scale, 2, 1, 8, stochastic, 1, 2, True)
    emu.dequantize(codes, state[0], scale, 2, [4, 37], 1, 8, torch.float32)
    codes, lower, scale = emu.observe_quantize(x, *state, None, None, 1, 8, 0.9, 8, True, 1, 2,
                                               False)
    fine, fine_lower, fine_scale = emu.refine(x, codes, lower, scale, None, None, 1, 8)
    emu.dequantize_refined(codes, fine, lower, scale, fine_lower, fine_scale, [4, 37], 1, 8,
                           torch.float32)
    emu.norm_terms(scale, scale, lower, 1e-5, 1e-4)
    assert set(launched(emu.launch_log())) >= kernel_names()
    assert emu.poison_reads() == 0
    entry_points = set(re.findall(r'^\S.* (\w+)_cuda\(', emu_build.KERNELS.read_text(), re.M))
    assert entry_points == {'observe', 'quantize', 'dequantize', 'observe_quantize', 'refine',
                            'dequantize_refined', 'norm_terms'}
    assert all(hasattr(emu, name) for name in entry_points)
    assert 'cuda_version=' in emu.build_facts()


# The kernels a call launches, and the device operations beside them (docs/benchmarks.md).
LAUNCHES = {
    'observe': ['memset', 'group_min_max_kernel'],
    'observe_quantize': ['memset', 'group_min_max_kernel', 'quantize_kernel'],
    'quantize': ['quantize_kernel'],
    'dequantize': ['dequantize_kernel'],
    'refine': ['refine_kernel'],
    'dequantize_refined': ['dequantize_refined_kernel'],
    'norm_terms': ['norm_terms_kernel'],
}


@pytest.mark.parametrize('shape, group_dim, group_size', [((4, 37), 1, 8), ((2, 300, 70), 1, 1)])
def test_launches_per_op(emu, shape, group_dim, group_size):
    emu.configure(8, 2)
    x = sample(shape, torch.float32, 1)
    state = fresh_state(-(-shape[group_dim] // group_size))
    calls = {
        'observe': lambda: emu.observe(x, *state, group_dim, group_size, 0.9),
        'quantize': lambda: emu.quantize(x, state[0], scale_from_span(state[1], 8), 8,
                                         group_dim, group_size, True, 1, 2, False),
        'observe_quantize': lambda: emu.observe_quantize(x, *state, None, None, group_dim,
                                                         group_size, 0.9, 8, True, 1, 2, False),
        'dequantize': lambda: emu.dequantize(torch.zeros(shape, dtype=torch.uint8), state[0],
                                             state[1], 8, list(shape), group_dim, group_size,
                                             torch.float32),
        'refine': lambda: emu.refine(x, torch.zeros(shape, dtype=torch.uint8), state[0],
                                     state[1], None, None, group_dim, group_size),
        'dequantize_refined': lambda: emu.dequantize_refined(
            *[torch.zeros(shape, dtype=torch.uint8)] * 2, *state[:2], *state[:2], list(shape),
            group_dim, group_size, torch.float32),
        'norm_terms': lambda: emu.norm_terms(state[1] + 1, state[1] + 1, None, 1e-5, 1e-4),
    }
    for op, call in calls.items():
        emu.clear_launch_log()
        call()
        assert launched(emu.launch_log()) == LAUNCHES[op], op


# ---------------------------------------------------------------- the emulator itself

def test_emulator_reports_a_divergent_shuffle(emu):
    with pytest.raises(RuntimeError, match=r'divergence: lanes of warp 0 stopped at '
                                           r'__shfl_down_sync at .*faulty_kernels.cu:\d+'):
        emu.faulty('divergent_shuffle', torch.zeros(1))


def test_emulator_reports_a_barrier_some_threads_never_reach(emu):
    with pytest.raises(RuntimeError, match=r'deadlock: thread 32 never reaches __syncthreads '
                                           r'at .*faulty_kernels.cu:\d+ \(it exited\)'):
        emu.faulty('partial_barrier', torch.zeros(1))


def test_emulator_poisons_reads_of_lanes_outside_the_mask(emu):
    emu.clear_launch_log()
    out = emu.faulty('masked_out_read', torch.zeros(1))
    assert emu.poison_reads() == 8  # lanes 8-15 read lanes 16-23, which are not in the mask
    assert torch.equal(out[:8], torch.arange(8.0, 16.0))
    assert out[8:16].isnan().all()


@pytest.mark.parametrize('machine', MACHINES)
def test_emulator_runs_shared_memory_and_warp_reductions(emu, machine):
    emu.configure(*machine)
    x = torch.arange(1000.0)
    out = emu.faulty('block_sum', x)
    assert out[:2].tolist() == [x.sum().item()] * 2


def test_emulator_refuses_an_invalid_launch(emu):
    with pytest.raises(RuntimeError, match='invalid configuration argument'):
        emu.faulty('too_many_threads', torch.zeros(1))


@pytest.mark.slow
@pytest.mark.skipif(SANITIZED, reason='this test starts the sanitized run itself')
def test_sanitized_build_runs_clean_and_catches_an_overflow(tmp_path):
    """The kernels under AddressSanitizer and UBSan: every test of this file, then a kernel
    that writes one element past its tensor, which the sanitizer must stop."""
    # The sanitizer's runtime first, and libstdc++ before it starts, so that it finds the
    # exception functions it wraps (python itself does not link libstdc++).
    preload = ' '.join(subprocess.run(['g++', f'-print-file-name={name}'], capture_output=True,
                                      text=True, check=True).stdout.strip()
                       for name in ('libasan.so', 'libstdc++.so.6'))
    env = dict(os.environ, MESA_EMU_SANITIZE='1', LD_PRELOAD=preload,
               ASAN_OPTIONS='detect_leaks=0', UBSAN_OPTIONS='print_stacktrace=1:halt_on_error=1')
    env.pop('PYTEST_XDIST_WORKER', None)
    # The build first, so that a failure of it is not mistaken for a sanitizer's report.
    build = subprocess.run([sys.executable, '-c', 'from cuda_emu import build; '
                            'print(build.build(sanitize=True))'], cwd=ROOT / 'tests',
                           capture_output=True, text=True, timeout=600,
                           env=dict(env, LD_PRELOAD=''))
    assert build.returncode == 0, build.stderr[-3000:]
    # The machines of one SM and of eight on four threads: the middle one adds no path.
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-x',
                          '-m', 'not slow', '-k', 'not 3sm', '-p', 'no:xdist', __file__],
                         cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert 'ERROR: AddressSanitizer' not in run.stderr and 'runtime error' not in run.stderr
    assert re.search(r'\d+ passed', run.stdout)
    overflow = subprocess.run(
        [sys.executable, '-c', 'import torch; from cuda_emu import build; '
         'build.load(sanitize=True).faulty("overflow", torch.zeros(1))'],
        cwd=ROOT / 'tests', capture_output=True, text=True, timeout=300, env=env)
    assert overflow.returncode != 0
    assert 'heap-buffer-overflow' in overflow.stderr, overflow.stderr[-3000:]
