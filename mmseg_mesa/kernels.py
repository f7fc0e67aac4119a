"""The compiled kernels: the ops of ``mmseg_mesa._C`` as functions, and the two backends
(``CPU``, ``CUDA``) that ``_backend.select_backend`` picks among.

Importing this module loads ``mmseg_mesa._C``, which registers ``torch.ops.mmseg_mesa.*`` with
CPU kernels and, in a CUDA build, CUDA kernels (sources in ``csrc/``; their arithmetic is one
header, ``csrc/mesa_numerics.h``), and ``fake_kernels`` with the FakeTensor kernels that
``torch.compile`` traces them with. Each function mirrors a step of the pure-PyTorch reference
(``reference.py``) and gives bit-identical results under both roundings; the backends give them
the signature of ``reference.Reference``.

Supported: contiguous CPU or CUDA tensors of float32, float16, bfloat16 or float64 (the ops
refuse others with a message saying so); fp32 per-group ``lower``/``scale``/``span`` and bool
``seen`` of shape ``(ceil(channels / group_size),)`` on the same device.
"""
from __future__ import annotations

import torch

# importing _C registers torch.ops.mmseg_mesa, fake_kernels their FakeTensor kernels
from . import _C, _backend, fake_kernels  # noqa: F401
from .reference import REFERENCE
from .reference import observe_then_quantize as _observe_then_quantize
from .rounding import rounding_counter

TORCH_VERSION: str = _C.TORCH_VERSION
CPU_KERNELS: bool = bool(_C.CPU_KERNELS)
# Whether the CPU kernels run on torch's intra-op threads (false: built without OpenMP).
CPU_PARALLEL: bool = bool(_C.CPU_PARALLEL)
CUDA_KERNELS: bool = bool(_C.CUDA_KERNELS)
CUDA_VERSION: int = _C.CUDA_VERSION
CUDA_ARCHS: str = _C.CUDA_ARCHS

_ops = torch.ops.mmseg_mesa


