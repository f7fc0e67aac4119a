"""Mesa versions of mmcv / mmseg modules whose forward must be rewritten.

- mmseg's Swin ``WindowMSA`` computes ``q @ k^T`` and ``attn @ v`` functionally; ``MesaWindowMSA``
  routes them through ``MesaMatMul`` (one quantization group per head). Its Linear, Softmax and
  Dropout children are converted by their own handlers.
- mmcv's ``DropPath`` becomes ``MesaDropPath`` (one saved bit per sample).
- Decode heads using ``BaseDecodeHead.loss_by_feat`` (UPerHead, FCNHead, ...) become
  ``MesaDecodeHead``: the upsampling + losses run through ``RecomputedLoss``, exactly.
"""
from __future__ import annotations

import torch
from mmcv.cnn.bricks.drop import DropPath
from mmseg.models.backbones.swin import WindowMSA
from mmseg.models.decode_heads.decode_head import BaseDecodeHead

from ..config import MesaConfig
from ..layers.base import MesaModule
from ..layers.dropout import MesaDropPathFunction
from ..layers.matmul import MesaMatMul
from ..layers.recompute import recomputed_losses


class MesaWindowMSA(MesaModule, WindowMSA):
    """Swin window attention with both attention matmuls compressed per head."""

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        self.mesa_qk = MesaMatMul(mesa_config=config.for_layer('matmul'))
        self.mesa_av = MesaMatMul(mesa_config=config.for_layer('matmul'))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self.mesa_active(x, self.qkv.weight):
            return super().forward(x, mask)
        # Same steps as WindowMSA.forward (mmseg 1.2.2), with the two matmuls as modules.
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads,
                                  C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
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


class MesaDropPath(MesaModule, DropPath):
    """mmcv ``DropPath`` keeping a 1-bit keep mask per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x) or not 0.0 < self.drop_prob < 1.0:
            return super().forward(x)
        return MesaDropPathFunction.apply(x, self.drop_prob)


class MesaDecodeHead(MesaModule, BaseDecodeHead):
    """A decode head whose loss keeps only the low-resolution logits for backward."""

    def loss_by_feat(self, seg_logits: torch.Tensor, batch_data_samples: list) -> dict:
        if not self.mesa_active(seg_logits):
            return super().loss_by_feat(seg_logits, batch_data_samples)
        return recomputed_losses(
            lambda logits: super(MesaDecodeHead, self).loss_by_feat(logits, batch_data_samples),
            seg_logits)


def decode_head_check(head: BaseDecodeHead) -> str | None:
    if type(head).loss_by_feat is not BaseDecodeHead.loss_by_feat:
        return f'{type(head).__name__} has its own loss_by_feat'
    return None
