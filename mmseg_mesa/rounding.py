"""The random stream of stochastic rounding, shared by the torch reference and the kernels.

Its own module so that ``kernels`` (loaded lazily by ``_backend``) does not import ``quantizer``,
which imports ``_backend``.
"""
from __future__ import annotations

import torch

_ROUNDING_GENERATORS: dict[torch.device, tuple[int, torch.Generator]] = {}


def rounding_generator(device: torch.device) -> torch.Generator:
    """The generator for stochastic rounding on ``device``.

    It is separate from the default generator so that compressing activations never shifts the
    model's own random stream (dropout, drop path): the forward stays bit-identical. It is seeded
    from the default generator's seed when first used and whenever that seed changes, so a run
    that starts with ``torch.manual_seed`` (as mmengine does) is reproducible. Re-seeding with the
    same seed inside one process does not restart it; ``reset_rounding_generators`` does.
    """
    device = torch.device(device)
    seed = torch.cuda.initial_seed() if device.type == 'cuda' else torch.initial_seed()
    cached = _ROUNDING_GENERATORS.get(device)
    if cached is None or cached[0] != seed:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed ^ 0x5EED_3E5A)
        cached = (seed, generator)
        _ROUNDING_GENERATORS[device] = cached
    return cached[1]


def reset_rounding_generators() -> None:
    """Restart stochastic rounding streams at the next use (from the current torch seed)."""
    _ROUNDING_GENERATORS.clear()
