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
from typing import Any

import torch

from .state import ROUNDING_STREAMS as _STREAMS_BY_DEVICE

SEED_SALT = 0x5EED_3E5A
MASK64 = (1 << 64) - 1
DRAWS_PER_BLOCK = 4  # one Philox4x32 block gives four 32-bit words


@dataclass
class _Stream:
    torch_seed: int  # the torch seed it was derived from
    seed: int        # Philox key, 64 bits
    offset: int      # counter of the next call's first block, 64 bits


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
    stream = _STREAMS_BY_DEVICE.get(key)
    if stream is None or stream.torch_seed != torch_seed:
        stream = _Stream(torch_seed, (torch_seed ^ SEED_SALT) & MASK64, 0)
        _STREAMS_BY_DEVICE[key] = stream
    offset = stream.offset
    stream.offset = (offset + -(-numel // DRAWS_PER_BLOCK)) & MASK64
    return stream.seed, offset


def reset_rounding_generators() -> None:
    """Restart stochastic rounding streams at the next use (from the current torch seed)."""
    _STREAMS_BY_DEVICE.clear()


def rounding_state() -> dict[str, list[int]]:
    """The position of each device type's stream (``{'cpu': [torch_seed, seed, offset]}``; for
    CUDA, the current device's), for a checkpoint: a resumed run restores it with
    ``restore_rounding_state`` and draws what the uninterrupted run would have drawn."""
    state = {}
    for key, stream in _STREAMS_BY_DEVICE.items():
        if key.type == 'cuda' and key != _device_key('cuda'):
            continue
        state[key.type] = [stream.torch_seed, stream.seed, stream.offset]
    return state


def check_rounding_state(state: Any) -> None:
    """Raise a ValueError unless ``state`` is what ``rounding_state`` returns."""
    if not isinstance(state, dict):
        raise ValueError(f'rounding state: expected a dict, got {type(state).__name__}')
    for kind, values in state.items():
        if kind not in ('cpu', 'cuda') or not isinstance(values, (list, tuple)) \
                or len(values) != 3 or not all(isinstance(v, int) for v in values):
            raise ValueError(f'rounding state: expected {{"cpu" or "cuda": [torch_seed, seed, '
                             f'offset]}}, got {kind!r}: {values!r}')


def restore_rounding_state(state: dict[str, list[int]]) -> None:
    """Set the streams that ``rounding_state`` recorded (CUDA's on the current device).

    A stream belongs to its torch seed: a run seeded otherwise restarts it at first use, as a
    fresh run would. A stream it did not record had not begun: it begins again at its next use,
    from offset 0, rather than going on from where draws since left it (steps taken from a state
    saved before any rounding, as the calibration's at a run's first iteration, each draw what
    the first would).
    """
    check_rounding_state(state)
    if 'cpu' not in state:
        _STREAMS_BY_DEVICE.pop(_CPU, None)
    if 'cuda' not in state and torch.cuda.is_initialized():
        _STREAMS_BY_DEVICE.pop(_device_key('cuda'), None)
    for kind, values in state.items():
        if kind == 'cuda' and not torch.cuda.is_available():
            continue
        key = _CPU if kind == 'cpu' else _device_key('cuda')
        torch_seed, seed, offset = values
        _STREAMS_BY_DEVICE[key] = _Stream(torch_seed, seed & MASK64, offset & MASK64)
