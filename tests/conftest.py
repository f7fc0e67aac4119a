import math

import pytest
import torch

SLOW = 'slow: starts a subprocess (a tool, a training run, a wheel build) or runs a whole model'


def pytest_configure(config):
    """The ``slow`` marker, also where pyproject.toml is not read: .ci/run runs the core tests
    of an install from a copy of tests/ alone."""
    if not any(line.split(':')[0].strip() == 'slow' for line in config.getini('markers')):
        config.addinivalue_line('markers', SLOW)


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``reference``, in dB."""
    reference = reference.double()
    noise = (test.double() - reference).pow(2).sum().item()
    signal = reference.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise)


def drawn(draw, *shape, generator: torch.Generator) -> torch.Tensor:
    """``draw(*shape, generator=generator)`` (``torch.randn``, ``torch.rand``) on the
    generator's device, moved to torch's default device: the same numbers wherever a test runs,
    so the layer tests also run with a GPU as the default device (tools/gpu_check), where torch
    refuses a CPU generator for a CUDA tensor (tests/test_gpu_check.py holds them to it)."""
    return draw(*shape, generator=generator, device=generator.device).to(
        torch.get_default_device())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(),
                                                 dim=0).item()


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same seed and the same stochastic-rounding stream, so its
    result does not depend on which tests ran before it."""
    from mmseg_mesa.quantizer import reset_rounding_generators
    torch.manual_seed(0)
    reset_rounding_generators()
