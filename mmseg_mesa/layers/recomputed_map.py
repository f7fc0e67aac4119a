"""Attention written op by op, its maps recomputed in backward instead of kept.

A module that computes attention itself, ``softmax(q @ k.transpose(-2, -1) * scale + bias) @ v``
(mmpretrain's LeViT, SwinV2's windows), has its matmuls and its softmax routed one by one by the
generic path; 8-bit probabilities and q packed per head were most of such a backbone's
gradient error (LeViT 0.046; 0.028 with the map replayed from q and k packed per head and
channel). Converted attention (``attention_core``) keeps no map: backward recomputes it from the
8-bit q and k. This does the same for the op-by-op form:

- multi-head logits ``q @ k`` are computed by ``MesaLogitsFunction``, which packs q and k per
  head and channel (as converted attention does) for its own backward, refined to about 16 bits
  where 8 bits would replay the product too loosely (``attention_core.refined_heads``; v is
  then refined by the ``attn @ v`` that follows); single-head ones (OCR's, DANet's blocks) by
  ``MesaMatMulFunction`` as before. Either carries a ``Recipe``, offered through the hand-off
  ``handoff.MAPS``, with the replay's error from 8-bit codes measured on a few rows;
- each element-wise step with a scalar or a batch-independent operand (a scale, a position
  bias, a window mask) and each reshape extends it; an operand larger than
  ``KEPT_OPERAND_FRACTION`` of the logits is kept as codes of its own;
- the softmax of such logits keeps nothing (``softmax.MesaMapSoftmaxFunction``, from a
  module's own call or an ``nn.Softmax`` child) and offers its output's recipe to the
  ``attn @ v`` that follows, which keeps only v (``MesaMapMatMulFunction``), unless the replay
  would stray by more than ``MAX_REPLAY_ERROR`` (then it packs its map as before).

Each backward replays the recipe from the codes in fp32, as converted attention does: the
forward is torch's, bit for bit. Both backwards run before the logits' own node (they are
downstream of it), so its codes are still there.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..codes import is_codes
from ..handoff import MAPS
from ..host import LateReading
from ..quantizer import ActivationQuantizer, Packed, Refined, refine, unpack
from ..reuse import offers_codes, packed_reusing
from ..saved import load, save
from .attention_core import (
    coarse_codes,
    first_image,
    heads_error,
    pack_heads,
    refined_heads,
    replay_reading,
    sampled_error,
    unpack_heads,
)
from .autocast import no_autocast_backward, returns_owned
from .matmul import MesaMatMulFunction, autocast_matmul, left_gradient, right_gradient

# A tensor operand of a step (a position bias) at most this fraction of the logits' elements is
# kept as it is; a larger one (a bias with as many elements as one image's logits, at batch 1 or
# 2) is packed, so that the recipe never keeps more than the map's own codes would.
KEPT_OPERAND_FRACTION = 1 / 16


def _reshaped(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return x.reshape(shape)


def _operand(value: Any) -> Any:
    if is_codes(value):
        return unpack(value, torch.float32)
    return value.float() if isinstance(value, torch.Tensor) else value


STEPS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    'mul': lambda x, c: x * _operand(c),
    'add': lambda x, c: x + _operand(c),
    'sub': lambda x, c: x - _operand(c),
    'div': lambda x, c: x / _operand(c),
    'reshape': _reshaped,
    'softmax': lambda x, dim: F.softmax(x, dim),
}


@dataclass(frozen=True)
class WeakOperand:
    """An operand of the logits' product, held weakly: the tensor while it lives, else the same
    view of its base (``k.transpose(-2, -1)`` is gone by the time the softmax runs, k is not);
    either only while unchanged since the product read it."""

    tensor: weakref.ref
    base: weakref.ref | None
    view: tuple[torch.Size, tuple[int, ...], int]
    version: int

    @classmethod
    def of(cls, t: torch.Tensor) -> WeakOperand:
        base = None if t._base is None else weakref.ref(t._base)
        return cls(weakref.ref(t), base, (t.shape, t.stride(), t.storage_offset()), t._version)

    def get(self) -> torch.Tensor | None:
        t = self.tensor()
        if t is None and self.base is not None:
            base = self.base()
            t = None if base is None else base.as_strided(*self.view)
        return t if t is not None and t._version == self.version else None


@dataclass(frozen=True)
class Recipe:
    """How to rebuild a tensor from the codes of logits (``logits(source)``), then ``steps``,
    each ``(name in STEPS, argument)``."""

    source: Any  # the node of a MesaLogitsFunction or MesaMatMulFunction call
    steps: tuple[tuple[str, Any], ...] = ()
    # how far the replay may stray from the forward's values: the largest difference measured
    # on sampled rows of the logits, times the gain of each step since; from 8-bit q and k even
    # where the source refined them (``attention_core.refined_heads``): it says how sharp the
    # map is, which decides whether it is replayed at all; a 0-d tensor on the device once a
    # step's gain is one (a tensor operand's extreme), read through ``reading``
    error: float | torch.Tensor = 0.0
    reading: LateReading | None = None
    # whether the source keeps q and k refined: ``attn @ v`` then refines v's codes too
    refined: bool = False
    # the product's operands, for ``exact_logits``
    operands: tuple[WeakOperand, WeakOperand] | None = None
    # a map torch's softmax keeps in full (``exact_logits``): ``attn @ v`` is left to torch too
    kept: bool = False

    def then(self, step: str, argument: Any, gain: float | torch.Tensor = 1.0) -> Recipe:
        return dataclasses.replace(self, steps=(*self.steps, (step, argument)),
                                   error=self.error * gain)

    def replay(self) -> torch.Tensor:
        """The tensor, in fp32, from the source's codes."""
        x = logits(self.source)
        for step, argument in self.steps:
            x = STEPS[step](x, argument)
        return x

    @property
    def is_map(self) -> bool:
        """Whether the recipe ends in a softmax (an attention map)."""
        return bool(self.steps) and self.steps[-1][0] == 'softmax'


