"""What each ``torch.ops.mmseg_mesa`` op returns, from its arguments' metadata alone.

``torch.compile``, ``torch.export`` and ``make_fx`` trace with FakeTensors, which carry sizes,
dtype and device but no data, so they cannot run the compiled kernels; without a fake kernel an
op breaks the graph (and ``fullgraph=True`` fails). Each function here allocates what the CPU
and CUDA kernels in ``csrc/`` allocate: the same shapes (``quantized_shape`` and the group
layout of ``csrc/mesa_checks.h``), dtypes and device, all contiguous. ``observe`` and
``observe_quantize`` write the running estimates in place; their schemas declare it, so a fake
has nothing to write. Parameters keep the schemas' names (a caller may pass any by name).
``kernels`` imports this module where it loads ``_C``, so the fakes exist
whenever the ops do; ``tests/test_fake_kernels.py`` holds them to the kernels' results.
"""
from __future__ import annotations

import torch
from torch.library import register_fake

from . import _C  # noqa: F401  (defines the ops the fakes are registered to)


def _groups(shape: torch.Size | list[int], group_dim: int, group_size: int) -> int:
    """``ceil(channels / group_size)`` for the channels along ``group_dim``, as the kernels'
    ``group_layout`` counts them."""
    ndim = len(shape)
    torch._check(ndim >= 1, lambda: 'mmseg_mesa: expected a tensor with at least one dimension')
    torch._check(-ndim <= group_dim < ndim,
                 lambda: f'mmseg_mesa: group_dim={group_dim} is out of range for {ndim} dims')
    torch._check(group_size >= 1, lambda: f'mmseg_mesa: group_size must be >= 1, not '
                                          f'{group_size}')
    return (shape[group_dim] + group_size - 1) // group_size


def _codes(x: torch.Tensor, bits: int, pack: bool) -> torch.Tensor:
    """quantize's codes: one byte per element shaped like ``x``, or with ``pack`` and
    ``bits < 8`` the flat packed bytes."""
    torch._check(1 <= bits <= 8, lambda: f'mmseg_mesa: bits must be in [1, 8], not {bits}')
    torch._check(not pack or bits in (1, 2, 4, 8),
                 lambda: f'mmseg_mesa: only 1, 2, 4 or 8-bit codes can be packed, not {bits}')
    shape = x.shape if not pack or bits == 8 else ((x.numel() * bits + 7) // 8,)
    return x.new_empty(shape, dtype=torch.uint8)


def _mask_bytes(t: torch.Tensor) -> torch.Tensor:
    """One bit per element of ``t``, the last byte padded."""
    return t.new_empty(((t.numel() + 7) // 8,), dtype=torch.uint8)


@register_fake('mmseg_mesa::observe')
def observe(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor, seen: torch.Tensor,
            group_dim: int, group_size: int, decay: float) -> torch.Tensor:
    return lower.new_empty((2, _groups(x.shape, group_dim, group_size)))


@register_fake('mmseg_mesa::quantize')
def quantize(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, bits: int,
             group_dim: int, group_size: int, stochastic: bool, seed: int, offset: int,
             pack: bool) -> torch.Tensor:
    _groups(x.shape, group_dim, group_size)
    return _codes(x, bits, pack)


@register_fake('mmseg_mesa::dequantize')
def dequantize(codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, bits: int,
               shape: list[int], group_dim: int, group_size: int, dtype: torch.dtype,
               divisor: torch.Tensor | None = None) -> torch.Tensor:
    _groups(shape, group_dim, group_size)
    return codes.new_empty(shape, dtype=dtype)


@register_fake('mmseg_mesa::observe_quantize')
def observe_quantize(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor,
                     seen: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor | None,
                     group_dim: int, group_size: int, decay: float, bits: int,
                     stochastic: bool, seed: int, offset: int, pack: bool, rows: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = _groups(x.shape, group_dim, group_size)
    return _codes(x, bits, pack), lower.new_empty((groups,)), lower.new_empty((groups,))


@register_fake('mmseg_mesa::refine')
def refine(x: torch.Tensor, codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
           mean: torch.Tensor | None, rstd: torch.Tensor | None, group_dim: int,
           group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = _groups(x.shape, group_dim, group_size)
    return x.new_empty(x.shape, dtype=torch.uint8), lower.new_empty((groups,)), lower.new_empty(
        (groups,))


@register_fake('mmseg_mesa::dequantize_refined')
def dequantize_refined(codes: torch.Tensor, fine: torch.Tensor, lower: torch.Tensor,
                       scale: torch.Tensor, fine_lower: torch.Tensor, fine_scale: torch.Tensor,
                       shape: list[int], group_dim: int, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    _groups(shape, group_dim, group_size)
    return codes.new_empty(shape, dtype=dtype)


@register_fake('mmseg_mesa::norm_terms')
def norm_terms(rstd: torch.Tensor, decoded_invstd: torch.Tensor, weight: torch.Tensor | None,
               eps: float, reliable: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rstd.new_empty(rstd.shape), rstd.new_empty(rstd.shape), rstd.new_empty(rstd.shape)


@register_fake('mmseg_mesa::pack_mask')
def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    return _mask_bytes(mask)


@register_fake('mmseg_mesa::unpack_mask')
def unpack_mask(bytes: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return bytes.new_empty(shape, dtype=torch.bool)


@register_fake('mmseg_mesa::pack_positive')
def pack_positive(x: torch.Tensor) -> torch.Tensor:
    return _mask_bytes(x)


@register_fake('mmseg_mesa::mask_select')
def mask_select(values: torch.Tensor, bytes: torch.Tensor) -> torch.Tensor:
    return values.new_empty(values.shape)


@register_fake('mmseg_mesa::mask_select_')
def mask_select_(values: torch.Tensor, bytes: torch.Tensor) -> None:
    return None
