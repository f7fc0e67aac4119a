"""Routes for the functional activations and normalizations a module's own forward calls.

timm's ``GELU`` / ``LayerNorm2d`` / ``BatchNormAct2d``, SwinV2's cosine attention and
ConvNeXt-V2's global response norm call ``F.gelu``, ``F.layer_norm``, ``F.batch_norm``,
``F.normalize`` or ``x.norm`` instead of a module Mesa swaps. ``MesaFunctional``
(``layers.intercept``) hands such calls here: each route binds the call's arguments as torch
does, and returns the matching Mesa Function's result, torch's own values, or None to leave the
call to torch (arguments the Function does not take, nothing needing a gradient). A route asks
its quantizers from ``site(layer_type, roles)`` (None: the layer type is switched off).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .activations import (
    MesaGELUFunction,
    MesaHardswishFunction,
    MesaSmoothFunction,
    mesa_relu,
)
from .elementwise import MesaAmaxFunction, MesaDivFunction, MesaMaxDimFunction, MesaPowFunction
from .group_norm import MesaGroupNormFunction
from .norm import MesaBatchNormFunction, MesaLayerNormFunction
from .vector_norm import MesaNormalizeFunction, MesaVectorNormFunction

Site = Callable[[str, dict], list | None]
Route = Callable[[Site, tuple, dict], torch.Tensor | None]


def _bind(names: tuple[str, ...], defaults: dict, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name, or None for one this route does not know (an argument
    left at None, as torch's wrappers pass ``dtype=None`` / ``out=None`` on, is no argument)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in names}
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    bound = dict(defaults, **dict(zip(names, args)), **kwargs)
    return bound if all(n in bound for n in names) else None


def _needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def is_activation(t: Any) -> bool:
    """A floating-point tensor that is not a Parameter: what a forward computed."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and \
        not isinstance(t, torch.nn.Parameter)


def _activation(t: Any) -> bool:
    return is_activation(t) and t.dim() >= 2


def channel_roles(x: torch.Tensor, role: str = 'input') -> dict:
    """One quantizer grouped by channels: dim 1 of a feature map, the last dim of tokens."""
    return {role: (1 if x.dim() >= 4 else -1, None)}


