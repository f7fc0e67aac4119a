"""Compressing what a module's *own* forward computes functionally (``q @ k``, ``softmax``, ...).

mmseg's BEiT / MAE / Twins attention, OCR's context blocks, SegNeXt's gated convolutions and
K-Net's kernel update head call ``torch.matmul``, ``Tensor.softmax``, ``F.linear``, element-wise
products, ``torch.einsum`` and ``F.conv2d`` with kernels of their own making in their forward
instead of through modules, and timm's and mmpretrain's attention calls torch's fused
``F.scaled_dot_product_attention`` (``layers.sdpa``), so no module handler sees them. Rather
than rewriting each forward, ``MesaFunctional`` runs the module's own forward under a
``TorchFunctionMode`` that routes those calls, and only those made by this module itself (not by
its child modules, which have handlers of their own), through Mesa's autograd Functions. Each
Function computes the op exactly as torch does, so the forward is bit-identical; what is saved
for backward is packed by the one quantizer.

Each intercepted call gets quantizers of its own, keyed by its position in the forward (the k-th
intercepted call), so the running estimates follow one call site across steps.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.utils import _pair
from torch.overrides import TorchFunctionMode

from .. import opaque
from ..config import MesaConfig
from ..layer_types import declare_layer_type
from ..quantizer import ActivationQuantizer
from ..saved import save
from ..training_state import load_estimates
from .activations import MesaSmoothFunction
from .autocast import no_autocast_backward, record_input, returns_owned
from .base import MesaModule, make_quantizer, row_group_config
from .conv import MesaConv2dFunction, numeric_padding
from .einsum import MesaEinsumFunction, gradient_equations
from .formulas import operand_gradients, sum_to
from .functional_routes import ROUTES, is_activation
from .grid_sample import MesaGridSampleFunction
from .linear import MesaLinearFunction
from .matmul import MesaMatMulFunction
from .pooling import MesaLinearPoolFunction, adaptive_pool_adjoint
from .recomputed_map import (
    MesaLogitsFunction,
    MesaMapMatMulFunction,
    logits_operands,
    logits_recipe,
    recipe_of,
    step_gain,
    step_operand,
)
from .recomputed_map import offer as offer_map
from .sdpa import SDPA_FUNCTIONS, SDPA_ROLES, SDPACall, left_to_torch, mesa_sdpa, packs
from .softmax import MesaSoftmaxFunction, map_softmax

# Element-wise products a module's forward computes itself (layer scale, gated attention).
declare_layer_type('product')
# Modules no handler converts, their own forward's functional calls routed (``convert_generic``).
declare_layer_type('generic')

# An operand of an element-wise product this much smaller than the product (a layer-scale
# vector, per-channel gates) is kept as it is: packing it would save nothing worth its cost.
SMALL_OPERAND_FRACTION = 1 / 16

# A call left to torch is noted when its node keeps at least this much (a per-head scale or a
# gate of a few values is not worth a line in the report).
NOTED_LEFT_BYTES = 16 * 1024

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
            torch.Tensor.bmm}
_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax}
# Dropout on a map torch's softmax keeps in full (``recomputed_map.exact_logits``): the map
# ``attn @ v`` reads is still one to leave to torch.
_DROPOUTS = {F.dropout, torch.dropout}
_PRODUCTS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_LINEARS = {F.linear}
_EINSUMS = {torch.einsum}
_CONVS = {F.conv2d, torch.conv2d}
_GRID_SAMPLES = {F.grid_sample}
_ADAPTIVE_POOLS = {F.adaptive_avg_pool2d}
_SIGMOIDS = {torch.sigmoid, torch.Tensor.sigmoid}
_ADDCMULS = {torch.addcmul, torch.Tensor.addcmul}
# Ops a recipe of logits follows (``layers.recomputed_map``): the step each one is.
_MAP_STEPS = {
    **dict.fromkeys((torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__),
                    'mul'),
    **dict.fromkeys((torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__),
                    'add'),
    **dict.fromkeys((torch.sub, torch.Tensor.sub, torch.Tensor.__sub__), 'sub'),
    **dict.fromkeys((torch.div, torch.Tensor.div, torch.Tensor.__truediv__), 'div'),
    **dict.fromkeys((torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                     torch.Tensor.unsqueeze, torch.unsqueeze), 'reshape'),
}


class MesaMulFunction(torch.autograd.Function):
    """``a * b`` (broadcasting) saving each operand the other's gradient needs, packed when a
    quantizer is given, as it is otherwise (Parameters, small gates)."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor,
                quant_a: ActivationQuantizer | None, quant_b: ActivationQuantizer | None
                ) -> torch.Tensor:
        record_input(ctx, a)
        ctx.a_meta = (a.shape, a.dtype)
        ctx.b_meta = (b.shape, b.dtype)
        y = torch.mul(a, b)
        save_operands(ctx, 0, a, b, quant_a, quant_b)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (*product_gradients(ctx, grad, 0, ctx.a_meta, ctx.b_meta), None, None)


