"""The random stream of stochastic rounding, shared by the torch reference and the kernels.

Stochastic rounding draws from Philox4x32-10, a counter-based generator (``reference.py``
states it; ``csrc/mesa_numerics.h`` computes the same in the kernels): a call's draws are a pure
function of a 64-bit seed, a 64-bit counter offset and each element's flat index, so every
backend gives the same codes from the same stream position. This module keeps, per device, the
seed and the offset of the next call, and advances the offset past the blocks each call uses.

Its own module so that ``kernels`` (loaded lazily by ``_backend``) does not import ``quantizer``,
which imports ``_backend``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SEED_SALT = 0x5EED_3E5A
MASK64 = (1 << 64) - 1
DRAWS_PER_BLOCK = 4  # one Philox4x32 block gives four 32-bit words


@dataclass
class _Stream:
    torch_seed: int  # the torch seed it was derived from
    seed: int        # Philox key, 64 bits
    offset: int      # counter of the next call's first block, 64 bits


_STREAMS: dict[torch.device, _Stream] = {}
_CPU = torch.device('cpu')


def _device_key(device: torch.device | str) -> torch.device:
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == 'cuda' and device.index is None:
        return torch.device('cuda', torch.cuda.current_device())
    return device


def rounding_counter(device: torch.device | str, numel: int) -> tuple[int, int]:
    """``(seed, offset)`` for one call that rounds ``numel`` elements on ``device``, reserving
    its ``ceil(numel / 4)`` Philox blocks so the next call draws fresh numbers.

    The stream is separate from torch's default generator, which it never touches, so that
    compressing activations never shifts the model's own random stream (dropout, drop path):
    the forward stays bit-identical. Its seed is the default generator's seed (CUDA's on CUDA
    devices) XOR ``SEED_SALT``, taken when first used and whenever that seed changes, so a run
    that starts with ``torch.manual_seed`` (as mmengine does) is reproducible. Re-seeding with
    the same seed inside one process does not restart it; ``reset_rounding_generators`` does.
    """
    key = _CPU if device == 'cpu' or device == _CPU else _device_key(device)
    torch_seed = torch.cuda.initial_seed() if key.type == 'cuda' else torch.initial_seed()
    stream = _STREAMS.get(key)
    if stream is None or stream.torch_seed != torch_seed:
        stream = _Stream(torch_seed, (torch_seed ^ SEED_SALT) & MASK64, 0)
        _STREAMS[key] = stream
    offset = stream.offset
    stream.offset = (offset + -(-numel // DRAWS_PER_BLOCK)) & MASK64
    return stream.seed, offset


def reset_rounding_generators() -> None:
    """Restart stochastic rounding streams at the next use (from the current torch seed)."""
    _STREAMS.clear()