def _gelu(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    b = _bind(('input', 'approximate'), dict(approximate='none'), args, kwargs)
    if b is None or not (_activation(b['input']) and _needs_grad(b['input'])):
        return None
    # its input's codes, grouped by channel on a feature map: a conv after it saves its output
    # as those codes (timm's conv MLPs), so they cost nothing there, where derivative codes
    # would be a second copy
    quantizers = site('gelu', channel_roles(b['input']))
    return None if quantizers is None else MesaGELUFunction.apply(
        b['input'], b['approximate'], *quantizers)


def _smooth(kind: str, op: Callable, inplace_arg: bool) -> Route:
    """SiLU / Mish / Tanh / Sigmoid: one quantized copy (``MesaSmoothFunction``)."""
    names = ('input', 'inplace') if inplace_arg else ('input',)

    def route(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
        b = _bind(names, dict(inplace=False), args, kwargs)
        if b is None or not (_activation(b['input']) and _needs_grad(b['input'])):
            return None
        quantizers = site('activation', channel_roles(b['input']))
        if quantizers is None:
            return None
        inplace = bool(b['inplace'])
        call = functools.partial(op, inplace=True) if inplace else op
        return MesaSmoothFunction.apply(b['input'], call, kind, inplace, *quantizers)
    return route


def _relu(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    b = _bind(('input', 'inplace'), dict(inplace=False), args, kwargs)
    if b is None or not (_activation(b['input']) and _needs_grad(b['input'])) or \
            site('relu', {}) is None:
        return None
    return mesa_relu(b['input'], bool(b['inplace']))


def _hardswish(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    b = _bind(('input', 'inplace'), dict(inplace=False), args, kwargs)
    if b is None or not (_activation(b['input']) and _needs_grad(b['input'])):
        return None
    quantizers = site('activation', channel_roles(b['input']))
    return None if quantizers is None else MesaHardswishFunction.apply(
        b['input'], bool(b['inplace']), *quantizers)


def _layer_norm(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    b = _bind(('input', 'normalized_shape', 'weight', 'bias', 'eps'),
              dict(weight=None, bias=None, eps=1e-5), args, kwargs)
    if b is None or not _activation(b['input']) or \
            not _needs_grad(b['input'], b['weight'], b['bias']):
        return None
    quantizers = site('layernorm', {'input': (-1, None)})
    return None if quantizers is None else MesaLayerNormFunction.apply(
        b['input'], tuple(b['normalized_shape']), b['weight'], b['bias'], b['eps'], *quantizers)


def _group_norm(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    b = _bind(('input', 'num_groups', 'weight', 'bias', 'eps'),
              dict(weight=None, bias=None, eps=1e-5), args, kwargs)
    if b is None or not _activation(b['input']) or \
            not _needs_grad(b['input'], b['weight'], b['bias']):
        return None
    quantizers = site('groupnorm', {'input': (1, None)})
    return None if quantizers is None else MesaGroupNormFunction.apply(
        b['input'], b['num_groups'], b['weight'], b['bias'], b['eps'], *quantizers)


def _batch_norm(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Training-mode batch norm of a feature map (timm's ``BatchNormAct2d``). Not other inputs:
    a weight standardized with ``F.batch_norm`` (timm's ``StdConv2d``) is no activation, and
    its gradient would take the codes' error whole."""
    b = _bind(('input', 'running_mean', 'running_var', 'weight', 'bias', 'training',
               'momentum', 'eps'),
              dict(weight=None, bias=None, training=False, momentum=0.1, eps=1e-5), args, kwargs)
    if b is None or not b['training'] or not _activation(b['input']) or \
            b['input'].dim() != 4 or not _needs_grad(b['input'], b['weight'], b['bias']):
        return None
    quantizers = site('batchnorm', {'input': (1, 1)})
    return None if quantizers is None else MesaBatchNormFunction.apply(
        b['input'], b['weight'], b['bias'], b['running_mean'], b['running_var'],
        b['momentum'], b['eps'], *quantizers)


def _normalize(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
    b = _bind(('input', 'p', 'dim', 'eps', 'out'), dict(p=2.0, dim=1, eps=1e-12, out=None),
              args, kwargs)
    if b is None or b['p'] != 2 or b['out'] is not None or not isinstance(b['dim'], int) or \
            not (_activation(b['input']) and _needs_grad(b['input'])):
        return None
    x = b['input']
    # per head and channel for (B, heads, N, d) attention operands, else per channel group
    roles = {'output': (1, 1)} if x.dim() == 4 and b['dim'] % 4 == 3 else \
        {'output': (-1, None)}
    quantizers = site('normalize', roles)
    return None if quantizers is None else MesaNormalizeFunction.apply(
        x, b['dim'], b['eps'], *quantizers)


def _vector_norm(func: Any) -> Route:
    """``x.norm(2, dim)`` / ``torch.norm`` / ``torch.linalg.vector_norm`` over given dims."""
    if func is torch.linalg.vector_norm:
        names, defaults = ('input', 'ord', 'dim', 'keepdim'), dict(ord=2, dim=None, keepdim=False)
        order = 'ord'
    else:
        names, defaults = ('input', 'p', 'dim', 'keepdim'), dict(p='fro', dim=None, keepdim=False)
        order = 'p'

    def route(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
        b = _bind(names, defaults, args, kwargs)
        if b is None or b['dim'] is None or not (_activation(b['input']) and
                                                 _needs_grad(b['input'])):
            return None
        dims = (b['dim'],) if isinstance(b['dim'], int) else tuple(b['dim'])
        if b[order] not in (2, 2.0) and not (b[order] == 'fro' and len(dims) <= 2):
            return None
        x = b['input']
        quantizers = site('normalize', channel_roles(x))
        if quantizers is None:
            return None
        op = functools.partial(func, **{k: v for k, v in b.items() if k != 'input'})
        return MesaVectorNormFunction.apply(x, op, dims, bool(b['keepdim']), *quantizers)
    return route


def _pow(func: Any) -> Route:
    """``x ** e`` for a number ``e`` (MetaFormer's ``StarReLU``: ``relu(x) ** 2``)."""
    def route(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
        b = _bind(('input', 'exponent'), {}, args, kwargs)
        if b is None or isinstance(b['exponent'], bool) or \
                not isinstance(b['exponent'], (int, float)) or \
                not (_activation(b['input']) and _needs_grad(b['input'])):
            return None
        quantizers = site('activation', channel_roles(b['input']))
        exponent = b['exponent']
        return None if quantizers is None else MesaPowFunction.apply(
            b['input'], exponent, lambda t: func(t, exponent), *quantizers)
    return route


# A quotient is routed only when its denominator is a statistic of at most this share of the
# numerator's size (a hand-written norm's per-token std). Linear attention divides by a 1/16
# slice of its own product: the quotient is scale-invariant there, its exact gradient cancels
# between numerator and denominator, and an 8-bit numerator doubled timm's EfficientViT-B0
# whole-gradient error (0.030 -> 0.062).
DENOMINATOR_FRACTION = 1 / 32


def _div(func: Any) -> Route:
    """``a / b`` where ``b`` needs a gradient and is small next to ``a``: ``a`` is packed."""
    def route(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
        b = _bind(('input', 'other'), {}, args, kwargs)
        if b is None:
            return None
        num, den = b['input'], b['other']
        if not (_activation(num) and isinstance(den, torch.Tensor) and den.is_floating_point()
                and _needs_grad(den) and den.numel() <= DENOMINATOR_FRACTION * num.numel()):
            return None
        quantizers = site('product', channel_roles(num, 'a'))
        return None if quantizers is None else MesaDivFunction.apply(
            num, den, lambda x, y: func(x, y), *quantizers)
    return route


def _amax(func: Any) -> Route:
    """``x.amax(dim, keepdim)``: a bit per element for where the maxima are."""
    def route(site: Site, args: tuple, kwargs: dict) -> torch.Tensor | None:
        b = _bind(('input', 'dim', 'keepdim'), dict(dim=(), keepdim=False), args, kwargs)
        if b is None or not (_activation(b['input']) and _needs_grad(b['input'])):
            return None
        dims = (b['dim'],) if isinstance(b['dim'], int) else tuple(b['dim'])
        if not dims or site('pooling', {}) is None:  # the whole tensor's maximum: a scalar
            return None
        keepdim = bool(b['keepdim'])
        return MesaAmaxFunction.apply(b['input'], dims, keepdim,
                                      lambda t: func(t, dims, keepdim))
    return route


def _max_dim(func: Any) -> Route:
    """``torch.max(x, dim, keepdim)`` / ``min``: the indices in the narrowest integer type."""
    def route(site: Site, args: tuple, kwargs: dict) -> Any:
        b = _bind(('input', 'dim', 'keepdim'), dict(keepdim=False), args, kwargs)
        if b is None or not isinstance(b['dim'], int) or isinstance(b['keepdim'], torch.Tensor) \
                or not (_activation(b['input']) and _needs_grad(b['input'])) \
                or site('pooling', {}) is None:
            return None
        dim, keepdim = b['dim'], bool(b['keepdim'])
        values, indices = MesaMaxDimFunction.apply(b['input'], dim, keepdim,
                                                   lambda t: func(t, dim, keepdim))
        kind = torch.return_types.max if 'max' in func.__name__ else torch.return_types.min
        return kind((values, indices))
    return route


ROUTES: dict[Any, Route] = {
    F.gelu: _gelu, torch._C._nn.gelu: _gelu,
    F.silu: _smooth('silu', F.silu, True),
    F.mish: _smooth('mish', F.mish, True),
    torch.tanh: _smooth('tanh', torch.tanh, False),
    torch.Tensor.tanh: _smooth('tanh', torch.tanh, False),
    F.relu: _relu,
    F.hardswish: _hardswish,
    F.layer_norm: _layer_norm,
    F.group_norm: _group_norm,
    F.batch_norm: _batch_norm,
    F.normalize: _normalize,
    torch.norm: _vector_norm(torch.norm),
    torch.Tensor.norm: _vector_norm(torch.Tensor.norm),
    torch.linalg.vector_norm: _vector_norm(torch.linalg.vector_norm),
    **{f: _pow(f) for f in (torch.pow, torch.Tensor.pow, torch.Tensor.__pow__)},
    **{f: _amax(f) for f in (torch.amax, torch.Tensor.amax)},
    **{f: _max_dim(f) for f in (torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)},
    **{f: _div(f) for f in (torch.div, torch.Tensor.div, torch.Tensor.__truediv__,
                            torch.true_divide, torch.Tensor.true_divide)},
}