def save_operands(ctx: Any, first: int, a: torch.Tensor, b: torch.Tensor,
                  quant_a: ActivationQuantizer | None, quant_b: ActivationQuantizer | None
                  ) -> None:
    """Save what the backward of a product of the forward's arguments ``first`` and ``first +
    1`` reads: each operand the other's gradient needs, packed where it has a quantizer."""
    keep_b, keep_a = ctx.needs_input_grad[first:first + 2]  # d(a*b)/da needs b, and conversely
    saved_a = (quant_a.pack(feature_map(a)) if quant_a is not None else a) if keep_a else None
    saved_b = (quant_b.pack(feature_map(b)) if quant_b is not None else b) if keep_b else None
    save(ctx, saved_a, saved_b)


def product_gradients(ctx: Any, grad: torch.Tensor, first: int, a_meta: tuple, b_meta: tuple
                      ) -> tuple:
    """The gradients of the operands ``save_operands`` saved, reduced to their shapes."""
    return operand_gradients(ctx, grad, first,
                             lambda g, b: sum_to(g * b.reshape(b_meta[0]), *a_meta),
                             lambda g, a: sum_to(g * a.reshape(a_meta[0]), *b_meta))


class MesaAddcmulFunction(torch.autograd.Function):
    """``torch.addcmul(input, a, b, value=v)`` (ConvNeXt-V2's response norm: ``bias + weight *
    x``), saving ``a`` and ``b`` as ``MesaMulFunction`` saves a product's operands."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, input: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float,
                quant_a: ActivationQuantizer | None, quant_b: ActivationQuantizer | None
                ) -> torch.Tensor:
        record_input(ctx, a)
        ctx.value = value
        ctx.metas = tuple((t.shape, t.dtype) for t in (input, a, b))
        y = torch.addcmul(input, a, b, value=value)
        save_operands(ctx, 1, a, b, quant_a, quant_b)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        input_meta, a_meta, b_meta = ctx.metas
        scaled = grad * ctx.value if ctx.value != 1 else grad
        grad_input = sum_to(grad, *input_meta) if ctx.needs_input_grad[0] else None
        return (grad_input, *product_gradients(ctx, scaled, 1, a_meta, b_meta), None, None, None)


def feature_map(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 4-d feature map its channels are grouped on: a map with several channel
    dims (ResNeSt's ``(N, radix, C, H, W)`` splits) has them merged into one."""
    return t if t.dim() <= 4 else t.reshape(t.shape[0], -1, *t.shape[-2:])


def _worth_packing(t: Any, other: Any) -> bool:
    """An activation (not a Parameter) that is not tiny next to the product."""
    if not is_activation(t) or t.dim() == 0:
        return False
    out = torch.broadcast_shapes(t.shape, other.shape).numel()
    return t.numel() > SMALL_OPERAND_FRACTION * out


def _pass_kept_map(source: Any, result: Any) -> None:
    """Dropout on a map torch's softmax keeps in full (``recomputed_map.exact_logits``) gives
    a map to leave to torch too: ``attn @ v`` reads the dropped map, and packing it would
    lose what the sharp map's gradient rests on."""
    recipe = recipe_of(source)
    if recipe is not None and recipe.kept and isinstance(result, torch.Tensor):
        offer_map(result, recipe)


