"""Per-pixel cross-entropies of upsampled logits, computed band by band.

A decode head's loss upsamples its 1/4-resolution logits to the label size (150 classes x H x W
per image) and takes a per-pixel cross-entropy there; computed at once, that tensor and its
log-softmax are the largest transients of a training step (twice 315 MB at 512x512, batch 2).
``banded_cross_entropy`` computes the same per-pixel values one image and one block of rows at a
time and returns only the small per-pixel maps (N x H x W), from which the caller does the loss
reduction once, so the reduced values are those of the unbanded code. Backward recomputes each
band with grad enabled and accumulates the gradient of the low-resolution logits.

Why the bands are exact: bilinear upsampling (``align_corners=False``) by a power-of-two factor
``r`` maps output row ``y`` to source position ``(y + 0.5) / r - 0.5``; upsampling a slice of
input rows that starts ``s`` rows down to ``r`` times its height computes the same positions
shifted by exactly ``s`` (all exact binary fractions), with the same weights, so every output row
whose two source rows lie inside the slice is bit-identical (one halo row on each side suffices),
provided the kernel is the same: torch's CPU kernel switches to a separable two-pass loop (other
roundings) when ``out_h + out_w <= 128``, for 3 channels on one thread, and for channels-last
inputs, so bands are kept taller than that bound and only contiguous (NCHW) logits of other
channel counts are banded by rows, on CPU (where tests hold every case to ``resize``). Anything
else is banded by whole images, as many per band as fit in one: each image's slice of a batched
``F.interpolate`` is the same computed with fewer images, by the same kernel. The cross-entropy
and the arg-max are per pixel.
Gradients differ from the unbanded path only in the order of float sums (rows in two bands'
halos get their contributions in two parts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..layer_types import declare_layer_type
from .autocast import record_autocast, replayed_autocast, returns_owned

# A decode head's loss keeping only its low-resolution logits (exact recomputation, no
# quantization): the heads of integrations.modules convert under this type.
declare_layer_type('loss')

# Elements of one band's upsampled logits (16 MiB in fp32): small next to the activations, large
# enough that the per-band overhead (two halo rows per band) stays a few percent.
BAND_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class PixelCrossEntropy:
    """One ``F.cross_entropy(..., reduction='none')`` to evaluate on the upsampled logits."""

    class_weight: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Band:
    """Rows ``[src_start, src_stop)`` of images ``[image, image + images)`` of the logits,
    upsampled to ``rows`` x width; the output rows ``[keep_start, keep_start + out_stop -
    out_start)`` of that are rows ``[out_start, out_stop)`` of the full-size result."""

    image: int
    src_start: int
    src_stop: int
    rows: int
    keep_start: int
    out_start: int
    out_stop: int
    images: int = 1

    @property
    def batch(self) -> slice:
        """The band's images, as a slice of dim 0."""
        return slice(self.image, self.image + self.images)


def rows_bandable(logits: torch.Tensor, out_size: tuple[int, int], align_corners: bool) -> bool:
    """Whether ``plan_bands`` may split images into rows and stay bit-identical to ``resize``."""
    in_h, out_h = logits.shape[-2], out_size[0]
    factor = out_h // in_h if in_h else 0
    return (logits.device.type == 'cpu' and logits.is_contiguous() and logits.shape[1] != 3
            and not align_corners and factor >= 1 and factor & (factor - 1) == 0
            and out_h == factor * in_h and out_h + out_size[1] > 128)


