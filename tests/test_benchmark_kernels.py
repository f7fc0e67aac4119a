"""``tools/benchmark_kernels.py --device cpu`` (``mmseg_mesa.bench.kernels``): the CPU kernels timed
against a copy and the reference; the tool refuses to run without a GPU by default (it runs the
tool, so it is not among the core tests run from an install)."""
import pytest
import torch
from tool_runs import run_tool

from mmseg_mesa import _backend
from mmseg_mesa.bench.kernels import bench_activation

KERNELS, _ = _backend.load_extension()


@pytest.mark.skipif(KERNELS is None or not KERNELS.CPU_KERNELS,
                    reason='package installed without the CPU kernels')
def test_every_op_is_timed_and_compared_with_the_reference():
    rows = bench_activation(KERNELS, 'small', (2, 64, 8), 2, 1, torch.float32, 'cpu')
    assert [row['op'] for row in rows] == ['observe', 'quantize (nearest)',
                                           'quantize (stochastic)', 'dequantize']
    for row in rows:
        assert row['ms'] > 0 and row['ns_per_element'] == pytest.approx(
            row['ms'] * 1e6 / (2 * 64 * 8))
        assert row['speedup_vs_torch'] > 0 and row['gb_per_s'] > 0


@pytest.mark.slow
def test_without_a_gpu_the_default_device_refuses():
    result = run_tool('benchmark_kernels', CUDA_VISIBLE_DEVICES='')
    assert result.returncode == 2, result.stderr[-2000:]
    assert 'no CUDA GPU is visible' in result.stderr