class _ChildDepth:
    """Forward (pre-)hook on a child: counts running children, so calls they make are theirs.
    The hook after a dropout child also passes a kept map on (``_pass_kept_map``), as the
    functional ``F.dropout`` route does: the child's own call is not the owner's.

    An object rather than a closure so that ``copy.deepcopy`` of the model points the copy's
    hooks at the copied parent.
    """

    def __init__(self, parent: nn.Module, step: int) -> None:
        self.parent = parent
        self.step = step

    def __call__(self, module: nn.Module, args: tuple, *output: Any) -> None:
        self.parent.mesa_child_depth += self.step
        if output and args and isinstance(module, _DropoutNd):
            _pass_kept_map(args[0], output[0])


class _Capture(TorchFunctionMode):
    """Routes the owner's own matmuls, softmaxes, products and linears through Mesa Functions."""

    def __init__(self, owner: MesaFunctional, probing: bool = False) -> None:
        super().__init__()
        self.owner = owner
        self.calls = 0
        self.routed = 0
        self.probing = probing  # also note the owner's calls left to torch that save tensors

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.owner.mesa_child_depth != 0 or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        routed = self._route(func, args, kwargs)
        if routed is not None:
            self.routed += 1
            result = routed
        else:
            result = func(*args, **kwargs)
            if self.probing:
                self._note_left(func, result, (*args, *kwargs.values()))
        if func in _MAP_STEPS and self.recomputes_maps and not kwargs:
            self._follow_map(_MAP_STEPS[func], args, result)
        elif func in _DROPOUTS and self.recomputes_maps and args:
            _pass_kept_map(args[0], result)
        return result

    @functools.cached_property
    def recomputes_maps(self) -> bool:
        """Whether attention written op by op keeps no map (``layers.recomputed_map``)."""
        config = self.owner.mesa_config
        return config.attention_maps == 'recompute' and 'softmax' in config.layers

    def _follow_map(self, step: str, args: tuple, result: Any) -> None:
        """Extend the recipe of logits (or of their scaled, biased or reshaped forms) by this
        op, when its other operand can be kept."""
        if not isinstance(result, torch.Tensor) or result.grad_fn is None or not args:
            return
        if step == 'reshape':
            recipe = recipe_of(args[0])
            if recipe is not None and result.dtype == args[0].dtype \
                    and result.numel() == args[0].numel():
                offer_map(result, recipe.then('reshape', result.shape))
            return
        if len(args) != 2:
            return
        recipe, other = recipe_of(args[0]), args[1]
        if recipe is None and step in ('mul', 'add'):  # commutative: the logits second
            recipe, other = recipe_of(args[1]), args[0]
        if recipe is None:
            return
        kept = step_operand(other, result, lambda: self._operand_quantizer(other))
        if kept is not None:
            offer_map(result, recipe.then(step, kept, step_gain(step, other)))

    def _operand_quantizer(self, t: torch.Tensor) -> ActivationQuantizer | None:
        site = self._site('softmax', {'operand': (_product_group_dim(t), 1)})
        return None if site is None else site[0]

    def _note_left(self, func: Any, result: Any, inputs: tuple) -> None:
        """Count a call Mesa has no route for whose node keeps an activation."""
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        node = next((t.grad_fn for t in outputs if isinstance(t, torch.Tensor)
                     and t.grad_fn is not None), None)
        if node is None or any(isinstance(t, torch.Tensor) and t.grad_fn is node
                               for t in inputs):  # no node of its own (``x.to(x.dtype)``)
            return
        if saved_activation_bytes(node) >= NOTED_LEFT_BYTES:
            name = getattr(func, '__name__', repr(func))
            self.owner.mesa_left_to_torch[f'{name}: no Mesa route'] += 1

    def _site(self, kind: str, roles: dict[str, tuple[int, int | None]]
              ) -> list[ActivationQuantizer] | None:
        """Quantizers of the next call site, or None when its layer type is switched off."""
        config = self.owner.mesa_config
        if kind not in config.layers:
            return None
        self.calls += 1
        sites = self.owner.mesa_call_sites()
        layer_config = config.for_layer(kind)
        if self.owner.mesa_row_groups:
            layer_config = row_group_config(layer_config)
            roles = {role: (0, 1) for role in roles}
        out = []
        for role, (group_dim, group_size) in roles.items():
            key = f'{self.calls}_{kind}_{role}'
            if key not in sites:
                sites[key] = make_quantizer(layer_config, group_dim, group_size)
                deferred = self.owner.mesa_deferred_estimates.pop(key, None)
                if deferred is not None and isinstance(sites[key], ActivationQuantizer):
                    load_estimates(sites[key], deferred)
            out.append(sites[key])
        return out

    def _route(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        if func in _MATMULS and len(args) == 2 and not kwargs:
            a, b = args
            if is_activation(a) and is_activation(b) and a.dim() >= 2 and b.dim() >= 2 \
                    and (a.requires_grad or b.requires_grad):
                # the right operand by its columns: output column j reads only b[..., j], so
                # each gets its own range (key tokens of q @ k, channels of attn @ v); the left
                # by dim 1 (its rows or heads, as a softmax before it groups what it offers)
                recipe = recipe_of(a) if self.recomputes_maps else None
                if recipe is not None and recipe.kept:  # attn @ v of a map torch keeps
                    return None
                if recipe is not None and recipe.is_map:  # attn @ v: the map is replayed
                    site = self._site('matmul', {'b': (-1, 1)})
                    if site is not None:
                        return MesaMapMatMulFunction.apply(a, b, recipe, *site)
                # multi-head q @ k: packed per head and channel (MesaLogitsFunction); any
                # product whose node keeps both operands' codes offers a recipe of its output
                heads = (self.recomputes_maps and logits_operands(a, b)
                         and not _softmax_output(a))
                site = self._site('matmul', {'a': (-1, 1) if heads else (1, 1), 'b': (-1, 1)})
                if site is not None:
                    y = (MesaLogitsFunction if heads else MesaMatMulFunction).apply(a, b, *site)
                    recipe = logits_recipe(y, a, b, site[0]) if self.recomputes_maps else None
                    if recipe is not None:
                        offer_map(y, recipe)
                    return y
        elif func in _SOFTMAXES:
            x, dim = _softmax_args(func, args, kwargs)
            # Rows of attention (the last dim) only: probabilities across the channels of a map
            # (K-Net's class masks) are small next to each channel's largest one, below the
            # step of a per-channel range (docs/benchmarks.md, "Gradient fidelity").
            if x is not None and x.requires_grad and x.dim() >= 2 and dim % x.dim() == x.dim() - 1:
                recipe = recipe_of(x) if self.recomputes_maps else None
                # logits of q @ k: the map replayed, or (too sharp for 8 bits) torch's
                y = None if recipe is None else map_softmax(
                    x, dim, recipe, self.owner.mesa_left_to_torch)
                if y is not None:
                    return y
                site = self._site('softmax', {'output': (1, 1)})
                if site is not None:
                    return MesaSoftmaxFunction.apply(x, dim, *site)
        elif func in _PRODUCTS and len(args) == 2 and not kwargs:
            return self._product(*args)
        elif func in _LINEARS:
            return self._linear(*args, **kwargs)
        elif func in _EINSUMS:
            return self._einsum(args, kwargs)
        elif func in _CONVS:
            return self._conv2d(*args, **kwargs)
        elif func in _GRID_SAMPLES:
            return self._grid_sample(*args, **kwargs)
        elif func in _ADAPTIVE_POOLS:
            return self._adaptive_pool(*args, **kwargs)
        elif func in _SIGMOIDS and len(args) == 1 and not kwargs:
            return self._sigmoid(args[0])
        elif func in SDPA_FUNCTIONS:
            return self._sdpa(args, kwargs)
        elif func in _ADDCMULS:
            return self._addcmul(*args, **kwargs)
        elif func in ROUTES:
            return ROUTES[func](self._site, args, kwargs)
        return None

    def _addcmul(self, input: Any, a: Any, b: Any, *, value: float = 1) -> torch.Tensor | None:
        """``input + value * a * b``: ``a`` and ``b`` packed as a product's operands."""
        if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (input, a, b)):
            return None
        quantizers = self._operand_quantizers(a, b)
        return None if quantizers is None else MesaAddcmulFunction.apply(input, a, b, value,
                                                                          *quantizers)

    def _sdpa(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """Torch's fused attention (timm's and mmpretrain's attention): q, k and v packed per
        head and channel, the maps recomputed in backward (``layers.sdpa``). A call it cannot
        take is left to torch, its reason counted in the owner's ``mesa_left_to_torch``."""
        call = SDPACall.bind(args, kwargs)
        if call is None or not call.needs_grad() or \
                'attention' not in self.owner.mesa_config.layers:
            return None
        reason = left_to_torch(call)
        if reason is not None:
            self.owner.mesa_left_to_torch[reason] += 1
            return None
        packed = [role for role, t in zip(SDPA_ROLES, call.operands()) if packs(t)]
        if not packed:  # Parameters only: torch's node keeps nothing else
            return None
        site = self._site('attention', {role: SDPA_ROLES[role] for role in packed})
        quantizers = dict(zip(packed, site))
        return mesa_sdpa(call, tuple(quantizers.get(role) for role in SDPA_ROLES))

    def _einsum(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        if kwargs or len(args) != 3 or not isinstance(args[0], str):
            return None
        equation, a, b = args
        if not (is_activation(a) and is_activation(b) and (a.requires_grad or b.requires_grad)
                and gradient_equations(equation) is not None):
            return None
        # A softmax's output is held in full by the softmax itself: packing it would save
        # nothing and add its error.
        pack = {role: t for role, t in (('a', a), ('b', b)) if not _softmax_output(t)}
        if not pack:
            return None
        site = self._site('matmul', {role: (1 if t.dim() == 4 else -1, 1)
                                     for role, t in pack.items()})
        if site is None:
            return None
        quantizers = dict(zip(pack, site))
        return MesaEinsumFunction.apply(equation, a, b, quantizers.get('a'), quantizers.get('b'))

    def _conv2d(self, input: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, stride: Any = 1, padding: Any = 0,
                dilation: Any = 1, groups: int = 1) -> torch.Tensor | None:
        """A convolution the module runs with a weight of its own making (K-Net's dynamic
        kernels); string padding as ``MesaConv2d`` takes it."""
        if not (is_activation(input) and input.dim() == 4 and weight.requires_grad):
            return None
        numbers = numeric_padding(padding if isinstance(padding, str) else _pair(padding),
                                  tuple(weight.shape[2:]), _pair(dilation))
        site = None if numbers is None else self._site('conv2d', {'input': (1, None)})
        if site is None:
            return None
        return MesaConv2dFunction.apply(input, weight, bias, _pair(stride), numbers,
                                        _pair(dilation), groups, *site)

    def _grid_sample(self, input: torch.Tensor, grid: torch.Tensor, mode: str = 'bilinear',
                     padding_mode: str = 'zeros', align_corners: bool | None = None
                     ) -> torch.Tensor | None:
        """Sampling a feature map at positions of the module's making (deformable attention,
        PointRend's points): the map is packed per channel, the grid kept."""
        if not (is_activation(input) and input.dim() == 4 and grid.dim() == 4
                and (input.requires_grad or grid.requires_grad)):
            return None
        site = self._site('attention', {'input': (1, None)})
        if site is None:
            return None
        return MesaGridSampleFunction.apply(input, grid, mode, padding_mode, align_corners,
                                            *site)

    def _adaptive_pool(self, input: torch.Tensor, output_size: Any) -> torch.Tensor | None:
        """An average pooling the module runs itself (DMNet's filter generator): it needs only
        the input's shape for backward, as ``MesaAdaptiveAvgPool2d``."""
        if not (is_activation(input) and input.requires_grad
                and 'pooling' in self.owner.mesa_config.layers):
            return None
        return MesaLinearPoolFunction.apply(
            input, functools.partial(F.adaptive_avg_pool2d, output_size=output_size),
            adaptive_pool_adjoint(output_size))

    def _sigmoid(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gate the module computes itself (PIDNet's boundary attention): its output packed
        per channel, as ``MesaSigmoid``."""
        if not (is_activation(x) and x.requires_grad and x.dim() >= 2):
            return None
        site = self._site('activation', {'output': (1 if x.dim() >= 4 else -1, None)})
        if site is None:
            return None
        return MesaSmoothFunction.apply(x, torch.sigmoid, 'sigmoid', False, *site)

    def _product(self, a: Any, b: Any) -> torch.Tensor | None:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or \
                not (a.is_floating_point() and b.is_floating_point()) or \
                not (a.requires_grad or b.requires_grad):
            return None
        quantizers = self._operand_quantizers(a, b)
        return None if quantizers is None else MesaMulFunction.apply(a, b, *quantizers)

    def _operand_quantizers(self, a: torch.Tensor, b: torch.Tensor) -> tuple | None:
        """The quantizers of a product's operands (None for one kept as it is), or None when
        neither is worth packing or products are switched off."""
        pack_a = b.requires_grad and _worth_packing(a, b)  # a is saved for b's gradient
        pack_b = a.requires_grad and _worth_packing(b, a)
        if not (pack_a or pack_b):
            return None
        roles = {r: (_product_group_dim(t), 1) for r, t, p in (('a', a, pack_a), ('b', b, pack_b))
                 if p}
        site = self._site('product', roles)
        if site is None:
            return None
        quantizers = iter(site)
        return next(quantizers) if pack_a else None, next(quantizers) if pack_b else None

    def _linear(self, input: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
        if not (is_activation(input) and (weight.requires_grad or input.requires_grad)):
            return None
        site = self._site('linear', {'input': (-1, None)})
        if site is None:
            return None
        return MesaLinearFunction.apply(input, weight, bias, *site)


def saved_activation_bytes(node: Any) -> int:
    """Bytes of the tensors needing gradients that a torch autograd node keeps (its
    ``_saved_*`` attributes; Parameters, buffers, masks and indices not counted). Mesa's own
    Functions and other Python ones count as 0: what they keep is theirs to say."""
    from torch.autograd.function import BackwardCFunction
    if isinstance(node, BackwardCFunction):
        return 0
    total = 0
    for name in dir(node):
        if not name.startswith('_saved_'):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # a saved tensor already freed
            continue
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.requires_grad and \
                    not isinstance(t, nn.Parameter) and t.dim() > 0:
                total += t.numel() * t.element_size()
    return total


def _softmax_args(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, int]:
    """(input, dim) of a softmax call without ``dtype``, else (None, 0)."""
    names = ('input', 'dim', '_stacklevel', 'dtype') if func is F.softmax else \
        ('input', 'dim', 'dtype')
    bound = dict(zip(names, args), **kwargs)
    x, dim = bound.get('input', bound.get('self')), bound.get('dim')
    if bound.get('dtype') is not None or not is_activation(x) or dim is None:
        return None, 0
    return x, dim


def _softmax_output(t: torch.Tensor) -> bool:
    """Whether ``t`` is what torch's own softmax returned (its node saves it in full)."""
    return type(t.grad_fn).__name__ == 'SoftmaxBackward0'


def _product_group_dim(t: torch.Tensor) -> int:
    """Channels of feature maps (dim 1 of ``feature_map(t)``), else of token features (last
    dim)."""
    return 1 if t.dim() >= 4 else -1


def _called_children(module: nn.Module) -> list[nn.Module]:
    """The children a forward calls: direct children, and the items of ``ModuleList`` /
    ``ModuleDict`` containers (which are never called themselves), recursively."""
    found = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found.extend(_called_children(child))
        else:
            found.append(child)
    return found


class MesaFunctional(MesaModule, nn.Module):
    """Any module, its own functional matmuls / softmaxes / products / linears / fused
    attention compressed.

    The conversion wraps, not replaces, the module's forward (so a subclass's forward is kept
    as it is). Calls made while one of its child modules runs are left to that child.
    """

    mesa_sites: nn.ModuleDict  # made by ``mesa_call_sites``
    mesa_child_depth: int
    # Calls of the module's own left to torch's autograd, by reason (a fused attention with
    # dropout, ``layers.sdpa.left_to_torch``), counted over its training steps; for a module of
    # the generic path also the calls of its first step with no Mesa route whose node keeps an
    # activation (``saved_activation_bytes``), by op name.
    mesa_left_to_torch: Counter
    # Converted by the generic path (``convert_to_mesa`` for a module no handler converts): its
    # first training step finds out whether its own forward calls anything Mesa routes, and if
    # not, the module goes back to its own class (``mesa_release``), so it costs nothing after.
    mesa_generic: bool = False
    # Released while a compiled graph ran it (``opaque.inside``), whose guards hold its class
    # and hooks: it keeps both and runs its own forward.
    mesa_inert: bool = False

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        self.mesa_child_depth = 0
        self.mesa_left_to_torch = Counter()
        self.mesa_deferred_estimates: dict[str, dict[str, torch.Tensor]] = {}
        for child in _called_children(self):
            if child is not getattr(self, 'mesa_sites', None):
                child.register_forward_pre_hook(_ChildDepth(self, 1))
                child.register_forward_hook(_ChildDepth(self, -1))

    def mesa_defer_estimates(self, key: str, estimates: dict[str, torch.Tensor]) -> None:
        """Keep a checkpoint's estimates for the call site ``key`` until the site's quantizer is
        made (``training_state.restore_training_state``: a resumed run makes it in its first
        step)."""
        self.mesa_deferred_estimates[key] = estimates

    def mesa_call_sites(self) -> nn.ModuleDict:
        """The quantizers of the module's call sites, a child made at its first routed call:
        forwards that run every child in turn (timm's ``RegStage``) never meet it unless the
        module routes something."""
        if 'mesa_sites' not in self._modules:
            self.mesa_sites = nn.ModuleDict()
        return self.mesa_sites

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # its children's parameters too: the first block after the image gets an input that
        # needs no gradient, but its own calls then read what its children made
        if self.mesa_inert or not self.mesa_active(*tensors, *self.parameters()):
            return super().forward(*args, **kwargs)
        self.mesa_child_depth = 0
        capture = _Capture(self, probing=self.mesa_probe_pending)
        with capture:
            out = super().forward(*args, **kwargs)
        if self.mesa_probe_pending:
            self.mesa_probe_pending = False
            if not capture.routed:
                self.mesa_release()
        return out

    def mesa_release(self) -> None:
        """Back to the module's own class, its child hooks removed: a module of the generic
        path whose forward calls nothing Mesa routes. What it counted in ``mesa_left_to_torch``
        stays on it for reports."""
        if opaque.inside():
            self.mesa_inert = True
            return
        for child in _called_children(self):
            for hooks in (child._forward_pre_hooks, child._forward_hooks):
                for key in [k for k, h in hooks.items()
                            if isinstance(h, _ChildDepth) and h.parent is self]:
                    del hooks[key]
        if 'mesa_sites' in self._modules:
            del self.mesa_sites
        self.__class__ = own_type(self)


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks besides the ones a ``MesaFunctional``
    parent counts its children's calls with (which only mark whose calls are whose)."""
    return bool(module._backward_pre_hooks or module._backward_hooks) or any(
        not isinstance(hook, _ChildDepth)
        for hooks in (module._forward_pre_hooks, module._forward_hooks) for hook in hooks.values())


def own_type(module: nn.Module) -> type:
    """A module's class as its author wrote it, seen through the generic path's wrapper (which
    the module's first training step may remove again): what exact-type checks ask."""
    cls = type(module)
    if isinstance(module, MesaFunctional) and module.mesa_generic:
        return next(b for b in cls.__bases__ if not issubclass(b, MesaModule))
    return cls


def convert_generic(module: nn.Module, config: MesaConfig) -> None:
    """The generic path: ``module``'s own forward, whatever its class, through
    ``MesaFunctional``, probed in its first training step (``MesaFunctional.mesa_generic``)."""
    MesaFunctional.convert(module, config)
    module.mesa_generic = True
    module.mesa_probe_pending = True
