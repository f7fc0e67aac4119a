"""Hold a backend's kernels to the pure-PyTorch reference on one device, in a fraction of a
second.

The test suite holds the compiled kernels to ``reference.py`` bit for bit where it runs, but a
GPU it never ran on (another architecture, driver or PTX JIT) could code activations wrongly
without any error, and training would only drift. This check runs every op of a backend on
small tensors (every supported dtype, both roundings, codes one per byte and bit-packed,
non-finite values mixed in) on the device, compares each result with the reference's bit for
bit, and says per op whether they agree. ``python -m mmseg_mesa.info --check`` runs it on
every device; ``MesaHook`` runs ``verify_first_use`` once per process and GPU before training.

Nothing outside the check moves: its inputs come from a private generator, stochastic rounding
draws at a fixed counter (not the device's stream, ``rounding``), and the running estimates it
updates are its own.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from . import _backend, state
from ._backend import QuantBackend
from .reference import REFERENCE, scale_from_span

OPS = ('observe', 'quantize', 'dequantize', 'observe_quantize', 'refine', 'dequantize_refined',
       'norm_terms', 'pack_mask', 'unpack_mask', 'pack_positive', 'mask_select', 'mask_select_')
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# (shape, group_dim, group_size), group_dim non-negative as the backends take it: channels in
# the middle with a partial last group, channels last (the kernels' per-element pattern), and
# runs long enough for their per-run path; element counts that are not multiples of 8 leave a
# partial byte.
LAYOUTS = (((2, 5, 3, 3), 1, 2), ((3, 4, 7), 2, 3), ((2, 3, 19), 1, 1))
# (bits, pack): one code per byte at full and reduced width, and bit-packed at 4 and 1 bits.
CODES = ((8, False), (2, False), (4, True), (1, True))
# Stochastic rounding's (seed, offset): the offset crosses the low 32 bits of the counter.
COUNTER = (0x0123_4567_89AB_CDEF, 2 ** 32 - 3)
DECAY = 0.9
# A bound on the normalized variance that the norm_terms cases fall on both sides of (BatchNorm
# uses the same, ``layers.norm.RELIABLE_NORMALIZED_VARIANCE``).
RELIABLE = 1e-4
# Device types checked before training: a GPU is where kernels meet hardware the test suite may
# never have run on. The CPU kernels are checked by ``python -m mmseg_mesa.info --check``.
FIRST_USE_DEVICE_TYPES = frozenset({'cuda'})

BITS_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}  # integer views that compare floats bit for bit


@dataclass(frozen=True)
class OpCheck:
    """Whether one op of one backend agreed with the reference on one device.

    ``detail`` counts the cases when it did, and names the first case that did not (or the
    error it raised) when it did not.
    """

    op: str
    device: str
    backend: str
    ok: bool
    detail: str


class KernelMismatchError(RuntimeError):
    """The compiled kernels disagree with the reference on a device."""


@dataclass(frozen=True)
class _Case:
    label: str
    kernel: Callable[[], object]
    reference: Callable[[], object]


def available_devices() -> list[torch.device]:
    """The CPU and every visible CUDA device."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device('cpu')] + [torch.device('cuda', i) for i in range(cuda)]


def compiled_backend(device: torch.device, requested: str = 'auto') -> QuantBackend | None:
    """The compiled kernels that ``requested`` runs on ``device``, or None where the reference
    runs (nothing to check)."""
    backend, _ = _backend.choose_backend(device, requested)
    return None if backend is REFERENCE else backend


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix('torch.')


