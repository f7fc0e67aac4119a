"""Sub-byte bit packing: the only place that knows how codes narrower than a byte are laid out.

Layout: codes are taken in row-major order of the flattened tensor; byte ``i`` holds codes
``i * k .. i * k + k - 1`` (``k = 8 // bits``), code ``j`` of a byte in bits
``[j * bits, (j + 1) * bits)`` (little-endian within the byte). The CUDA kernels write exactly
this layout, and so do the CPU kernels that pack masks (``saved.PackedMask``).
"""
from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (each < 2**bits) into a flat uint8 tensor."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f'pack_bits: bits={bits} unsupported; allowed: {PACKABLE_BITS}')
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.to(torch.uint8)
    per_byte = 8 // bits
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # OR the k codes of each byte into place in uint8: temporaries of 1/k of the codes' bytes
    # (widening to int32 lanes cost 8 bytes per code, 176 MB for one 1-bit mask of Swin-T
    # UPerNet's 2048-channel bottleneck at 512x512).
    lanes = flat.view(-1, per_byte)
    packed = lanes[:, 0].clone()
    for j in range(1, per_byte):
        packed |= lanes[:, j] << (j * bits)
    return packed


def unpack_bits(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat uint8 tensor of ``numel`` codes."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f'unpack_bits: bits={bits} unsupported; allowed: {PACKABLE_BITS}')
    if bits == 8:
        return data.reshape(-1)[:numel]
    shifts = torch.arange(0, 8, bits, device=data.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    lanes = (data.reshape(-1, 1) >> shifts) & mask
    return lanes.reshape(-1)[:numel]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as 1 bit per element (ReLU and Dropout save only this)."""
    mask = mask.contiguous()
    return pack_bits(mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8),
                     1)


_FLAGS: dict[torch.device, torch.Tensor] = {}


def _flags_of_bytes(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: the 8 flags each byte value stands for, bit ``j`` as flag ``j``."""
    if device not in _FLAGS:
        values = torch.arange(256, device=device).unsqueeze(-1)
        _FLAGS[device] = ((values >> torch.arange(8, device=device)) & 1).bool()
    return _FLAGS[device]


def unpack_mask(data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: one table lookup per byte (shifting and masking took three
    passes over the eight flags of every byte)."""
    numel = 1
    for s in shape:
        numel *= s
    flags = torch.index_select(_flags_of_bytes(data.device), 0, data.reshape(-1).int())
    return flags.view(-1)[:numel].view(shape)
