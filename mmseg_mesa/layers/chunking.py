"""Working through a large tensor a few samples at a time, so a backward's full-size temporaries
stay bounded."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..codes import Codes
from ..quantizer import unpack

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