# The largest replay error (in logits) at which a softmax replays its map rather than packing
# it. Measured at 128x128: mmpretrain's LeViT 0.03-0.05 and DaViT 0.01-0.03 (replayed: gradient
# error 0.046 -> 0.028 and 0.012 -> 0.007); T2T-ViT, whose logits are divided by its qk scale
# (x 12 in its first layers), 0.6-1.4 (replayed: 0.074 -> 0.36).
MAX_REPLAY_ERROR = 0.2


def replays(recipe: Recipe | None) -> bool:
    """Whether a softmax of logits with this recipe replays its map (else it packs it); an
    error on the device as the host has received it (a call late)."""
    if recipe is None:
        return False
    error = recipe.error
    if isinstance(error, torch.Tensor):
        measured = error
        error = recipe.reading.update(lambda: measured)
    return error <= MAX_REPLAY_ERROR


def exact_logits(recipe: Recipe, x: torch.Tensor) -> torch.Tensor | None:
    """``x``, logits with ``recipe``, on a graph of torch's ops recomputed from the product's
    live operands (which saves them in full): ``x``'s values (``ValuesOf``: the same ops on the
    same operands, but no device is asked whether they agree), or None where that graph cannot
    be made: an operand gone or changed in place, a step with an operand other than a number (a
    tensor's gradient would be lost, codes are not its values: recipes keep tensors detached).

    For logits whose replay would stray (``replays``): so large that their maps are sharp
    (T2T-ViT's first layers: each row's largest entry 0.98), their gradient lies in the small
    entries and in small differences between similar tokens, which neither an 8-bit map nor
    8-bit q, k and v keep (T2T-ViT's gradient error 0.081 with its maps packed, 0.011 with its
    attention left to torch). Where this gives None the map is packed."""
    if recipe.operands is None or any(not isinstance(argument, (int, float))
                                      for step, argument in recipe.steps
                                      if step not in ('reshape', 'softmax')):
        return None
    a, b = (operand.get() for operand in recipe.operands)
    if a is None or b is None:
        return None
    y = torch.matmul(a, b)
    for step, argument in recipe.steps:
        y = STEPS[step](y, argument)
    if y.shape != x.shape or y.dtype != x.dtype:
        return None
    return ValuesOf.apply(x.detach(), y)