def _sample(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uneven per-element ranges with zeros of both signs, NaN and infinities mixed in."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator) * 3
    x = x * torch.rand(shape, generator=generator).pow(4) * 10
    flat = x.view(-1)
    flat[1::13] = float('nan')
    flat[4::17] = float('inf')
    flat[6::19] = -float('inf')
    flat[0], flat[2] = 0.0, -0.0
    return x.to(dtype).to(device)


def _estimates(groups: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(groups, device=device), torch.zeros(groups, device=device),
            torch.zeros(groups, dtype=torch.bool, device=device)]


def _layouts(device: torch.device
             ) -> Iterator[tuple[str, torch.Tensor, int, int, torch.Tensor, torch.Tensor]]:
    """Per layout and dtype: a label, the sample, its grouping and the range that codes it."""
    for shape, group_dim, group_size in LAYOUTS:
        for dtype in DTYPES:
            x = _sample(shape, dtype, device)
            groups = -(-shape[group_dim] // group_size)
            cover = REFERENCE.observe(x, *_estimates(groups, device), group_dim, group_size,
                                      DECAY)
            yield (f'{_name(dtype)} {tuple(shape)} group_dim={group_dim}', x, group_dim,
                   group_size, cover[0].clone(), cover[1].clone())


def _observed(observe: Callable[..., object], x: torch.Tensor, estimates: list[torch.Tensor],
              *args: object) -> tuple[torch.Tensor, ...]:
    """What ``observe`` or ``observe_quantize`` returns, then the estimates it updated."""
    out = observe(x, *estimates, *args)
    return (*(out if isinstance(out, tuple) else (out,)), *estimates)


def _observe(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, dim, size, lower, _ in _layouts(device):
        mine, theirs = _estimates(lower.numel(), device), _estimates(lower.numel(), device)
        # the first call sets the estimates, the second blends into them
        for step, values in enumerate((x, x * 2)):
            yield _Case(f'{label} step {step}',
                        partial(_observed, backend.observe, values, mine, dim, size, DECAY),
                        partial(_observed, REFERENCE.observe, values, theirs, dim, size, DECAY))


def _quantize(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, dim, size, lower, span in _layouts(device):
        for bits, pack in CODES:
            scale = scale_from_span(span, bits)
            for stochastic in (False, True):
                args = (x, lower, scale, bits, dim, size, stochastic, COUNTER, pack)
                yield _Case(f'{label} bits={bits} pack={pack} stochastic={stochastic}',
                            partial(backend.quantize, *args), partial(REFERENCE.quantize, *args))


def _dequantize(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, dim, size, lower, span in _layouts(device):
        for bits, pack in CODES:
            scale = scale_from_span(span, bits)
            codes = REFERENCE.quantize(x, lower, scale, bits, dim, size, False, None, pack)
            # codes one per byte decode as 8-bit ones, whatever width they were coded at
            args = (codes, lower, scale, dim, size, x.dtype, bits if pack else 8, x.shape)
            yield _Case(f'{label} bits={bits} pack={pack}', partial(backend.dequantize, *args),
                        partial(REFERENCE.dequantize, *args))
            # each row (here the first dim's) divided by its own value
            divisor = torch.linspace(0.25, 4, x.shape[0], device=device)
            yield _Case(f'{label} bits={bits} pack={pack} divided',
                        partial(backend.dequantize, *args, divisor),
                        partial(REFERENCE.dequantize, *args, divisor))


def _observe_quantize(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, dim, size, lower, _ in _layouts(device):
        groups = lower.numel()
        rows = x.numel() // math.prod(x.shape[dim:]) if x.numel() else 0
        standardized = (torch.linspace(-1, 1, groups, device=device),
                        torch.linspace(0.5, 2, groups, device=device), False)
        by_rows = (torch.linspace(-1, 1, rows, device=device),
                   torch.linspace(0.5, 2, rows, device=device), True)
        # each width with one rounding (``quantize`` has both): what this adds is observing
        # and coding in one call, and the ranges standardized per group and per row
        for (bits, pack), stochastic in zip(CODES, (False, True) * len(CODES)):
            for mean, rstd, by_row in ((None, None, False), standardized, by_rows):
                args = (dim, size, DECAY, bits, stochastic, pack, COUNTER, mean, rstd, by_row)
                kind = 'rows' if by_row else 'groups' if mean is not None else 'none'
                yield _Case(
                    f'{label} bits={bits} pack={pack} stochastic={stochastic} '
                    f'standardized={kind}',
                    partial(_observed, backend.observe_quantize, x, _estimates(groups, device),
                            *args),
                    partial(_observed, REFERENCE.observe_quantize, x,
                            _estimates(groups, device), *args))


def _refined(device: torch.device) -> Iterator[tuple[str, tuple, tuple]]:
    """Per layout, plain and standardized: a label, the 8-bit codes' arguments to ``refine``
    and the fine codes' to ``dequantize_refined``."""
    for label, x, dim, size, lower, span in _layouts(device):
        groups = lower.numel()
        for mean, rstd in ((None, None), (torch.linspace(-1, 1, groups, device=device),
                                          torch.linspace(0.5, 2, groups, device=device))):
            scale = scale_from_span(span, 8)
            codes = REFERENCE.quantize(x if mean is None else x.float(), lower, scale, 8, dim,
                                       size, False)
            refine_args = (x, codes, lower, scale, dim, size, mean, rstd)
            fine = REFERENCE.refine(*refine_args)
            yield (f'{label} standardized={mean is not None}', refine_args,
                   (codes, fine[0], lower, scale, fine[1], fine[2], dim, size, x.dtype, x.shape))


def _refine(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, args, _ in _refined(device):
        yield _Case(label, partial(backend.refine, *args), partial(REFERENCE.refine, *args))


def _dequantize_refined(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, _, args in _refined(device):
        yield _Case(label, partial(backend.dequantize_refined, *args),
                    partial(REFERENCE.dequantize_refined, *args))


def _norm_terms(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    """1/std over four decades, variances on both sides of the reliable bound, eps of BatchNorm
    and of SyncBatchNorm's defaults, with and without a weight."""
    generator = torch.Generator().manual_seed(5)
    rstd = (10.0 ** (torch.rand(257, generator=generator) * 4 - 1)).to(device)
    decoded = (torch.rand(257, generator=generator) * 2 + 0.1).to(device)
    weight = torch.randn(257, generator=generator).to(device)
    for eps in (1e-5, 1e-3):
        for w in (None, weight):
            args = (rstd, decoded, w, eps, RELIABLE)
            yield _Case(f'eps={eps} weight={w is not None}', partial(backend.norm_terms, *args),
                        partial(REFERENCE.norm_terms, *args))


def _masks(device: torch.device) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per layout: a label, a bool mask and its packed bytes."""
    for shape, _, _ in LAYOUTS:
        mask = _sample(shape, torch.float32, device) > 0.5
        yield str(tuple(shape)), mask, REFERENCE.pack_mask(mask)


def _pack_mask(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, mask, _ in _masks(device):
        yield _Case(label, partial(backend.pack_mask, mask), partial(REFERENCE.pack_mask, mask))


def _unpack_mask(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, mask, data in _masks(device):
        yield _Case(label, partial(backend.unpack_mask, data, mask.shape),
                    partial(REFERENCE.unpack_mask, data, mask.shape))


def _pack_positive(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, *_ in _layouts(device):
        yield _Case(label, partial(backend.pack_positive, x),
                    partial(REFERENCE.pack_positive, x))


def _mask_select(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, *_ in _layouts(device):
        data = REFERENCE.pack_mask(torch.arange(x.numel(), device=device).view(x.shape) % 3 > 0)
        yield _Case(label, partial(backend.mask_select, x, data, x.shape),
                    partial(REFERENCE.mask_select, x, data, x.shape))


def _in_place(op: Callable[..., torch.Tensor], values: torch.Tensor, *args: object
              ) -> torch.Tensor:
    """``op`` on a copy of ``values`` (each side of a case writes its own), checked to return
    the tensor it wrote."""
    copy = values.clone()
    out = op(copy, *args)
    if out is not copy:
        raise RuntimeError('an in-place op returned another tensor than its input')
    return out


def _mask_select_(backend: QuantBackend, device: torch.device) -> Iterator[_Case]:
    for label, x, *_ in _layouts(device):
        data = REFERENCE.pack_mask(torch.arange(x.numel(), device=device).view(x.shape) % 3 > 0)
        yield _Case(label, partial(_in_place, backend.mask_select_, x, data, x.shape),
                    partial(_in_place, REFERENCE.mask_select_, x, data, x.shape))


CASES: dict[str, Callable[[QuantBackend, torch.device], Iterator[_Case]]] = {
    'observe': _observe, 'quantize': _quantize, 'dequantize': _dequantize,
    'observe_quantize': _observe_quantize, 'refine': _refine,
    'dequantize_refined': _dequantize_refined, 'norm_terms': _norm_terms,
    'pack_mask': _pack_mask,
    'unpack_mask': _unpack_mask, 'pack_positive': _pack_positive, 'mask_select': _mask_select,
    'mask_select_': _mask_select_}


def _difference(got: object, want: object) -> str | None:
    """How ``got`` differs from ``want`` (tensors or tuples of them), or None where every
    tensor has the same shape, dtype, device and bits."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    if len(got) != len(want):
        return f'{len(got)} outputs, the reference gives {len(want)}'
    for index, (a, b) in enumerate(zip(got, want)):
        which = f'output {index}: ' if len(got) > 1 else ''
        meta_a = (tuple(a.shape), a.dtype, a.device)
        meta_b = (tuple(b.shape), b.dtype, b.device)
        if meta_a != meta_b:
            return f'{which}shape, dtype, device {meta_a}, the reference gives {meta_b}'
        as_bits = BITS_OF.get(a.dtype)
        differ = a.view(as_bits) != b.view(as_bits) if as_bits is not None else a != b
        count = int(differ.sum())
        if count:
            return f'{which}{count} of {a.numel()} elements differ from the reference'
    return None


def check_op(op: str, backend: QuantBackend, device: torch.device) -> OpCheck:
    """Run ``op`` of ``backend`` on ``device`` in every case and compare it with the
    reference's; stop at the first disagreement."""
    cases = 0
    failure = None
    for case in CASES[op](backend, device):
        try:
            why = _difference(case.kernel(), case.reference())
        except Exception as error:  # a kernel that raises fails its op; the others still run
            why = f'raised {type(error).__name__}: {error}'
        if why is not None:
            failure = f'{case.label}: {why}'
            break
        cases += 1
    return OpCheck(op, str(device), backend.name, failure is None,
                   failure or f'{cases} cases bit-identical')


def check_backend(backend: QuantBackend, device: torch.device) -> list[OpCheck]:
    """Every op of ``backend`` on ``device``, in the order of ``OPS``."""
    with torch.no_grad():
        return [check_op(op, backend, device) for op in OPS]


def verify_first_use(device: torch.device, requested: str = 'auto') -> list[OpCheck]:
    """Check the compiled kernels that will code activations on ``device`` (a device type in
    ``FIRST_USE_DEVICE_TYPES``) once per process and device; raise ``KernelMismatchError``
    naming the ops that disagree and the way around them. Returns the checks (empty where
    ``requested`` runs the reference, or the device type is not checked)."""
    if device.type not in FIRST_USE_DEVICE_TYPES:
        return []
    if device.type == 'cuda' and device.index is None:
        device = torch.device('cuda', torch.cuda.current_device())
    backend = compiled_backend(device, requested)
    if backend is None:
        return []
    key = (device, backend.name)
    if key not in state.KERNEL_CHECKS:
        state.KERNEL_CHECKS[key] = check_backend(backend, device)
    checks = state.KERNEL_CHECKS[key]
    failed = [check for check in checks if not check.ok]
    if failed:
        ops = '; '.join(f'{check.op} ({check.detail})' for check in failed)
        raise KernelMismatchError(
            f'mmseg_mesa: the {backend.name} give other results than the pure-PyTorch '
            f'reference on {device} in {ops}. Train with the reference instead: '
            f"mesa = dict(backend='torch') (same codes, slower); "
            '`python -m mmseg_mesa.info --check` repeats the check on every device.')
    return checks
