"""What every Mesa module shares: activation checks, class swapping, autocast handling, what a
forward records for its backward, the weighted layers' forward and backward, backward by samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from ..codes import Codes
from ..config import MesaConfig
from ..division import DivisionCompressor, DivisionSpec
from ..quantizer import ActivationQuantizer, QuantSpec, unpack
from ..reuse import packed_reusing
from ..saved import load, save

M = TypeVar('M', bound=nn.Module)
_SWAPPED: dict[tuple[type, type], type] = {}


def quant_spec(config: MesaConfig, group_dim: int, group_size: int | None = None) -> QuantSpec:
    """The spec for one saved activation; ``group_size=None`` means the config's channel groups."""
    return QuantSpec(bits=config.bits, group_dim=group_dim,
                     group_size=config.group_size if group_size is None else group_size,
                     stochastic=config.stochastic_rounding, ema_decay=config.ema_decay,
                     backend=config.backend)


def row_group_config(config: MesaConfig) -> MesaConfig:
    """The config of quantizers with one group per row: Mesa's quantizer (DIVISION's low-pass
    needs channels), and the batch's own range, since a row index is a different image and
    class each batch and a running estimate would only widen its range."""
    return dataclasses.replace(config, compressor='mesa', ema_decay=0.0)


def make_quantizer(config: MesaConfig, group_dim: int, group_size: int | None = None
                   ) -> ActivationQuantizer | DivisionCompressor:
    """The compressor of one saved activation, as ``config.compressor`` says.

    A DIVISION-compressed activation treats ``group_dim`` as its channel dimension.
    """
    if config.compressor == 'division':
        return DivisionCompressor(DivisionSpec(
            block=config.division_block, bits=config.division_bits, channel_dim=group_dim,
            stochastic=config.stochastic_rounding, backend=config.backend))
    return ActivationQuantizer(quant_spec(config, group_dim, group_size))


class MesaModule:
    """Mixin of every Mesa module: a torch module whose saved activations are compressed.

    Conversion swaps the class of an existing module in place (``convert``), so Parameters,
    buffers, hooks, the training flag and state-dict names all stay what they were.
    """

    mesa_config: MesaConfig
    mesa_original_type: str  # the torch/mmcv class it was converted from (reports, memory)
    # The activations a layer saves: attribute name -> (group_dim, group_size), where a
    # group_size of None means the config's channel groups. One ActivationQuantizer each.
    mesa_quantizers: dict[str, tuple[int, int | None]] = {}
    # Set on an instance before its conversion by a parent that knows the rows of its inputs
    # (dim 0) are unrelated vectors of very different scales (K-Net's proposals): every
    # quantizer then gets one group per row over the batch's own range.
    mesa_row_groups: bool = False
    # Set by a converter that had to keep more than the layer type usually keeps (an attention
    # whose maps could not be left out); the conversion report lists it.
    mesa_note: str | None = None
    # The layer type whose settings (``MesaConfig.for_layer``: bit width, rounding) a module built
    # directly takes from the config it is given; conversion hands each module its own already.
    mesa_layer_type: str | None = None

    def __init__(self, *args: Any, mesa_config: MesaConfig | None = None, **kwargs: Any) -> None:
        """Build the torch module from its usual arguments, then attach Mesa."""
        super().__init__(*args, **kwargs)
        config = mesa_config or MesaConfig()
        if self.mesa_layer_type is not None:
            config = config.for_layer(self.mesa_layer_type)
        self.mesa_setup(config)

    def mesa_setup(self, config: MesaConfig) -> None:
        """Attach the quantizers; called once after the class swap (or from ``__init__``)."""
        self.mesa_config = config
        if self.mesa_row_groups:
            config = row_group_config(config)
        for name, (group_dim, group_size) in self.mesa_quantizers.items():
            if self.mesa_row_groups:
                group_dim, group_size = 0, 1
            setattr(self, name, make_quantizer(config, group_dim, group_size))

    @classmethod
    def convert(cls: type[M], module: nn.Module, config: MesaConfig) -> M:
        """Turn ``module`` (an instance of this class's torch base) into this Mesa class, in place.

        A subclass of the base (e.g. mmcv's ``Linear``) becomes a class deriving from both, so its
        own behaviour stays on the unmodified path and ``isinstance`` checks keep working.
        """
        original = type(module)
        base = next(b for b in cls.__bases__
                    if issubclass(b, nn.Module) and not issubclass(b, MesaModule))
        if not isinstance(module, base):
            raise TypeError(f'{cls.__name__}.convert expects a {base.__name__}, '
                            f'got {original.__name__}')
        if original is base:
            target = cls
        else:
            key = (cls, original)
            if key not in _SWAPPED:
                _SWAPPED[key] = type(cls.__name__, (cls, original),
                                     {'__module__': cls.__module__,
                                      '__qualname__': f'{cls.__qualname__}[{original.__name__}]'})
            target = _SWAPPED[key]
        module.__class__ = target
        module.mesa_original_type = original.__name__
        module.mesa_setup(config)
        return module

    def mesa_active(self, *tensors: torch.Tensor | None) -> bool:
        """Compress only when something will be saved for backward in a training step."""
        if not (self.training and self.mesa_config.enabled and torch.is_grad_enabled()):  # type: ignore[attr-defined]
            return False
        for t in tensors:  # a loop, not any() over a generator: every layer call asks
            if t is not None and t.requires_grad:
                return True
        return False


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


