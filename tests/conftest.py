import math
import os

import pytest
import torch

SLOW = 'slow: starts a subprocess (a tool, a training run, a wheel build) or runs a whole model'


def pytest_configure(config):
    """The ``slow`` marker, also where pyproject.toml is not read: .ci/run runs the core tests
    of an install from a copy of tests/ alone."""
    if not any(line.split(':')[0].strip() == 'slow' for line in config.getini('markers')):
        config.addinivalue_line('markers', SLOW)
    share_cores_among_workers()


def share_cores_among_workers() -> None:
    """Under pytest-xdist, each worker takes its share of the cores (or fewer threads, where
    ``OMP_NUM_THREADS`` asks), for torch and for the tools its tests start: two workers of two
    threads each on two cores ran the zoo tests twice as slowly as one process running them in
    turn, and two workers of one thread each faster than that process."""
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '0'))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        threads = min(threads, int(os.environ.get('OMP_NUM_THREADS') or threads))
        os.environ['OMP_NUM_THREADS'] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture
def two_threads():
    """At least two intra-op threads for the test, whatever the worker's share of the cores
    (``share_cores_among_workers``): a test of the CPU kernels' split over threads needs them."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


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
