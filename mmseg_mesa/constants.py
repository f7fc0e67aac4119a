"""Constant tensors that backward formulas hand torch's kernels (a mean of 0 and a 1/std of 1 for
each normalized set, a zero to select with), kept once per device rather than filled at every
call: on a GPU each fill is a kernel launch, and a norm's backward would make two of them per
layer and step."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .state import CONSTANTS


def filled(value: float, shape: Sequence[int], like: torch.Tensor,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` holding ``value`` on ``like``'s device.

    A view of one buffer per value, dtype and device, grown to the largest size asked for;
    nothing may write into it (torch's backward kernels only read their moments). A fake
    tensor's (tracing) or one under inference mode is made afresh and not kept.
    """
    numel = math.prod(shape)
    if type(like) is not torch.Tensor or torch.is_inference_mode_enabled():
        return torch.full(tuple(shape), value, dtype=dtype, device=like.device)
    key = (value, dtype, like.device)
    buffer = CONSTANTS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = CONSTANTS[key] = torch.full((numel,), value, dtype=dtype, device=like.device)
    return buffer[:numel].view(tuple(shape))