class ValuesOf(torch.autograd.Function):
    """``values`` (no graph) with the gradient of ``graph``, a recomputation of them: the
    forward's own values, whatever the recomputation rounds differently."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, values: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        return values.view_as(values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, grad


# Why a softmax whose replay would stray leaves its attention to torch (``exact_map``).
SHARP_MAP = 'attention (softmax, attn @ v): logits too large for 8-bit q and k (sharp maps)'


def exact_map(x: torch.Tensor, dim: int, recipe: Recipe) -> torch.Tensor | None:
    """The softmax of logits ``x`` whose replay would stray, over ``exact_logits``: a map torch
    keeps in full, offered as such so that ``attn @ v`` is left to torch too; None where the
    logits cannot be recomputed (the caller packs the map)."""
    exact = exact_logits(recipe, x)
    if exact is None:
        return None
    y = F.softmax(exact, dim)
    offer(y, Recipe(None, kept=True))
    return y


def offer(t: torch.Tensor, recipe: Recipe) -> None:
    """Offer ``recipe`` for ``t`` to the next op of the same forward that reads it."""
    MAPS.offer(t, recipe)


def recipe_of(t: Any) -> Recipe | None:
    """The recipe offered for ``t``, unless ``t`` was modified in place since."""
    return MAPS.get(t) if isinstance(t, torch.Tensor) else None


def logits_recipe(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, quantizer: Any
                  ) -> Recipe | None:
    """The recipe of ``y = a @ b``, a ``MesaLogitsFunction`` output or a ``MesaMatMulFunction``
    output whose node packed both operands (None for any other tensor), with the replay's
    error measured on a few rows (``product_error``), as ``quantizer``'s reading of it
    (``attention_core.replay_reading``: the newest the host has received)."""
    node = y.grad_fn
    source = getattr(node, '_forward_cls', None)
    if source is MesaMatMulFunction and not all(
            isinstance(kind, type) for kind, _, _ in node.mesa_layout):
        return None
    if source not in (MesaMatMulFunction, MesaLogitsFunction):
        return None
    if source is MesaLogitsFunction:  # measured as its forward packed
        refined, error = node.replay
    else:
        refined, error = False, replay_reading(quantizer).update(
            lambda: product_error(node, a, b))
    return Recipe(node, error=error, refined=refined,
                  operands=(WeakOperand.of(a), WeakOperand.of(b)),
                  reading=replay_reading(quantizer, 'map_error'))


def product_error(node: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``attention_core.sampled_error`` of a ``MesaMatMulFunction``'s product replayed from its
    8-bit codes (``coarse_codes``), on the first image: only that image's codes are decoded."""
    batch = a.shape[0] if a.dim() > 2 else 1
    with torch.no_grad():
        decoded = [_first(unpack(first_image(coarse_codes(p), batch), torch.float32), batch)
                   for p in load(node)]
        return sampled_error(*decoded, _first(a, batch), _first(b, batch))


def _first(t: torch.Tensor, batch: int) -> torch.Tensor:
    """The first image of a batch-shaped operand; an operand without the batch dim whole."""
    return t[:1] if t.dim() > 2 and t.shape[0] == batch else t


def logits(node: Any) -> torch.Tensor:
    """The fp32 output of a ``logits_recipe`` source, recomputed from the codes it keeps."""
    if node._forward_cls is MesaLogitsFunction:
        return MesaLogitsFunction.logits(node)
    a, b = load(node)
    return unpack(a, torch.float32) @ unpack(b, torch.float32)


