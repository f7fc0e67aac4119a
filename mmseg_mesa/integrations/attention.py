"""mmseg's own attention modules, rewritten step by step so that no map is kept for backward.

Swin's ``WindowMSA``, BEiT's (and MAE's) ``BEiTAttention`` and Twins'
``LocallyGroupedSelfAttention`` compute ``q @ k^T``, the bias or mask, the softmax and
``attn @ v`` in their forward. Each Mesa class repeats its forward (mmseg 1.2.2) with that
stretch replaced by ``MesaAttentionFunction``, which runs the same ops (bit-identical) and
keeps 8-bit q, k, v instead of the map. Their Linear and Dropout children are converted by their
own handlers. With ``attention_maps='stored'`` Swin's attention compresses both matmuls per head
instead; BEiT's and Twins' are then converted by ``MesaFunctional`` (``convert_attention``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from mmseg.models.backbones.beit import BEiTAttention
from mmseg.models.backbones.swin import WindowMSA
from mmseg.models.backbones.twins import LocallyGroupedSelfAttention
from torch import nn

from ..config import MesaConfig
from ..layers.attention_core import (
    ATTENTION_QUANTIZERS,
    FUSED_QKV_QUANTIZERS,
    MesaAttentionFunction,
    attention_dropout,
    recomputes_maps,
)
from ..layers.base import MesaModule, make_quantizer
from ..layers.intercept import MesaFunctional
from ..layers.linear import MesaLinearFunction
from ..layers.matmul import MesaMatMul


class MesaWindowMSA(MesaModule, WindowMSA):
    """Swin window attention: no map kept (``MesaAttentionFunction``), or with
    ``attention_maps='stored'`` both attention matmuls compressed per head."""

    mesa_quantizers = FUSED_QKV_QUANTIZERS

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        self.mesa_qk = MesaMatMul(mesa_config=config.for_layer('matmul'))
        self.mesa_av = MesaMatMul(mesa_config=config.for_layer('matmul'))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self.mesa_active(x, self.qkv.weight):
            return super().forward(x, mask)
        # Same steps as WindowMSA.forward (mmseg 1.2.2).
        B, N, C = x.shape
        projected = self.qkv(x)
        qkv = projected.reshape(B, N, 3, self.num_heads,
                                C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        dropout_p = attention_dropout(self.attn_drop, self.training)
        if dropout_p is not None and recomputes_maps(self.mesa_config, mask, dropout_p):
            x = MesaAttentionFunction.apply(
                q, k, v, self.relative_position_bias_table, self.relative_position_index,
                None if mask is None else mask.unsqueeze(1), None, dropout_p, False,
                (self.quant_attn_qkv,), projected, self.scale)
            return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        attn = self.mesa_qk(q, k.transpose(-2, -1))
        window_area = self.window_size[0] * self.window_size[1]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            window_area, window_area, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            windows = mask.shape[0]
            attn = attn.view(B // windows, windows, self.num_heads, N,
                             N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        x = self.mesa_av(attn, v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


class MesaBEiTAttention(MesaModule, BEiTAttention):
    """BEiT / MAE attention (relative position bias, optional q/v biases) keeping no map."""

    mesa_quantizers = FUSED_QKV_QUANTIZERS

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        # the q/v-bias path runs F.linear on qkv's weight itself: its input, as a Linear's
        self.mesa_qkv_input = make_quantizer(config.for_layer('linear'), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x, self.qkv.weight):
            return super().forward(x)
        # Same steps as BEiTAttention.forward (mmseg 1.2.2).
        B, N, C = x.shape
        if self.bias == 'qv_bias':
            k_bias = torch.zeros_like(self.v_bias, requires_grad=False)
            qkv_bias = torch.cat((self.q_bias, k_bias, self.v_bias))
            if 'linear' in self.mesa_config.layers:
                qkv = MesaLinearFunction.apply(x, self.qkv.weight, qkv_bias, self.mesa_qkv_input)
            else:
                qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        else:
            qkv = self.qkv(x)
        projected = qkv
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        x = MesaAttentionFunction.apply(
            q, k, v, self.relative_position_bias_table,
            None if self.relative_position_bias_table is None else self.relative_position_index,
            None, None, attention_dropout(self.attn_drop, self.training), False,
            (self.quant_attn_qkv,), projected, self.scale)
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


class MesaLocallyGroupedSelfAttention(MesaModule, LocallyGroupedSelfAttention):
    """Twins' locally-grouped attention (padding mask, scale after the product) keeping no map."""

    mesa_quantizers = ATTENTION_QUANTIZERS

    def forward(self, x: torch.Tensor, hw_shape: tuple[int, int]) -> torch.Tensor:
        if not self.mesa_active(x, self.qkv.weight):
            return super().forward(x, hw_shape)
        # Same steps as LocallyGroupedSelfAttention.forward (mmseg 1.2.2).
        b, n, c = x.shape
        h, w = hw_shape
        x = x.view(b, h, w, c)
        pad_l = pad_t = 0
        pad_r = (self.window_size - w % self.window_size) % self.window_size
        pad_b = (self.window_size - h % self.window_size) % self.window_size
        x = F.pad(x, (0, 0, pad_l, pad_r, pad_t, pad_b))
        Hp, Wp = x.shape[1:-1]
        _h, _w = Hp // self.window_size, Wp // self.window_size
        mask = torch.zeros((1, Hp, Wp), device=x.device)
        mask[:, -pad_b:, :].fill_(1)
        mask[:, :, -pad_r:].fill_(1)
        x = x.reshape(b, _h, self.window_size, _w, self.window_size, c).transpose(2, 3)
        mask = mask.reshape(1, _h, self.window_size, _w, self.window_size).transpose(2, 3).reshape(
            1, _h * _w, self.window_size * self.window_size)
        attn_mask = mask.unsqueeze(2) - mask.unsqueeze(3)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, (-1000.0)).masked_fill(
            attn_mask == 0, 0.0)
        qkv = self.qkv(x).reshape(b, _h * _w, self.window_size * self.window_size, 3,
                                  self.num_heads, c // self.num_heads).permute(3, 0, 1, 4, 2, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        groups, heads, tokens, dim = q.shape[1:]
        attn = MesaAttentionFunction.apply(
            q.reshape(b * groups, heads, tokens, dim), k.reshape(b * groups, heads, tokens, dim),
            v.reshape(b * groups, heads, tokens, dim), None, None,
            attn_mask.view(groups, 1, tokens, tokens), self.scale,
            attention_dropout(self.attn_drop, self.training), False,
            (self.quant_attn_q, self.quant_attn_k, self.quant_attn_v))
        attn = attn.view(b, groups, heads, tokens, dim).transpose(2, 3).reshape(
            b, _h, _w, self.window_size, self.window_size, c)
        x = attn.transpose(2, 3).reshape(b, _h * self.window_size, _w * self.window_size, c)
        if pad_r > 0 or pad_b > 0:
            x = x[:, :h, :w, :].contiguous()
        x = x.reshape(b, n, c)
        x = self.proj(x)
        return self.proj_drop(x)


# The classes above, by the mmseg type they rewrite.
REWRITTEN = {BEiTAttention: MesaBEiTAttention,
             LocallyGroupedSelfAttention: MesaLocallyGroupedSelfAttention}


def map_free_reason(module: nn.Module, config: MesaConfig) -> str | None:
    """Why a BEiT / Twins attention keeps its maps (``MesaFunctional``), or None."""
    base = next(t for t in REWRITTEN if isinstance(module, t))
    if type(module).forward is not base.forward:
        return f'{type(module).__name__} has its own forward'
    if config.attention_maps != 'recompute':
        return f"attention_maps={config.attention_maps!r}"
    if not {'matmul', 'softmax'} <= config.layers:
        return "'matmul' or 'softmax' is not among the compressed layer types"
    rate = attention_dropout(module.attn_drop, True)
    if rate is None:
        return f'attn_drop is a {type(module.attn_drop).__name__}, not an nn.Dropout'
    if rate >= 1.0:
        return 'attn_drop drops everything'
    return None


def convert_attention(module: nn.Module, config: MesaConfig) -> None:
    """BEiT / MAE / Twins attention: rewritten to keep no map, or else (a subclass with its own
    forward, maps asked to be stored) its functional ops compressed by ``MesaFunctional``."""
    reason = map_free_reason(module, config)
    if reason is None:
        REWRITTEN[next(t for t in REWRITTEN if isinstance(module, t))].convert(module, config)
    else:
        MesaFunctional.convert(module, config)
        if config.attention_maps == 'recompute':
            module.mesa_note = f'keeps an 8-bit copy of its attention maps ({reason})'

