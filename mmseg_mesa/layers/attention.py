"""``nn.MultiheadAttention`` rewritten on its own Parameters with Mesa matmuls and softmax.

torch runs MHA functionally (``in_proj_weight``, bmm, softmax, bmm, ``out_proj`` through
``F.linear``), so swapping its child modules would change nothing. This module re-implements the
``need_weights=True`` path of ``F.multi_head_attention_forward`` step by step (same branches, same
ops, so the forward is bit-identical to it) with every saved activation compressed: one packed copy
of the input feeds all three projections, the attention operands and map are quantized per head.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MesaConfig
from ..quantizer import ActivationQuantizer, unpack
from ..registry import mesa_layer
from ..saved import load, save
from .attention_core import ATTENTION_QUANTIZERS, MesaAttentionFunction, recomputes_maps
from .autocast import autocast_inputs, autocast_off, no_autocast_backward, returns_owned
from .base import MesaModule
from .dropout import MesaDropout
from .linear import MesaLinearFunction
from .matmul import MesaMatMul
from .softmax import MesaSoftmax


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class MesaInProjectionFunction(torch.autograd.Function):
    """q, k, v projections by chunks of one packed weight, as ``_in_projection_packed`` does
    when q, k and v are distinct tensors: three ``F.linear`` calls. When the three inputs hold the
    same data (mmcv's batch-first transposes of one tensor) only one packed copy is saved.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None,
                quantizers: tuple[ActivationQuantizer, ...]) -> tuple[torch.Tensor, ...]:
        qc, kc, vc, wc, bc = autocast_inputs(ctx, q, k, v, weight, bias)
        ctx.input_dtypes = (q.dtype, k.dtype, v.dtype)  # q, k and v may differ in dtype
        weights = wc.chunk(3)
        biases = bc.chunk(3) if bc is not None else (None, None, None)
        with autocast_off(ctx.device_type):
            outs = tuple(F.linear(x, w, b) for x, w, b in zip((qc, kc, vc), weights, biases))
        ctx.shared = _same_data(q, k) and _same_data(q, v)
        packed: list = [None, None, None]
        if ctx.needs_input_grad[3]:
            packed[0] = quantizers[0].pack(qc)
            if not ctx.shared:
                packed[1] = quantizers[1].pack(kc)
                packed[2] = quantizers[2].pack(vc)
        save(ctx, *packed, weight)
        return outs

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        *packed, weight = load(ctx)
        weights = weight.to(ctx.compute_dtype).chunk(3)
        grads = tuple(g.to(ctx.compute_dtype) for g in grads)
        grad_inputs = [None, None, None]
        for i in range(3):
            if ctx.needs_input_grad[i]:
                grad_inputs[i] = (grads[i] @ weights[i]).to(ctx.input_dtypes[i])
        grad_w = grad_b = None
        if ctx.needs_input_grad[3]:
            # rows of the decoded inputs, made once where shared (codes kept in the layout of
            # transposed tokens decode to it, and their rows are a copy)
            xs = [unpack(p) for p in packed[:1 if ctx.shared else 3]]
            rows = [x.reshape(-1, x.shape[-1]) for x in xs] * (3 if ctx.shared else 1)
            grad_w = torch.cat([g.reshape(-1, g.shape[-1]).t() @ x for g, x in zip(grads, rows)]
                               ).to(weight.dtype)
        if ctx.needs_input_grad[4]:
            grad_b = torch.cat([g.reshape(-1, g.shape[-1]).sum(0) for g in grads])
            grad_b = grad_b.to(weight.dtype)
        return (*grad_inputs, grad_w, grad_b, None)


def unsupported_mha_reason(mha: nn.MultiheadAttention) -> str | None:
    """Why a MultiheadAttention cannot be rewritten (None when it can)."""
    if not mha._qkv_same_embed_dim:
        return 'separate q/k/v projection weights (kdim/vdim != embed_dim) are not supported'
    if mha.bias_k is not None or mha.add_zero_attn:
        return 'add_bias_kv / add_zero_attn are not supported'
    return None