def logits_operands(a: Any, b: Any) -> bool:
    """Whether ``a @ b`` has the shape of multi-head attention logits that
    ``MesaLogitsFunction`` takes: ``(B, H, N, d) @ (B, H, d, M)`` with several keys (GCNet's
    context pooling, ``(B, 1, C, N) @ (B, 1, N, 1)``, is no attention), and ``a`` is no map a
    softmax already packed (``attn @ v`` after an ``nn.Softmax`` child: ``MesaMatMulFunction``
    reuses those codes; the caller also rules out torch's own softmax output). A 3-d product
    (one head: OCR's, DANet's blocks) stays a ``MesaMatMulFunction``, whose codes of two views of
    one tensor are one copy (DANet's channel attention), and replays from its codes."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dim() == b.dim() == 4 and a.shape[:-2] == b.shape[:-2]
            and a.shape[-1] == b.shape[-2] and b.shape[-1] > 1 and not offers_codes(a))


class MesaLogitsFunction(torch.autograd.Function):
    """``q @ k`` of attention logits, ``(B, H, N, d) @ (B, H, d, M)``: q and k (as
    ``(B, H, M, d)``) packed with one group per head and channel, as converted attention packs
    them (attention operands have outlier channels), so that a recipe can replay the logits."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, quant_a: ActivationQuantizer,
                quant_b: ActivationQuantizer) -> torch.Tensor:
        y, ac, bc = autocast_matmul(ctx, a, b)
        ctx.heads = a.shape[1]
        k = bc.transpose(-2, -1)
        # measured on the product (a scale or bias the recipe follows comes later), refined
        # where 8 bits would stray (``attention_core.refined_heads``)
        codes = refined_heads(ac, k, pack_heads(ac, quant_a), pack_heads(k, quant_b), 1.0,
                              quant_a)
        # the recipe needs how sharp the map is even where nothing refines
        error = (codes.coarse_error if codes.coarse_error is not None
                 else replay_reading(quant_a).update(
                     lambda: heads_error(ac, k, codes.q, codes.k, 1.0)))
        ctx.replay = (codes.refined, error)
        save(ctx, codes.q, codes.k)
        return y

    @staticmethod
    def operands(node: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded fp32 q ``(B, H, N, d)`` and k ``(B, H, M, d)`` a call's node keeps."""
        packed_a, packed_b = load(node)
        return unpack_heads(packed_a, node.heads), unpack_heads(packed_b, node.heads)

    @staticmethod
    def logits(node: Any) -> torch.Tensor:
        """The call's output recomputed in fp32 from its codes, in the output's shape."""
        q, k = MesaLogitsFunction.operands(node)
        return q @ k.transpose(-2, -1)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k = MesaLogitsFunction.operands(ctx)
        g = grad.to(torch.float32)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = (g @ k).reshape(ctx.a_meta[0]).to(ctx.a_meta[1])
        if ctx.needs_input_grad[1]:
            grad_b = (q.transpose(-2, -1) @ g).reshape(ctx.b_meta[0]).to(ctx.b_meta[1])
        return grad_a, grad_b, None, None


def step_gain(step: str, value: Any) -> float | torch.Tensor:
    """How much a step can magnify a difference in the tensor it acts on: ``|c|`` for a product,
    ``1 / |c|`` for a quotient (the extreme value of a tensor ``c``: 0-d, on its device), 1 for
    a sum or a view."""
    if step not in ('mul', 'div'):
        return 1.0
    if isinstance(value, torch.Tensor):
        magnitude = value.detach().abs()
        return magnitude.amax() if step == 'mul' else magnitude.amin().reciprocal()
    return abs(value) if step == 'mul' else (math.inf if value == 0 else 1 / abs(value))


def step_operand(value: Any, result: torch.Tensor,
                 quantizer: Callable[[], ActivationQuantizer | None]) -> Any:
    """What a step keeps of its other operand: a number as it is; a tensor that does not grow
    with the batch (its leading dim broadcast) as it is when small, packed when larger
    (``quantizer()`` gives the quantizer); None when the operand cannot be kept."""
    if not isinstance(value, torch.Tensor):
        return value if isinstance(value, (int, float)) else None
    if value.dim() == result.dim() and value.shape[0] != 1 and result.shape[0] != 1:
        return None  # one per image: keeping it would cost as much as the map
    value = value.detach()
    if value.numel() <= KEPT_OPERAND_FRACTION * result.numel() or value.dim() == 0:
        return value
    q = quantizer()
    return None if q is None else q.pack(value)


class MesaMapMatMulFunction(torch.autograd.Function):
    """``attn @ v`` where ``attn`` has a recipe: keeps ``v`` packed and replays ``attn``."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, recipe: Recipe,
                quant_b: ActivationQuantizer) -> torch.Tensor:
        y, _, bc = autocast_matmul(ctx, a, b)
        ctx.map = recipe if ctx.needs_input_grad[1] else None
        packed_b = None
        if ctx.needs_input_grad[0]:
            packed_b = packed_reusing(b, bc, quant_b)
            # v of a map that needs refined q and k (``refined_heads``)
            if recipe.refined and isinstance(quant_b, ActivationQuantizer):
                if not isinstance(packed_b, (Packed, Refined)) or packed_b.shape != bc.shape:
                    packed_b = quant_b.pack(bc)
                packed_b = refine(packed_b, bc)
        save(ctx, packed_b)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed_b,) = load(ctx)
        g = grad.to(ctx.compute_dtype)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = left_gradient(g, unpack(packed_b, ctx.compute_dtype), ctx.a_meta)
        if ctx.needs_input_grad[1]:
            grad_b = right_gradient(g, ctx.map.replay().to(ctx.compute_dtype), ctx.b_meta)
        return grad_a, grad_b, None, None
