"""Softmax that saves only its output (the original Mesa saved input and output)."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MesaConfig
from ..quantizer import ActivationQuantizer, unpack
from ..registry import mesa_layer
from ..reuse import attach_codes
from ..saved import SOFTMAX_OUTPUT, load, save
from .autocast import no_autocast_backward, record_input, returns_owned
from .base import MesaModule
from .formulas import softmax_backward
from .recomputed_map import SHARP_MAP, Recipe, exact_map, offer, recipe_of, replays


class MesaSoftmaxFunction(torch.autograd.Function):

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, dim: int, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        ctx.dim = dim
        y = F.softmax(x, dim)
        packed = quantizer.pack(y)
        save(ctx, packed, label=SOFTMAX_OUTPUT)
        attach_codes(y, packed)  # attn @ v saves the same map: it reuses these codes
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (packed,) = load(ctx)
        grad_x = softmax_backward(grad, unpack(packed, torch.float32), ctx.dim)
        return grad_x.to(ctx.input_dtype), None, None


class MesaMapSoftmaxFunction(torch.autograd.Function):
    """``F.softmax(x, dim)`` of logits with a recipe: keeps nothing, replays the map."""

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, dim: int, recipe: Recipe) -> torch.Tensor:
        record_input(ctx, x)
        ctx.map = recipe.then('softmax', dim)
        ctx.dim = dim
        y = F.softmax(x, dim)
        offer(y, ctx.map)  # attn @ v replays the same map
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_x = softmax_backward(grad, ctx.map.replay(), ctx.dim)
        return grad_x.to(ctx.input_dtype), None, None


def map_softmax(x: torch.Tensor, dim: int, recipe: Recipe, left_to_torch: Counter
                ) -> torch.Tensor | None:
    """The softmax of logits with a recipe, for a converted ``nn.Softmax`` and a module's own
    call alike: the map replayed in backward, or, where the replay would stray, torch's over
    logits it recomputes (``recomputed_map.exact_map``, counted in ``left_to_torch``); None
    where neither holds (the caller packs the map)."""
    if replays(recipe):
        return MesaMapSoftmaxFunction.apply(x, dim, recipe)
    y = exact_map(x, dim, recipe)
    if y is not None:
        left_to_torch[SHARP_MAP] += 1
    return y


def softmax_dim(dim: int | None, ndim: int) -> int:
    """nn.Softmax's legacy rule when ``dim`` is None."""
    if dim is not None:
        return dim
    return 0 if ndim in (0, 1, 3) else 1


@mesa_layer(nn.Softmax, 'softmax')
class MesaSoftmax(MesaModule, nn.Softmax):
    """``nn.Softmax`` saving its ``bits``-bit output, one quantization group per index of dim 1.

    For attention maps ``(B, heads, N, N)`` that is one group per head, as in Mesa. Logits with
    a recipe (``layers.recomputed_map``: SwinV2's attention calls its softmax as a child) keep no
    map; where their replay would stray, the attention is left to torch, counted in
    ``mesa_left_to_torch`` as a ``MesaFunctional`` counts it.
    """

    mesa_quantizers = {'quant_output': (1, 1)}

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        self.mesa_left_to_torch: Counter = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x) or x.dim() < 2:
            return super().forward(x)
        dim = softmax_dim(self.dim, x.dim())
        recipe = recipe_of(x) if self.mesa_config.attention_maps == 'recompute' else None
        if recipe is not None and dim % x.dim() == x.dim() - 1:  # logits a parent computed
            y = map_softmax(x, dim, recipe, self.mesa_left_to_torch)
            if y is not None:
                return y
        return MesaSoftmaxFunction.apply(x, dim, self.quant_output)
