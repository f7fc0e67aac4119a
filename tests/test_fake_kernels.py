"""The FakeTensor kernels of ``torch.ops.mmseg_mesa`` (``mmseg_mesa.fake_kernels``).

``torch.library.opcheck`` holds every op's registration to its schema, its fake kernel and
AOT dispatch with dynamic shapes; the fakes' output metadata is compared with the real kernels'
over a wider range of cases; and a function calling the ops traces without a graph break.
CUDA runs the ops with CUDA kernels (observe, quantize, dequantize) where a GPU is visible.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from mmseg_mesa import _backend

BUILD = _backend.build_info()
BUILT = BUILD is not None and BUILD.EXTENSION
pytestmark = pytest.mark.skipif(not BUILT, reason='package installed without the extension')
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
DEVICES = ['cpu', pytest.param('cuda', marks=requires_cuda)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# (shape, group_dim, group_size): a partial last group, channels last, one group wider than the
# channels, no elements, no channels.
LAYOUTS = (((2, 5, 3, 3), 1, 2), ((3, 4, 7), -1, 3), ((5, 7), 0, 100), ((0, 4), 1, 4),
           ((2, 0, 3), 1, 2))
# (bits, pack): what quantize returns differs between these (flat packed bytes when pack and
# bits < 8).
CODES = ((8, False), (8, True), (4, True), (2, False), (1, True))
# The checks that apply. test_autograd_registration is left out on purpose: these ops are not
# differentiable (they return codes and masks; Mesa's autograd Functions call them and give
# the gradients), so their inputs never require grad and opcheck has nothing to check there.
OPCHECK_UTILS = ('test_schema', 'test_faketensor', 'test_aot_dispatch_dynamic')
OPS = torch.ops.mmseg_mesa


@pytest.fixture(scope='module', autouse=True)
def _kernels():
    from mmseg_mesa import kernels  # loads _C and its fake kernels
    return kernels


def groups_of(shape, group_dim, group_size):
    return -(-shape[group_dim] // group_size)


def sample(shape, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    if x.numel() > 2:
        x.view(-1)[1] = float('nan')
    return x.to(dtype).to(device)


def estimates(groups, device):
    return (torch.zeros(groups, device=device), torch.zeros(groups, device=device),
            torch.zeros(groups, dtype=torch.bool, device=device))


def affine(groups, device):
    """A lower and scale per group (scale > 0)."""
    return (torch.linspace(-2, 1, groups, device=device),
            torch.linspace(0.25, 1, groups, device=device))


def observe_args(shape, group_dim, group_size, dtype, device):
    x = sample(shape, dtype, device)
    return (x, *estimates(groups_of(shape, group_dim, group_size), device), group_dim,
            group_size, 0.9)


def quantize_args(shape, group_dim, group_size, dtype, device, bits, pack, stochastic):
    x = sample(shape, dtype, device)
    lower, scale = affine(groups_of(shape, group_dim, group_size), device)
    return (x, lower, scale, bits, group_dim, group_size, stochastic, 1234, 2 ** 32 - 3, pack)


def dequantize_args(shape, group_dim, group_size, dtype, device, bits, pack):
    args = quantize_args(shape, group_dim, group_size, torch.float32, device, bits, pack, False)
    codes = OPS.quantize(*args)
    return (codes, args[1], args[2], bits if pack else 8, list(shape), group_dim, group_size,
            dtype)


def observe_quantize_args(shape, group_dim, group_size, dtype, bits, pack, stochastic,
                          standardized):
    groups = groups_of(shape, group_dim, group_size)
    mean, rstd = (torch.linspace(-1, 1, groups), torch.linspace(0.5, 2, groups)) \
        if standardized else (None, None)
    return (sample(shape, dtype, 'cpu'), *estimates(groups, 'cpu'), mean, rstd, group_dim,
            group_size, 0.9, bits, stochastic, 99, 7, pack)


def mask_args(op, shape, dtype):
    x = sample(shape, dtype, 'cpu')
    data = OPS.pack_mask((x > 0).contiguous())
    return {'pack_mask': (x > 0,), 'unpack_mask': (data, list(shape)),
            'pack_positive': (x,), 'mask_select': (x, data), 'mask_select_': (x, data)}[op]


def refined_args(op, shape, group_dim, group_size, dtype, device, standardized):
    """``refine``'s, ``dequantize_refined``'s or ``dequantize`` with a row divisor's
    arguments."""
    x, lower, scale, *_ = quantize_args(shape, group_dim, group_size, dtype, device, 8, False,
                                        False)
    codes = OPS.quantize(x, lower, scale, 8, group_dim, group_size, False, 0, 0, False)
    groups = lower.numel()
    mean, rstd = ((torch.linspace(-1, 1, groups, device=device),
                   torch.linspace(0.5, 2, groups, device=device)) if standardized else (None, None))
    if op == 'refine':
        return (x, codes, lower, scale, mean, rstd, group_dim, group_size)
    if op == 'dequantize_refined':
        return (codes, codes, lower, scale, lower, scale, list(shape), group_dim, group_size,
                dtype)
    divisor = torch.linspace(0.5, 2, max(shape[0], 1), device=device)
    return (codes, lower, scale, 8, list(shape), group_dim, group_size, dtype, divisor)


def norm_terms_args(channels, device, weighted):
    rstd = torch.linspace(0.1, 400, channels, device=device)
    weight = torch.linspace(-1, 1, channels, device=device) if weighted else None
    return (rstd, rstd.flip(0), weight, 1e-5, 1e-4)


def opcheck_samples(device):
    """A few representative arguments per op: every dtype, both roundings, packed and unpacked
    codes and empty tensors, each at least once (opcheck compiles each, so not every
    combination; ``metadata_cases`` covers those)."""
    layouts = LAYOUTS[:3]
    empty = LAYOUTS[3]
    combos = list(zip(DTYPES, (False, True, False, True), CODES, layouts + layouts[:1]))
    for dtype, _, _, layout in combos:
        yield 'observe', observe_args(*layout, dtype, device)
    yield 'observe', observe_args(*empty, torch.float32, device)
    for dtype, stochastic, (bits, pack), layout in combos + [
            (torch.float32, True, (4, True), empty), (torch.bfloat16, True, CODES[4], layouts[0])]:
        yield 'quantize', quantize_args(*layout, dtype, device, bits, pack, stochastic)
    for dtype, _, (bits, pack), layout in combos + [(torch.float16, 0, (2, True), empty)]:
        yield 'dequantize', dequantize_args(*layout, dtype, device, bits, pack)
    for (dtype, standardized, _, layout), op in zip(combos, ('refine', 'dequantize_refined') * 2):
        yield op, refined_args(op, *layout, dtype, device, standardized)
        yield op, refined_args(op, *layout, dtype, device, not standardized)
    yield 'norm_terms', norm_terms_args(37, device, True)
    yield 'norm_terms', norm_terms_args(1, device, False)
    if device != 'cpu':  # the other ops have CPU kernels only
        return
    for (dtype, stochastic, (bits, pack), layout), standardized in zip(
            combos + [(torch.float64, True, (2, True), empty)], (False, True) * 3):
        yield 'observe_quantize', observe_quantize_args(*layout, dtype, bits, pack, stochastic,
                                                        standardized)
    for op in ('pack_mask', 'unpack_mask', 'pack_positive', 'mask_select', 'mask_select_'):
        for dtype, shape in zip(DTYPES, ((7,), (3, 5, 7), (2, 8), (0, 3))):
            yield op, mask_args(op, shape, dtype)


def opcheck_params():
    """(op, device) for every op on CPU, and on CUDA for the ops with CUDA kernels."""
    cuda = ('observe', 'quantize', 'dequantize', 'refine', 'dequantize_refined', 'norm_terms')
    ops = cuda + ('observe_quantize', 'pack_mask', 'unpack_mask', 'pack_positive', 'mask_select',
                  'mask_select_')
    return [pytest.param(op, 'cpu', id=f'{op}-cpu') for op in ops] + [
        pytest.param(op, 'cuda', marks=requires_cuda, id=f'{op}-cuda') for op in cuda]


@pytest.mark.parametrize('op, device', opcheck_params())
def test_opcheck(op, device):
    samples = [args for name, args in opcheck_samples(device) if name == op]
    assert samples
    for args in samples:
        torch.library.opcheck(getattr(OPS, op).default, args, test_utils=OPCHECK_UTILS)


def metadata_cases(device):
    """Every dtype, layout, width, packing and rounding the kernels take."""
    for shape, group_dim, group_size in LAYOUTS:
        layout = (shape, group_dim, group_size)
        for dtype in DTYPES:
            yield 'observe', observe_args(*layout, dtype, device)
            for bits, pack in CODES:
                for stochastic in (False, True):
                    yield 'quantize', quantize_args(*layout, dtype, device, bits, pack,
                                                    stochastic)
                yield 'dequantize', dequantize_args(*layout, dtype, device, bits, pack)
                if bits == 8 and not pack:
                    for op in ('refine', 'dequantize_refined', 'dequantize'):
                        yield op, refined_args(op, *layout, dtype, device, dtype == torch.float16)
                if device == 'cpu':
                    for standardized in (False, True):
                        yield 'observe_quantize', observe_quantize_args(
                            *layout, dtype, bits, pack, True, standardized)
            if device == 'cpu':
                for op in ('pack_mask', 'unpack_mask', 'pack_positive', 'mask_select',
                           'mask_select_'):
                    yield op, mask_args(op, shape, dtype)


def metadata(out):
    outs = out if isinstance(out, tuple) else () if out is None else (out,)  # in place: None
    return [(tuple(t.shape), t.stride(), t.dtype, t.device, t.is_contiguous()) for t in outs]


@pytest.mark.parametrize('device', DEVICES)
def test_fake_outputs_match_the_kernels(device):
    """A fake that allocates anything else than its kernel (shape, strides, dtype, device,
    number of outputs) fails here, case by case."""
    cases = 0
    for op, args in metadata_cases(device):
        real = getattr(OPS, op)(*args)
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                         for a in args]
            fake = getattr(OPS, op)(*fake_args)
        assert metadata(fake) == metadata(real), (op, [getattr(a, 'shape', a) for a in args])
        cases += 1
    assert cases > 100


def quantize_step(x, lower, span, seen, kernels):
    """What a Mesa layer does with the ops in one training step: observe and code an
    activation, decode it, and keep and apply a ReLU mask."""
    codes, used_lower, scale = kernels.observe_quantize(x, lower, span, seen, 1, 2, 0.9, 4,
                                                        True, pack=True, counter=(5, 7))
    x_hat = kernels.dequantize(codes, used_lower, scale, 1, 2, x.dtype, bits=4, shape=x.shape)
    cover = kernels.observe(x, lower, span, seen, 1, 2, 0.9)
    eight = kernels.quantize(x, cover[0].contiguous(), cover[1].contiguous(), 8, 1, 2, False)
    mask = kernels.pack_positive(x)
    kept = kernels.mask_select(x_hat, mask)
    return kept, eight, kernels.unpack_mask(mask, x.shape), kernels.pack_mask(x > 1)


def step_inputs():
    x = sample((2, 5, 3, 3), torch.float32, 'cpu')
    return (x, *estimates(3, 'cpu'))


STEP_OPS = {'observe_quantize', 'dequantize', 'observe', 'quantize', 'pack_positive',
            'mask_select', 'unpack_mask', 'pack_mask'}


def test_ops_compile_without_graph_break(_kernels):
    """One graph holding every op (``fullgraph=True`` raises at a break), which runs as in
    eager mode."""
    graphs = []

    def eager_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward
    compiled = torch.compile(lambda *a: quantize_step(*a, _kernels), fullgraph=True,
                             backend=eager_backend)
    eager_inputs, compiled_inputs = step_inputs(), step_inputs()
    want = quantize_step(*eager_inputs, _kernels)
    got = compiled(*compiled_inputs)
    assert len(graphs) == 1
    called = {str(node.target) for node in graphs[0].graph.nodes if node.op == 'call_function'}
    assert {f'mmseg_mesa.{op}' for op in STEP_OPS} <= called
    for a, b in zip(got + compiled_inputs[1:], want + eager_inputs[1:]):
        assert torch.equal(a, b)  # the ops ran, estimates updated in place, as in eager mode


def test_ops_trace_with_fake_tensors(_kernels):
    graph = make_fx(lambda *a: quantize_step(*a, _kernels), tracing_mode='fake')(*step_inputs())
    called = {node.target.name() for node in graph.graph.nodes
              if node.op == 'call_function' and isinstance(node.target, torch._ops.OpOverload)}
    assert {f'mmseg_mesa::{op}' for op in STEP_OPS} <= called
