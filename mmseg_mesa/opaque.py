"""Mesa modules as opaque ops under ``torch.compile``.

A Mesa layer's work is Python around its kernels: running estimates updated in place, decisions
remembered across calls, stochastic rounding's counter, hand-offs keyed by tensor identity.
Dynamo cannot trace such code into a graph, and AOT autograd would run it once, at trace time,
not at every step. So under ``torch.compile`` every Mesa module is one op, ``mmseg_mesa::
module_forward``, whose body is the module's eager forward, run at every call, and whose backward
op (``module_backward``) runs that forward's own autograd graph. Inductor compiles and fuses
everything between Mesa modules, and the modules themselves compute exactly what they compute
eagerly: the same ops, the same codes kept, the same formulas in backward.

Why this boundary, rather than making each layer traceable: one mechanism covers every layer
type, the generic ones (``MesaFunctional``) and those an integration registers included, with
no layer rewritten; what must happen once per call (the codes, the estimates) happens once per
call; and the eager path does not change.

How a call crosses the boundary:

- ``call`` (traced by dynamo) flattens the module's arguments: tensors go in a list, ints (which
  may be symbolic sizes) in another, and the rest (None, bools, floats, strings, tuples, lists)
  into a literal ``layout`` string, a constant of the graph. The module is named by a key
  (``register``), its parameters are inputs of the op so that their gradients flow in the
  compiled graph, and the autocast state at the call is passed explicitly.
- Its fake kernel runs the module's forward under ``torch.no_grad()`` (where Mesa modules run
  their unconverted forward, bit-identical by construction) on FakeTensors, which gives the
  outputs' shapes and dtypes, their structure (``found_by_fake``), and which input the module
  writes in place and returns (an in-place activation). An op of the graph does not mutate its
  inputs, so the real kernel writes a copy and the graph copies it back into the input, where
  functionalization sees it: later readers of the input get the written values, as in eager.
- The real kernel runs the module's forward with grad enabled on detached inputs, keeps the
  autograd graph it builds under a ticket (a CPU scalar, so reading it never waits for a GPU),
  carries the inputs' and outputs' hand-offs (``handoff.carry``) to the detached aliases, and
  returns the outputs detached, contiguous. The graph is freed by the backward, or with the
  ticket where no backward comes.
- ``module_backward`` takes the ticket and the outputs' gradients and returns the inputs'
  (``torch.autograd.grad`` over the kept graph), which it then forgets.

The forward a compiled graph computes is the eager Mesa forward's inside each module; between
modules inductor's code may round differently from eager code (the compiled baseline too).
"""
from __future__ import annotations

import ast
import functools
import itertools
import threading
import weakref
from typing import Any

import torch
from torch import nn

from . import handoff

__all__ = ['call', 'inside', 'register', 'wanted']

_MODULES: dict[int, weakref.ref] = {}  # key -> the module (registered at conversion)
# (key, layout) -> facts the fake kernel found at trace time: the outputs' layout, and the
# (input, output) pairs of an input the module writes in place and returns. The real kernel runs
# in the same process as the trace.
_FOUND: dict[tuple[int, str], tuple[Any, tuple[tuple[int, int], ...]]] = {}
_GRAPHS: dict[int, tuple[list, list]] = {}  # ticket -> (inputs needing grad, outputs)
_TICKETS = itertools.count()
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The dispatcher's thread-local key sets of eager code (as at import). An op's kernel runs below
# autograd, with autograd's keys excluded, and a Mesa module needs autograd to record its graph
# (and its backward, to differentiate what it recomputes): the kernels run under these.
_EAGER_KEYS = (torch._C._dispatch_tls_local_include_set(),
               torch._C._dispatch_tls_local_exclude_set())


_INSIDE = threading.local()  # depth of module_forward kernels running on this thread


def _eager() -> Any:
    return torch._C._ForceDispatchKeyGuard(*_EAGER_KEYS)


def inside() -> bool:
    """Whether a compiled graph's ``module_forward`` is running: its graph guards on the
    modules' classes and hooks, so a module must not change them now."""
    return getattr(_INSIDE, 'depth', 0) > 0


def register(module: nn.Module) -> None:
    """Make ``module`` reachable from the ops by its key (``id``); done at conversion and when a
    converted module is copied. The entry goes with the module."""
    key = id(module)
    _MODULES[key] = weakref.ref(module, lambda _, key=key: _MODULES.pop(key, None))


def _module(key: int) -> nn.Module:
    ref = _MODULES.get(key)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(
            'a compiled graph calls a Mesa module that is no longer registered (the model was '
            'freed, or built by a path that skipped MesaModule.mesa_setup)')
    return module


