"""DIVISION's dual-precision compressor: a low-pass copy in bf16 plus a low-bit residual.

DIVISION (Wang et al., arXiv 2208.04187) observes that a feature map's low-frequency component
(LFC) carries most of its energy and tolerates bf16, while the high-frequency residual (HFC) is
small and tolerates a few bits. ``DivisionCompressor.pack(x)`` keeps

- LFC: the mean of every ``block x block`` spatial block, in bf16 (16 / block**2 bits per value);
- HFC: ``x - upsample(LFC)`` (nearest), quantized by Mesa's quantizer to ``bits`` bits with one
  range per (sample, channel), taken from the batch itself (the residual of one sample has no
  running statistics worth tracking), with stochastic rounding when asked for.

``unpack`` returns ``upsample(LFC) + dequantize(HFC)``. With 8x8 blocks and a 2-bit residual a
value costs 2.25 bits instead of 32.

Spatial layout: the channel dimension is moved next to the batch dimension; two remaining
dimensions are (height, width); one remaining dimension is a token sequence, laid out as a square
when its length is a perfect square (Swin windows and square crops) and pooled in runs of
``block`` tokens otherwise; more than two are flattened into a sequence first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .codes import Packed, QuantSpec
from .quantizer import group_min_max, pack, unpack


@dataclass(frozen=True)
class DivisionSpec:
    """Static description of one DIVISION-compressed activation.

    Args:
        block: Side of the average-pooling block of the low-frequency copy.
        bits: Code width of the high-frequency residual (2, 4 or 8).
        channel_dim: The channel dimension (negative counts from the end).
        stochastic: Stochastic rounding of the residual.
        backend: Backend of the residual's quantizer (see ``MesaConfig``).
    """

    block: int = 8
    bits: int = 2
    channel_dim: int = 1
    stochastic: bool = True
    backend: str = 'auto'


@dataclass
class DivisionPacked:
    """A DIVISION-compressed activation: bf16 block means and the packed residual."""

    lfc: torch.Tensor  # (N, C, ceil(H / block), ceil(W / block)) bf16
    hfc: Packed  # the residual, as (N * C, H * W) with one group per row
    shape: torch.Size  # of the original activation
    dtype: torch.dtype
    channel_dim: int  # non-negative
    block: int
    map_shape: tuple[int, int, int, int]  # (N, C, H, W) of the spatial view

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.lfc, *self.hfc.tensors())

    def meta(self) -> tuple:
        return (self.hfc.meta(), self.shape, self.dtype, self.channel_dim, self.block,
                self.map_shape)

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> DivisionPacked:
        hfc_meta, *rest = meta
        return cls(tensors[0], Packed.rebuild(tuple(tensors[1:]), hfc_meta), *rest)

    def sample_range(self, start: int, stop: int) -> None:
        """None: the residual is grouped along its dim 0 (one group per (sample, channel) row),
        which ``Packed.sample_range`` does not slice, so it is decoded whole."""
        return None

    def restore(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        n, c, h, w = self.map_shape
        maps = upsample(self.lfc, self.block, h, w)
        maps += unpack(self.hfc, torch.float32).view(n, c, h, w)
        moved = [self.shape[0], self.shape[self.channel_dim]] + [
            s for d, s in enumerate(self.shape) if d not in (0, self.channel_dim)]
        x = maps.view(moved).movedim(1, self.channel_dim)
        return x.to(dtype or self.dtype).contiguous()


def spatial_view(x: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """``x`` as (N, C, H, W) following the layout rules in the module docstring."""
    if x.dim() < 2:
        raise ValueError('DIVISION needs a batch and a channel dimension, got shape '
                         f'{tuple(x.shape)}')
    if channel_dim == 0:
        raise ValueError('DIVISION: the channel dimension cannot be the batch dimension 0')
    y = x.movedim(channel_dim, 1)
    n, c, *rest = y.shape
    if len(rest) == 2:
        h, w = rest
    else:
        length = math.prod(rest)
        side = math.isqrt(length)
        h, w = (side, side) if side * side == length else (1, length)
    return y.reshape(n, c, h, w).contiguous()


def low_pass(maps: torch.Tensor, block: int) -> torch.Tensor:
    """Block means over (H, W); edges are padded by replication to whole blocks."""
    n, c, h, w = maps.shape
    bh = block if h > 1 else 1  # a sequence is pooled along its length only
    ph, pw = (-h) % bh, (-w) % block
    if ph or pw:
        maps = F.pad(maps, (0, pw, 0, ph), mode='replicate')
    hp, wp = h + ph, w + pw
    return maps.view(n, c, hp // bh, bh, wp // block, block).mean((3, 5))


def upsample(lfc: torch.Tensor, block: int, h: int, w: int) -> torch.Tensor:
    """Nearest-neighbour upsampling of block means back to (h, w), in fp32."""
    bh = block if h > 1 else 1
    n, c, hb, wb = lfc.shape
    up = lfc.float()[:, :, :, None, :, None].expand(n, c, hb, bh, wb, block)
    return up.reshape(n, c, hb * bh, wb * block)[:, :, :h, :w].contiguous()


def division_pack(x: torch.Tensor, spec: DivisionSpec) -> DivisionPacked:
    """Compress ``x`` (no state is involved)."""
    channel_dim = spec.channel_dim % x.dim()
    with torch.no_grad():
        maps = spatial_view(x.detach().float(), channel_dim)
        n, c, h, w = maps.shape
        lfc = low_pass(maps, spec.block).to(torch.bfloat16)
        residual = (maps - upsample(lfc, spec.block, h, w)).view(n * c, h * w)
        lo, hi = group_min_max(residual, 0, 1)
        qspec = QuantSpec(bits=spec.bits, group_dim=0, group_size=1, stochastic=spec.stochastic,
                          backend=spec.backend)
        hfc = pack(residual, qspec, lo, hi - lo)
    return DivisionPacked(lfc, hfc, x.shape, x.dtype, channel_dim, spec.block, (n, c, h, w))


class DivisionCompressor(nn.Module):
    """Drop-in for ``ActivationQuantizer`` in a Mesa layer: ``pack(x)`` -> ``DivisionPacked``.

    It keeps no running estimates, so it has no buffers.
    """

    def __init__(self, spec: DivisionSpec) -> None:
        super().__init__()
        self.spec = spec

    def extra_repr(self) -> str:
        s = self.spec
        return (f'block={s.block}, bits={s.bits}, channel_dim={s.channel_dim}, '
                f'stochastic={s.stochastic}')

    def pack(self, x: torch.Tensor) -> DivisionPacked:
        return division_pack(x, self.spec)