def restore(saved: torch.Tensor | Codes, dtype: torch.dtype) -> torch.Tensor:
    """What a backward reads of a saved operand: a tensor kept as it is, or decoded codes."""
    return cast(saved, dtype) if isinstance(saved, torch.Tensor) else unpack(saved, dtype)


def operand_gradients(ctx: Any, grad: torch.Tensor, first: int,
                      grad_a: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      grad_b: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of a two-operand product whose operands are the forward's arguments
    ``first`` and ``first + 1`` and whose forward saved ``save(ctx, saved_a, saved_b)``:
    ``grad_a(grad, b)`` where ``a`` needs a gradient, ``grad_b(grad, a)`` where ``b`` does, each
    operand restored in ``grad``'s dtype."""
    saved_a, saved_b = load(ctx)
    need_a, need_b = ctx.needs_input_grad[first:first + 2]
    return (grad_a(grad, restore(saved_b, grad.dtype)) if need_a else None,
            grad_b(grad, restore(saved_a, grad.dtype)) if need_b else None)


def sum_to(grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Reduce a broadcast gradient to the shape and dtype of the input it belongs to."""
    if grad.shape != shape:
        grad = grad.sum_to_size(shape)
    return cast(grad, dtype)


def weighted_forward(ctx: Any, op: Callable[..., torch.Tensor], x: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None, quantizer: Any
                     ) -> torch.Tensor:
    """``op(x, weight, bias)`` as autocast would run it, saving the packed input and the weight.

    The forward of every layer whose backward reads its input only for the weight gradient
    (Linear, Conv2d, ConvTranspose2d; ``weighted_backward`` is their backward): the input is
    packed only when the weight needs a gradient.
    """
    xc, wc, bc = autocast_inputs(ctx, x, weight, bias)
    with autocast_off(ctx.device_type):
        y = op(xc, wc, bc)
    save(ctx, packed_reusing(x, xc, quantizer) if ctx.needs_input_grad[1] else None, weight)
    return y


def weighted_backward(ctx: Any, grad: torch.Tensor,
                      input_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      weight_grad: Callable[[torch.Tensor, torch.Tensor, torch.Size], torch.Tensor],
                      bias_grad: Callable[[torch.Tensor], torch.Tensor],
                      joint: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]],
                                      tuple] | None = None) -> tuple:
    """The backward of ``weighted_forward``, given the layer's three gradient formulas.

    ``input_grad(grad, weight)``, ``weight_grad(x, grad, weight_shape)`` (a sum over samples:
    ``x`` is decoded a few samples at a time when it is large, ``summed_over_samples``) and
    ``bias_grad(grad)`` get the gradient and the weight in the compute dtype. The weight gradient
    comes first, so the decoded input is freed before the input gradient (as large) is made.
    ``joint(x, grad, weight, [input, weight, bias wanted])``, where given, computes all three in
    one call (a convolution's backward kernel shares its work between them); it runs instead
    when the decoded input is at most ``FUSED_BACKWARD_BYTES``, small enough for it and the
    input gradient to be alive together.
    Returns one gradient per forward argument (None past the first three).
    """
    packed, weight = load(ctx)
    grad = cast(grad, ctx.compute_dtype)
    w = cast(weight, ctx.compute_dtype)
    needs = ctx.needs_input_grad
    if (joint is not None and needs[1]
            and packed.shape.numel() * 4 <= FUSED_BACKWARD_BYTES):
        grad_x, grad_w, grad_b = joint(unpack(packed, grad.dtype), grad, w,
                                       [needs[0], True, needs[2]])
        return (None if grad_x is None else cast(grad_x, ctx.input_dtype),
                cast(grad_w, weight.dtype),
                None if grad_b is None else cast(grad_b, weight.dtype),
                *[None] * (len(needs) - 3))
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[1]:
        grad_w = cast(summed_over_samples(
            packed, lambda x, rows: weight_grad(x, rows_of(grad, rows), w.shape)), weight.dtype)
    if ctx.needs_input_grad[0]:
        grad_x = cast(input_grad(grad, w), ctx.input_dtype)
    if ctx.needs_input_grad[2]:
        grad_b = cast(bias_grad(grad), weight.dtype)
    return (grad_x, grad_w, grad_b, *[None] * (len(ctx.needs_input_grad) - 3))


# Backward works through a large tensor a few samples at a time once a full-size temporary
# would be larger than this: a weight gradient decodes its saved input by samples, a channel sum
# of products multiplies by samples (decoding UPerNet's bottleneck input whole in fp32 would be
# the peak of backward, docs/benchmarks.md).
DECODE_CHUNK_BYTES = 32 << 20
# Below this many bytes of fp32 input, a backward runs torch's fused kernels (a convolution's
# joint backward, batch norm's), whose extra full-size temporaries cost less than the dozen
# small passes of the in-place formulas; above it, memory comes first (the decoded input freed
# before the input gradient exists, products by chunks of samples).
FUSED_BACKWARD_BYTES = 2 << 20


def sample_slices(shape: torch.Size, element_bytes: int) -> list[slice]:
    """Consecutive slices of dim 0 whose full-size temporaries stay under
    ``DECODE_CHUNK_BYTES`` (one slice when the whole tensor does, at least one sample each)."""
    if len(shape) < 2 or shape.numel() * element_bytes <= DECODE_CHUNK_BYTES:
        return [slice(None)]
    samples = shape[0]
    chunks = min(samples, -(-shape.numel() * element_bytes // DECODE_CHUNK_BYTES))
    step = -(-samples // max(chunks, 1))
    return [slice(start, min(start + step, samples)) for start in range(0, samples, step)]


def rows_of(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """``t[rows]``; ``t`` itself for all rows (no slicing op)."""
    return t if rows == slice(None) else t[rows]


def summed_over_samples(packed: Codes, product: Callable[[torch.Tensor, slice], torch.Tensor]
                        ) -> torch.Tensor:
    """``product(unpack(packed), slice(None))`` for a product that is a sum over samples (a
    weight gradient), computed as the fp32 sum of ``product(x[rows], rows)`` over chunks of rows
    when the input is large. ``rows`` is what the caller slices the gradient with."""
    slices = sample_slices(packed.shape, packed.dtype.itemsize)
    parts = [packed.sample_range(rows.start, rows.stop) for rows in slices if len(slices) > 1]
    if not parts or any(part is None for part in parts):
        return product(unpack(packed), slice(None))
    return summed(product(unpack(part), rows).float() for rows, part in zip(slices, parts))


def channel_dot(a: torch.Tensor, b: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``(a * b).sum(dims, keepdim=True)`` (``dims`` include 0), multiplying a chunk of samples
    at a time so the product never exists for the whole batch."""
    return summed((rows_of(a, rows) * rows_of(b, rows)).sum(dims, keepdim=True)
                  for rows in sample_slices(a.shape, a.element_size()))


def summed(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of ``values``, added in place into the first, one value alive at a time."""
    total: torch.Tensor | None = None
    for value in values:
        total = value if total is None else total.add_(value)
    if total is None:
        raise ValueError('summed: no values')
    return total