def wanted(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this call, met by dynamo, crosses the boundary: only where a backward may follow
    (grad enabled, something needing a gradient). Elsewhere the module's forward is the
    unconverted one and dynamo traces it like any other."""
    if not torch.is_grad_enabled():
        return False
    for p in module.parameters():
        if p.requires_grad:
            return True
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


# Places of the tensors and ints in a layout: sets, which no argument the layout spells out is.
_TENSOR_MARK = 0
_TENSOR, _INT = '{0}', '{1}'


def _encode(value: Any, tensors: list, ints: list) -> str:
    """The literal layout of one argument, with its tensors and ints moved to the lists."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TENSOR
    if value is None or isinstance(value, (bool, float, str)):
        return repr(value)
    if isinstance(value, int):
        ints.append(value)
        return _INT
    if isinstance(value, tuple):
        return '(' + ''.join(_encode(v, tensors, ints) + ',' for v in value) + ')'
    if isinstance(value, list):
        return '[' + ''.join(_encode(v, tensors, ints) + ',' for v in value) + ']'
    raise TypeError(f'a Mesa module under torch.compile takes tensors, numbers, strings, None '
                    f'and tuples or lists of them; got {type(value).__name__}')


@functools.cache
def _parse(layout: str) -> Any:
    return ast.literal_eval(layout)


def _decode(node: Any, tensors: Any, ints: Any) -> Any:
    if isinstance(node, set):
        return next(tensors) if _TENSOR_MARK in node else next(ints)
    if isinstance(node, tuple):
        return tuple(_decode(n, tensors, ints) for n in node)
    if isinstance(node, list):
        return [_decode(n, tensors, ints) for n in node]
    return node


def _arguments(layout: str, tensors: list, ints: list) -> tuple[tuple, dict]:
    args, kwargs = _parse(layout)
    t, i = iter(tensors), iter(ints)
    return _decode(args, t, i), {k: _decode(v, t, i) for k, v in kwargs.items()}


def _output_node(out: Any, flat: list) -> Any:
    if isinstance(out, torch.Tensor):
        flat.append(out)
        return 't'
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return tuple(_output_node(o, flat) for o in out)
    raise TypeError(f'a Mesa module under torch.compile returns tensors, None and tuples of '
                    f'them; got {type(out).__name__}')


def _autocast(device: str, dtype_code: int) -> Any:
    if dtype_code < 0:
        return torch.autocast(device, enabled=False)
    return torch.autocast(device, dtype=_DTYPES[dtype_code])


def _owned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


@torch.library.custom_op('mmseg_mesa::module_forward', mutates_args=())
def module_forward(key: int, layout: str, tensors: list[torch.Tensor], ints: list[int],
                   params: list[torch.Tensor], needs_grad: list[bool], device: str,
                   autocast_dtype: int) -> list[torch.Tensor]:
    """The module's eager forward, its autograd graph kept under the ticket (the last output)."""
    module = _module(key)
    found = _FOUND.get((key, layout))
    if found is None:
        raise RuntimeError('module_forward ran before its fake kernel traced it')
    writes_input = bool(found[1])
    leaves, inputs = [], []
    with _eager(), torch.enable_grad(), _autocast(device, autocast_dtype):
        for t, grad in zip(tensors, needs_grad):
            leaf = t.detach().requires_grad_(grad)
            leaves.append(leaf)
            if writes_input:  # written in place: a copy, which the graph's leaf is not
                inputs.append(leaf.clone())
            else:
                handoff.carry(t, leaf)
                inputs.append(leaf)
        args, kwargs = _arguments(layout, inputs, ints)
        flat: list[torch.Tensor] = []
        _INSIDE.depth = getattr(_INSIDE, 'depth', 0) + 1
        try:
            _output_node(module.forward(*args, **kwargs), flat)
        finally:
            _INSIDE.depth -= 1
    ticket = next(_TICKETS)
    wanting = [t for t in leaves if t.requires_grad]
    wanting += [p for p, grad in zip(params, needs_grad[len(tensors):]) if grad]
    _GRAPHS[ticket] = (wanting, flat)
    outs = []
    for o in flat:
        owned = _owned(o.detach())
        handoff.carry(o, owned)
        outs.append(owned)
    token = torch.tensor(ticket)
    # a forward whose backward never runs (a loss not differentiated) frees its graph with the
    # ticket, which the compiled graph keeps for its backward
    weakref.finalize(token, _GRAPHS.pop, ticket, None)
    return outs + [token]


@module_forward.register_fake
def _(key: int, layout: str, tensors: list[torch.Tensor], ints: list[int],
      params: list[torch.Tensor], needs_grad: list[bool], device: str,
      autocast_dtype: int) -> list[torch.Tensor]:
    module = _module(key)
    fake_mode = torch._guards.detect_fake_mode(tensors + params)
    named = dict(module.named_parameters())
    values = {n: p for n, p in zip(named, params)}
    for name, buf in module.named_buffers():
        values[name] = (fake_mode.from_tensor(buf, static_shapes=True) if fake_mode is not None
                        else buf)
    copies = [t.clone() for t in tensors]  # what the module writes in place, on copies
    versions = [t._version for t in copies]
    with torch.no_grad(), _autocast(device, autocast_dtype):
        args, kwargs = _arguments(layout, copies, ints)
        out = torch.func.functional_call(module, values, args, kwargs, tie_weights=False)
    flat: list[torch.Tensor] = []
    node = _output_node(out, flat)
    written = tuple((i, j) for i, t in enumerate(copies) for j, o in enumerate(flat)
                    if torch._C._is_alias_of(o, t))
    if any(t._version != v and not any(i == w for w, _ in written)
           for i, (t, v) in enumerate(zip(copies, versions))):
        raise NotImplementedError(
            f'{type(module).__name__} writes an input in place without returning it; such a '
            'Mesa module cannot be one op of a compiled graph')
    _FOUND[(key, layout)] = (node, written)
    return [_owned(torch.empty_like(o)) if written else _owned(o) for o in flat] + [
        torch.empty((), dtype=torch.int64)]


@torch.library.custom_op('mmseg_mesa::module_backward', mutates_args=())
def module_backward(ticket: torch.Tensor, grads: list[torch.Tensor], sizes: list[int],
                    ranks: list[int], dtypes: list[int], device: str) -> list[torch.Tensor]:
    """The inputs' gradients through the graph kept under ``ticket``, which is then freed."""
    entry = _GRAPHS.pop(int(ticket), None)
    if entry is None:
        raise RuntimeError('the graph of a compiled Mesa module was used already: a second '
                           'backward through it (retain_graph=True) is not supported')
    wanting, outs = entry
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
    found: Any = [None] * len(wanting)
    if pairs and wanting:
        with _eager():
            found = torch.autograd.grad([o for o, _ in pairs], wanting, [g for _, g in pairs],
                                        allow_unused=True)
    return [_owned(g) if g is not None else torch.zeros_like(t)
            for g, t in zip(found, wanting)]


@module_backward.register_fake
def _(ticket: torch.Tensor, grads: list[torch.Tensor], sizes: list[int], ranks: list[int],
      dtypes: list[int], device: str) -> list[torch.Tensor]:
    out, at = [], 0
    for rank, dtype in zip(ranks, dtypes):
        out.append(torch.empty(sizes[at:at + rank], dtype=_DTYPES[dtype], device=device))
        at += rank
    return out


def _setup(ctx: Any, inputs: tuple, output: list) -> None:
    _, _, tensors, ints, params, needs_grad, device, _ = inputs
    wanting = [t for t, g in zip(list(tensors) + list(params), needs_grad) if g]
    ctx.needs_grad = needs_grad
    ctx.device = device
    ctx.sizes = [s for t in wanting for s in t.shape]
    ctx.ranks = [t.dim() for t in wanting]
    ctx.dtypes = [_DTYPES.index(t.dtype) for t in wanting]
    ctx.count = len(tensors)
    ctx.ints = len(ints)
    ctx.save_for_backward(output[-1])


def _backward(ctx: Any, grads: list) -> tuple:
    ticket, = ctx.saved_tensors
    found = iter(module_backward(ticket, list(grads[:-1]), ctx.sizes, ctx.ranks, ctx.dtypes,
                                 ctx.device))
    per_input = [next(found) if g else None for g in ctx.needs_grad]
    # torch matches this to the inputs' structure, where a list of ints is one leaf (an empty
    # list, none)
    ints = None if ctx.ints else []
    return (None, None, per_input[:ctx.count], ints, per_input[ctx.count:], None, None, None)


module_forward.register_autograd(_backward, setup_context=_setup)
torch.fx.node.has_side_effect(torch.ops.mmseg_mesa.module_forward.default)


@torch._dynamo.assume_constant_result
def found_by_fake(key: int, layout: str) -> Any:
    """What the fake kernel found of the call (constants of the graph): the outputs' structure,
    and the (input, output) pairs of an input the module writes in place and returns."""
    return _FOUND[(key, layout)]


def _rebuild(node: Any, outs: list, at: list) -> Any:
    if node == 't':
        at[0] += 1
        return outs[at[0] - 1]
    if isinstance(node, tuple):
        return tuple(_rebuild(n, outs, at) for n in node)
    return node


def call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module.forward(*args, **kwargs)`` as one op of the graph dynamo is building."""
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    layout = ('(' + _encode(args, tensors, ints) + ',{'
              + ''.join(repr(k) + ':' + _encode(v, tensors, ints) + ',' for k, v in kwargs.items())
              + '})')
    params = list(module.parameters())
    needs_grad = [t.requires_grad for t in tensors] + [p.requires_grad for p in params]
    first = tensors[0] if tensors else params[0]
    device = first.device.type
    code = -1
    if torch.is_autocast_enabled(device):
        code = _DTYPES.index(torch.get_autocast_dtype(device))
    key = id(module)
    outs = module_forward(key, layout, tensors, ints, params, needs_grad, device, code)
    node, written = found_by_fake(key, layout)
    if written:  # in place, as eager: the op wrote a copy
        returned = {j: i for i, j in written}
        for i, j in written:
            tensors[i].copy_(outs[j])
        outs = [tensors[returned[j]] if j in returned else o for j, o in enumerate(outs)]
    return _rebuild(node, outs, [0])