# out_proj is used through its weight by the rewritten attention.
@mesa_layer(nn.MultiheadAttention, 'attention', unsupported_mha_reason, covers=('out_proj',))
class MesaMultiheadAttention(MesaModule, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with every saved activation compressed.

    The forward follows torch's explicit-weights path; with ``need_weights=False`` torch itself
    would use ``scaled_dot_product_attention`` instead, whose rounding may differ in the last bit.
    """

    mesa_quantizers = {**{name: (-1, None) for name in ('quant_q', 'quant_k', 'quant_v',
                                                        'quant_out')},
                       **ATTENTION_QUANTIZERS}

    def mesa_setup(self, config: MesaConfig) -> None:
        reason = unsupported_mha_reason(self)
        if reason is not None:
            raise ValueError(f'MesaMultiheadAttention: {reason}')
        super().mesa_setup(config)
        self.mesa_qk = MesaMatMul(mesa_config=config.for_layer('matmul'))
        self.mesa_softmax = MesaSoftmax(dim=-1, mesa_config=config.for_layer('softmax'))
        self.mesa_attn_drop = MesaDropout(self.dropout, mesa_config=config.for_layer('dropout'))
        self.mesa_av = MesaMatMul(mesa_config=config.for_layer('matmul'))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if (not self.mesa_active(query, key, value, self.in_proj_weight) or is_causal
                or query.dim() != 3):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        if self.batch_first:
            # nn.MultiheadAttention keeps q/k/v identity through its transposes; so do we.
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._mesa_attention(query, key, value, key_padding_mask, need_weights,
                                            attn_mask, average_attn_weights)
        if self.batch_first:
            out = out.transpose(1, 0)
        return out, weights

    def _mesa_attention(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                        average_attn_weights):
        tgt_len, bsz, embed_dim = query.shape
        heads = self.num_heads
        head_dim = embed_dim // heads
        # boolean masks become 0 / -inf: a mask made of them is kept as bits without reading it
        boolean = (attn_mask is not None or key_padding_mask is not None) and all(
            m is None or m.dtype == torch.bool for m in (attn_mask, key_padding_mask))
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask, mask_name='key_padding_mask',
            other_type=F._none_or_dtype(attn_mask), other_name='attn_mask',
            target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name='attn_mask', other_type=None,
                                      other_name='', target_type=query.dtype, check_other=False)
        q, k, v = self._mesa_in_projection(query, key, value, embed_dim)
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        src_len = k.size(1)
        if key_padding_mask is not None:
            key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len)
                                .expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len))
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        dropout_p = self.dropout if self.training else 0.0
        if recomputes_maps(self.mesa_config, attn_mask, dropout_p):
            mask = None
            if attn_mask is not None:  # (1 or B*H, 1 or L, S) -> (1 or B, 1 or H, ., S)
                shared = attn_mask.shape[0] == 1
                mask = attn_mask.view(1 if shared else bsz, 1 if shared else heads,
                                      *attn_mask.shape[1:])
            result = MesaAttentionFunction.apply(
                q_scaled.view(bsz, heads, tgt_len, head_dim),
                k.view(bsz, heads, src_len, head_dim), v.view(bsz, heads, src_len, head_dim),
                None, None, mask, None, dropout_p, need_weights,
                (self.quant_attn_q, self.quant_attn_k, self.quant_attn_v), None, 1.0,
                (0.0, float('-inf')) if boolean else None)
            out, attn = result if need_weights else (result, None)
            return self._mesa_out_projection(out, tgt_len, bsz, embed_dim, heads, attn,
                                             need_weights, average_attn_weights)
        # (B*H, L, d) viewed as (B, H, L, d): quantization groups are heads.
        scores = self.mesa_qk(q_scaled.view(bsz, heads, tgt_len, head_dim),
                              k.transpose(-2, -1).view(bsz, heads, head_dim, src_len))
        scores = scores.view(bsz * heads, tgt_len, src_len)
        if attn_mask is not None:
            # torch fuses this add into baddbmm; here it is a separate add (last-bit differences
            # are possible only for masked attention, which mmseg's ViT does not use).
            scores = scores + attn_mask
        attn = self.mesa_softmax(scores.view(bsz, heads, tgt_len, src_len))
        if self.training and self.dropout > 0.0:
            attn = self.mesa_attn_drop(attn)
        out = self.mesa_av(attn, v.view(bsz, heads, src_len, head_dim))
        return self._mesa_out_projection(out, tgt_len, bsz, embed_dim, heads, attn,
                                         need_weights, average_attn_weights)

    def _mesa_out_projection(self, out, tgt_len, bsz, embed_dim, heads, attn, need_weights,
                             average_attn_weights):
        """Heads merged, ``out_proj``, and the weights torch returns with them."""
        out = out.view(bsz * heads, tgt_len, out.shape[-1])
        out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = MesaLinearFunction.apply(out, self.out_proj.weight, self.out_proj.bias,
                                       self.quant_out)
        out = out.view(tgt_len, bsz, out.size(1))
        if not need_weights:
            return out, None
        weights = attn.view(bsz, heads, tgt_len, attn.shape[-1])
        return out, (weights.mean(dim=1) if average_attn_weights else weights)

    def _mesa_in_projection(self, q, k, v, embed_dim):
        weight, bias = self.in_proj_weight, self.in_proj_bias
        if k is v and q is k:
            proj = MesaLinearFunction.apply(q, weight, bias, self.quant_q)
            proj = (proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2)
                    .squeeze(-2).contiguous())
            return proj[0], proj[1], proj[2]
        if k is v:
            w_q, w_kv = weight.split([embed_dim, embed_dim * 2])
            b_q, b_kv = bias.split([embed_dim, embed_dim * 2]) if bias is not None else (None,
                                                                                           None)
            q_proj = MesaLinearFunction.apply(q, w_q, b_q, self.quant_q)
            kv_proj = MesaLinearFunction.apply(k, w_kv, b_kv, self.quant_k)
            kv_proj = (kv_proj.unflatten(-1, (2, embed_dim)).unsqueeze(0).transpose(0, -2)
                       .squeeze(-2).contiguous())
            return q_proj, kv_proj[0], kv_proj[1]
        return MesaInProjectionFunction.apply(q, k, v, weight, bias,
                                              (self.quant_q, self.quant_k, self.quant_v))