def plan_bands(batch: int, channels: int, in_size: tuple[int, int], out_size: tuple[int, int],
               by_rows: bool, band_elements: int | None = None) -> list[Band]:
    """Bands covering every output row of every image once: blocks of about ``band_elements``
    upsampled values, of rows (``by_rows``, see ``rows_bandable``) or else of whole images (at
    least one each)."""
    (in_h, _), (out_h, out_w) = in_size, out_size
    band_elements = band_elements or BAND_ELEMENTS
    if not by_rows:
        step = max(1, band_elements // max(1, channels * out_h * out_w))
        return [Band(image, 0, in_h, out_h, 0, 0, out_h, min(step, batch - image))
                for image in range(0, batch, step)]
    bands = []
    for image in range(batch):
        factor = out_h // in_h
        step = max(1, band_elements // max(1, channels * factor * out_w))
        # the kernel must be the one the whole image takes: out_rows + out_w > 128 (docstring)
        step = max(step, -(-(129 - out_w) // factor))
        blocks = [(start, min(start + step, in_h)) for start in range(0, in_h, step)]
        last_rows = (in_h - max(blocks[-1][0] - 1, 0)) * factor
        if len(blocks) > 1 and last_rows + out_w <= 128:
            blocks[-2:] = [(blocks[-2][0], in_h)]  # a short last band: merged into the one before
        for start, stop in blocks:
            src_start, src_stop = max(start - 1, 0), min(stop + 1, in_h)
            bands.append(Band(image, src_start, src_stop, (src_stop - src_start) * factor,
                              (start - src_start) * factor, start * factor, stop * factor))
    return bands


@dataclass(frozen=True)
class BandedLossSpec:
    """What ``banded_cross_entropy`` evaluates: the losses, the label to ignore, the resize, and
    the size of a band (None: ``BAND_ELEMENTS``)."""

    losses: tuple[PixelCrossEntropy, ...]
    ignore_index: int
    align_corners: bool
    band_elements: int | None = None


def _source(logits: torch.Tensor, band: Band) -> torch.Tensor:
    source = logits[band.batch, :, band.src_start:band.src_stop]
    # a row slice is strided; give the kernel the layout the whole tensor has
    return source.contiguous() if band.src_stop - band.src_start < logits.shape[2] else source


def _upsampled(source: torch.Tensor, band: Band, width: int, align_corners: bool
               ) -> torch.Tensor:
    """The band's rows of the full-size upsampled logits, from its source rows."""
    up = F.interpolate(source, size=(band.rows, width), mode='bilinear',
                       align_corners=align_corners)
    return up[:, :, band.keep_start:band.keep_start + band.out_stop - band.out_start]


def _cross_entropies(up: torch.Tensor, labels: torch.Tensor, spec: BandedLossSpec,
                     which: list[int] | None = None) -> list[torch.Tensor]:
    out = []
    for k, loss in enumerate(spec.losses):
        if which is not None and k not in which:
            continue
        weight = None if loss.class_weight is None else up.new_tensor(loss.class_weight)
        out.append(F.cross_entropy(up, labels, weight=weight, reduction='none',
                                   ignore_index=spec.ignore_index))
    return out


class BandedCrossEntropy(torch.autograd.Function):
    """``(*per-pixel loss maps, top-1 correct map)`` of ``resize(logits)``, saving the logits.

    The labels are not saved: backward asks ``labels_fn`` for them again (the data samples they
    are stacked from live through the step anyway), as the unbanded recomputation does.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,
                labels_fn: Callable[[], torch.Tensor], spec: BandedLossSpec,
                out_dtypes: list) -> tuple[torch.Tensor, ...]:
        record_autocast(ctx, logits)
        ctx.spec = spec
        batch, channels = logits.shape[:2]
        out_h, out_w = labels.shape[-2:]
        ctx.bands = plan_bands(batch, channels, tuple(logits.shape[-2:]), (out_h, out_w),
                               rows_bandable(logits, (out_h, out_w), spec.align_corners),
                               spec.band_elements)
        maps: list[torch.Tensor] = []
        correct = torch.empty(labels.shape, dtype=torch.bool, device=labels.device)
        for band in ctx.bands:
            up = _upsampled(_source(logits, band), band, out_w, spec.align_corners)
            rows = slice(band.out_start, band.out_stop)
            target = labels[band.batch, rows]
            values = _cross_entropies(up, target, spec)
            if not maps:
                maps = [v.new_empty(labels.shape) for v in values]
                out_dtypes[:] = [up.dtype]
            for full, value in zip(maps, values):
                full[band.batch, rows] = value
            correct[band.batch, rows] = up.topk(1, dim=1)[1][:, 0].eq(target)
            del up, values
        ctx.mark_non_differentiable(correct)
        ctx.labels_fn = labels_fn
        ctx.save_for_backward(logits)
        return (*maps, correct)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        (logits,) = ctx.saved_tensors
        spec = ctx.spec
        which = [k for k, g in enumerate(grads[:len(spec.losses)]) if g is not None]
        if not which or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        labels = ctx.labels_fn()
        grad_logits = torch.zeros_like(logits)
        width = labels.shape[-1]
        for band in ctx.bands:
            rows = slice(band.out_start, band.out_stop)
            with torch.enable_grad(), replayed_autocast(ctx):
                leaf = _source(logits, band).detach().requires_grad_()
                up = _upsampled(leaf, band, width, spec.align_corners)
                values = _cross_entropies(up, labels[band.batch, rows], spec,
                                          which)
            (grad,) = torch.autograd.grad(
                values, leaf, [grads[k][band.batch, rows] for k in which])
            grad_logits[band.batch, :, band.src_start:band.src_stop] += grad
            del up, values, grad
        return grad_logits, None, None, None, None


def banded_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, spec: BandedLossSpec,
                         labels_fn: Callable[[], torch.Tensor] | None = None
                         ) -> tuple[list[torch.Tensor], torch.Tensor, torch.dtype]:
    """Per-pixel cross-entropy maps of ``resize(logits, labels.shape[-2:])`` for each of
    ``spec.losses``, the map of pixels whose top-1 class is the label, and the dtype the
    upsampled logits had (what a loss computed on them would use for its class weights).

    ``labels_fn`` gives the labels again in backward (default: keep ``labels``).
    """
    if logits.dim() != 4 or labels.dim() != 3 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f'banded_cross_entropy: logits (N, C, h, w) and labels (N, H, W) '
                         f'expected, got {tuple(logits.shape)} and {tuple(labels.shape)}')
    dtypes: list = []
    *maps, correct = BandedCrossEntropy.apply(logits, labels, labels_fn or (lambda: labels),
                                              spec, dtypes)
    return maps, correct, dtypes[0] if dtypes else logits.dtype
