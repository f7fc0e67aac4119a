"""The compiled CUDA kernels, as the functions ``quantizer.py`` calls through ``_backend``.

Importing this module loads ``mmseg_mesa._C``, which registers ``torch.ops.mmseg_mesa.*``
(sources in ``csrc/``). Each function mirrors a step of the pure-PyTorch reference
(``reference.py`` for quantize / dequantize, ``quantizer.py`` for the running estimates) and
gives bit-identical results under deterministic rounding.

Supported: contiguous CUDA tensors of float32, float16, bfloat16 or float64; fp32 per-group
``lower``/``scale``/``span`` and bool ``seen`` of shape ``(ceil(channels / group_size),)``.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.mmseg_mesa)
from .rounding import rounding_generator

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TORCH_VERSION: str = _C.TORCH_VERSION
CUDA_VERSION: int = _C.CUDA_VERSION
CUDA_ARCHS: str = _C.CUDA_ARCHS

_ops = torch.ops.mmseg_mesa


def observe(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor, seen: torch.Tensor,
            group_dim: int, group_size: int, decay: float) -> torch.Tensor:
    """Update the running estimates in place (``group_min_max`` + ``ema_update``) and return
    the ``(2, G)`` range covering this batch, as ``ema_update`` does."""
    return _ops.observe(x, lower, span, seen, group_dim, group_size, decay)


def quantize(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, bits: int,
             group_dim: int, group_size: int, stochastic: bool,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 codes shaped like ``x``, one per element (``quantize_reference``).

    Stochastic rounding draws from ``generator``, by default the same dedicated stream the
    reference uses (``rounding.rounding_generator``), so the model's own random stream is
    untouched either way.
    """
    if stochastic and generator is None:
        generator = rounding_generator(x.device)
    return _ops.quantize(x, lower, scale, bits, group_dim, group_size, stochastic, generator)


def dequantize(codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, group_dim: int,
               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale + lower`` (two roundings) cast to ``dtype`` (``dequantize_reference``)."""
    return _ops.dequantize(codes, lower, scale, group_dim, group_size, dtype)