def _int64(value: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits (the ops take int64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def observe(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor, seen: torch.Tensor,
            group_dim: int, group_size: int, decay: float) -> torch.Tensor:
    """Update the running estimates in place (``group_min_max`` + ``ema_update``) and return
    the ``(2, G)`` range covering this batch, as ``ema_update`` does."""
    return _ops.observe(x, lower, span, seen, group_dim, group_size, decay)


def observe_quantize(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor,
                     seen: torch.Tensor, group_dim: int, group_size: int, decay: float,
                     bits: int, stochastic: bool, pack: bool = False,
                     counter: tuple[int, int] | None = None, mean: torch.Tensor | None = None,
                     rstd: torch.Tensor | None = None, rows: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``observe``, then ``quantize`` over the range it returns: ``(codes, lower, scale)``, the
    codes and the per-group affine that decodes them (``ActivationQuantizer.pack``).

    With ``mean`` and ``rstd`` (fp32, one per group, ``rstd > 0``) the range is observed in
    ``(x - mean) * rstd``, and the codes and affine are those of that standardized tensor
    (``ActivationQuantizer.pack_standardized``). With ``rows``, ``mean`` and ``rstd`` hold one
    value per row of the ``(rows, channels * inner)`` view instead (a LayerNorm's moments per
    token), and each value is standardized as it is read (``pack_rows_standardized``).
    One op, where ``observe_then_quantize`` runs observe, four small torch ops for the scale
    and quantize: on CPU their per-call cost is most of what a small layer pays for Mesa, on
    CUDA each is a kernel launch (here a memset and two kernels).
    """
    seed = offset = 0
    if stochastic:  # 'cpu', not x.device: a device object costs a few us per call
        device = 'cpu' if x.is_cpu else x.device
        seed, offset = counter if counter is not None else rounding_counter(device, x.numel())
    return _ops.observe_quantize(x, lower, span, seen, mean, rstd, group_dim, group_size, decay,
                                 bits, stochastic, _int64(seed), _int64(offset), pack, rows)


def observe_then_quantize(x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor,
                          seen: torch.Tensor, group_dim: int, group_size: int, decay: float,
                          bits: int, stochastic: bool, pack: bool = False,
                          counter: tuple[int, int] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``observe_quantize`` as two kernel calls and the scale in between (any device): what the
    one op is held to."""
    return _observe_then_quantize(observe, quantize, x, lower, span, seen, group_dim,
                                  group_size, decay, bits, stochastic, pack, counter)


def refine(x: torch.Tensor, codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
           group_dim: int, group_size: int, mean: torch.Tensor | None = None,
           rstd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fine codes, their lower, their scale)`` of ``x``'s 8-bit ``codes``, in one call
    (``refine_reference``): on CUDA one kernel, where the torch ops took five."""
    return _ops.refine(x, codes, lower, scale, mean, rstd, group_dim, group_size)


def dequantize_refined(codes: torch.Tensor, fine: torch.Tensor, lower: torch.Tensor,
                       scale: torch.Tensor, fine_lower: torch.Tensor, fine_scale: torch.Tensor,
                       group_dim: int, group_size: int, dtype: torch.dtype,
                       shape: torch.Size) -> torch.Tensor:
    """Both codes decoded and added in fp32, in ``dtype`` (``dequantize_refined_reference``),
    in one call."""
    return _ops.dequantize_refined(codes, fine, lower, scale, fine_lower, fine_scale,
                                   list(shape), group_dim, group_size, dtype)


def norm_terms(rstd: torch.Tensor, decoded_invstd: torch.Tensor, weight: torch.Tensor | None,
               eps: float, reliable: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchNorm's per-channel backward terms (``norm_terms_reference``) in one call, where
    torch's ops took eight."""
    return _ops.norm_terms(rstd, decoded_invstd, weight, eps, reliable)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A contiguous bool CPU tensor as 1 bit per element, in ``bitpack``'s layout."""
    return _ops.pack_mask(mask)


def unpack_mask(data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The bool tensor of ``shape`` that ``pack_mask`` packed into ``data``."""
    return _ops.unpack_mask(data, list(shape))


def pack_positive(x: torch.Tensor) -> torch.Tensor:
    """``pack_mask(x > 0)`` for a contiguous floating-point CPU tensor, in one pass."""
    return _ops.pack_positive(x)


def mask_select(values: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``torch.where(unpack_mask(data, values.shape), values, 0)`` for a contiguous
    floating-point CPU tensor, read from the packed bits in one pass."""
    return _ops.mask_select(values, data)


def mask_select_(values: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``mask_select`` written into ``values`` (contiguous, floating point, CPU), which it
    returns."""
    _ops.mask_select_(values, data)
    return values


def quantize(x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, bits: int,
             group_dim: int, group_size: int, stochastic: bool,
             counter: tuple[int, int] | None = None, pack: bool = False) -> torch.Tensor:
    """uint8 codes shaped like ``x``, one per element (``quantize_reference``); with ``pack``
    and ``bits < 8``, the flat bit-packed bytes instead (``quantize_packed_reference``).

    Stochastic rounding draws at ``counter`` (``(seed, offset)``), by default the next position
    of the device's stream, which the reference uses too (``rounding.rounding_counter``), so the
    model's own random stream is untouched either way.
    """
    seed = offset = 0
    if stochastic:
        seed, offset = counter if counter is not None else rounding_counter(x.device, x.numel())
    return _ops.quantize(x, lower, scale, bits, group_dim, group_size, stochastic, _int64(seed),
                         _int64(offset), pack)


def dequantize(codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, group_dim: int,
               group_size: int, dtype: torch.dtype, bits: int = 8,
               shape: torch.Size | None = None, divisor: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``codes * scale + lower`` (two roundings) cast to ``dtype`` (``dequantize_reference``);
    with a ``divisor`` (fp32, one value per row: equal consecutive runs of the values), each
    value divided by its row's in fp32 before the cast.

    ``codes`` holds one code per element (``bits=8``; the result takes ``shape``, by default
    ``codes.shape``) or, with ``bits < 8``, the bit-packed codes of ``shape``.
    """
    if shape is None:
        if bits != 8:
            raise ValueError('dequantize: bit-packed codes need the shape they were packed from')
        shape = codes.shape
    return _ops.dequantize(codes, lower, scale, bits, list(shape), group_dim, group_size, dtype,
                           divisor)


class CpuKernels:
    """The compiled kernels for CPU tensors: observing and quantizing in one call (standardized
    values included), and the 1-bit mask kernels. Masks of other dtypes than the kernels read
    (bool masks, floating values) are left to the reference's torch ops."""

    name = 'cpu kernels'
    SUPPORTED_DEVICES = frozenset({'cpu'})

    def not_supported_reasons(self, device: torch.device) -> list[str]:
        # every build has the CPU kernels (setup.py), so only the device can rule them out
        if device.type not in self.SUPPORTED_DEVICES:
            return [f'{self.name} run CPU tensors only, not {device.type}']
        return []

    observe = staticmethod(observe)
    quantize = staticmethod(quantize)
    dequantize = staticmethod(dequantize)
    observe_quantize = staticmethod(observe_quantize)
    refine = staticmethod(refine)
    dequantize_refined = staticmethod(dequantize_refined)
    norm_terms = staticmethod(norm_terms)

    @staticmethod
    def pack_mask(mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype != torch.bool:
            return REFERENCE.pack_mask(mask)
        return _ops.pack_mask(mask.contiguous())

    @staticmethod
    def unpack_mask(data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return _ops.unpack_mask(data.contiguous(), list(shape))

    @staticmethod
    def pack_positive(x: torch.Tensor) -> torch.Tensor:
        """One pass, without the bool tensor ``x > 0``."""
        if not x.is_floating_point():
            return CpuKernels.pack_mask(x > 0)
        return _ops.pack_positive(x.contiguous())

    @staticmethod
    def mask_select(values: torch.Tensor, data: torch.Tensor, shape: torch.Size
                    ) -> torch.Tensor:
        """One pass over the packed bits, where unpacking and ``torch.where`` took ten times as
        long as torch's own ReLU backward."""
        if not values.is_floating_point() or values.shape != shape:
            return torch.where(CpuKernels.unpack_mask(data, shape), values, 0)
        return _ops.mask_select(values.contiguous(), data.contiguous())

    @staticmethod
    def mask_select_(values: torch.Tensor, data: torch.Tensor, shape: torch.Size
                     ) -> torch.Tensor:
        """``mask_select`` written into ``values``, one pass where unpacking the bits and
        ``torch.where`` took two and a bool per element."""
        if not values.is_floating_point() or values.shape != shape or not values.is_contiguous():
            return REFERENCE.mask_select_(values, CpuKernels.unpack_mask(data, shape))
        return mask_select_(values, data.contiguous())


class CudaKernels:
    """The compiled kernels for CUDA tensors: observe (a memset and one kernel), quantize,
    dequantize, refine, dequantize_refined and norm_terms (one kernel each), and
    observe_quantize (a memset and two kernels, standardized values included). Masks run the
    reference's torch ops: there are no CUDA mask kernels.
    """

    name = 'cuda kernels'
    SUPPORTED_DEVICES = frozenset({'cuda'})

    def not_supported_reasons(self, device: torch.device) -> list[str]:
        if device.type not in self.SUPPORTED_DEVICES:
            return [f'{self.name} run CUDA tensors only, not {device.type}']
        if not CUDA_KERNELS:
            info = _backend.build_info()
            reason = getattr(info, 'CUDA_SKIP_REASON', None) or 'not built'
            return [f'mmseg_mesa._C has no CUDA kernels ({reason})']
        error = _backend.device_error(device)
        return [] if error is None else [error]

    observe = staticmethod(observe)
    quantize = staticmethod(quantize)
    dequantize = staticmethod(dequantize)

    observe_quantize = staticmethod(observe_quantize)
    refine = staticmethod(refine)
    dequantize_refined = staticmethod(dequantize_refined)
    norm_terms = staticmethod(norm_terms)

    pack_mask = staticmethod(REFERENCE.pack_mask)
    unpack_mask = staticmethod(REFERENCE.unpack_mask)
    pack_positive = staticmethod(REFERENCE.pack_positive)
    mask_select = staticmethod(REFERENCE.mask_select)
    mask_select_ = staticmethod(REFERENCE.mask_select_)


CPU = CpuKernels()
CUDA = CudaKernels()
# In the order the dispatcher tries them; each runs the device types it declares.
BACKENDS = (CPU, CUDA)
