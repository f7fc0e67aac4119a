"""Autocast and what a Mesa Function's forward records for its backward.

Mesa Functions run their op as autocast would (cast inputs, then the op with autocast off), so
their outputs are bit-identical to torch's under autocast, and their backward picks its dtypes
explicitly (``no_autocast_backward``).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch


def returns_owned(forward: Callable) -> Callable:
    """The forward of a Mesa autograd Function returns no view that a later in-place op cannot
    modify.

    ``F.linear`` of a 3-D input (and other ops) returns a view, and autograd refuses in-place ops
    on a custom Function's view outputs, which mmdet's FFN (``ReLU(inplace=True)`` after a
    Linear) and ``add_`` / ``mul_`` / ``clamp_`` successors do. Such an output is returned as its
    ``detach()``: the same storage and version counter (so saved-tensor checks still see a later
    in-place change), no copy, and no view. An input returned as it is (an in-place activation,
    ``ctx.mark_dirty``) stays as it is.
    """

    @functools.wraps(forward)
    def wrapper(ctx: Any, *args: Any) -> Any:
        out = forward(ctx, *args)
        if isinstance(out, tuple):
            return tuple(_owned(o, args) for o in out)
        return _owned(out, args)

    wrapper.mesa_returns_owned = True  # type: ignore[attr-defined]
    return wrapper


def _owned(out: Any, args: tuple) -> Any:
    if isinstance(out, torch.Tensor) and out._is_view():
        for a in args:
            if out is a:
                return out
        return out.detach()
    return out


def device_type(t: torch.Tensor) -> str:
    """``t.device.type``, without building a device object for CPU tensors (a few us, and every
    layer call asks)."""
    return 'cpu' if t.is_cpu else t.device.type


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call where it is a no-op (a backward makes several per
    layer, and each costs a few us even when it returns ``t``)."""
    return t if t.dtype == dtype else t.to(dtype)


def autocast_cast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Cast like autocast does for its lower-precision ops (linear, conv, matmul).

    Running these ops ourselves with autocast disabled on the cast inputs gives bit-identical
    outputs and tells us the dtype the backward must use.
    """
    first = next(t for t in tensors if t is not None)
    kind = device_type(first)
    if not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


def record_input(ctx: Any, x: torch.Tensor) -> None:
    """Record what every Mesa backward reads of its forward's input ``x``: ``ctx.device_type``
    (``no_autocast_backward`` turns autocast off there) and ``ctx.input_dtype`` (the dtype of
    the input gradient)."""
    ctx.device_type = device_type(x)
    ctx.input_dtype = x.dtype


def record_autocast(ctx: Any, x: torch.Tensor) -> None:
    """``record_input(ctx, x)`` and the autocast state, for a backward that runs forward code
    again with grad enabled (a recomputation): ``replayed_autocast(ctx)`` restores it there."""
    record_input(ctx, x)
    ctx.autocast = (torch.is_autocast_enabled(ctx.device_type),
                    torch.get_autocast_dtype(ctx.device_type))


def replayed_autocast(ctx: Any) -> contextlib.AbstractContextManager:
    """The autocast state ``record_autocast`` recorded in forward."""
    enabled, dtype = ctx.autocast
    return torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled)


def autocast_inputs(ctx: Any, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``autocast_cast(*tensors)`` for an op run as autocast would: records ``record_input`` of
    the first tensor and ``ctx.compute_dtype``, the dtype the op runs and its backward computes
    in."""
    record_input(ctx, tensors[0])
    cast = autocast_cast(*tensors)
    ctx.compute_dtype = cast[0].dtype
    return cast


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)``, or nothing to do when autocast is off
    already (entering and leaving torch.autocast costs about 10 us of Python per layer call)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def no_autocast_backward(backward: Callable) -> Callable:
    """Backward formulas pick their dtypes explicitly; an ambient autocast must not change them."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: torch.Tensor) -> Any:
        with autocast_off(ctx.device_type):
            return backward(ctx, *grads)

    return wrapper
