"""``tools/benchmark_kernels.py --device cpu``: the CPU kernels timed against a copy and the
reference (needs the tools directory, so it is not among the core tests run from an install)."""
import os.path as osp
import sys

import pytest
import torch

from mmseg_mesa import _backend

sys.path.insert(0, osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'tools'))
import benchmark_kernels  # noqa: E402

KERNELS, _ = _backend.load_extension()


@pytest.mark.skipif(KERNELS is None or not KERNELS.CPU_KERNELS,
                    reason='package installed without the CPU kernels')
def test_every_op_is_timed_and_compared_with_the_reference():
    rows = benchmark_kernels.bench_activation(KERNELS, 'small', (2, 64, 8), 2, 1,
                                              torch.float32, 'cpu')
    assert [row['op'] for row in rows] == ['observe', 'quantize (nearest)',
                                           'quantize (stochastic)', 'dequantize']
    for row in rows:
        assert row['ms'] > 0 and row['ns_per_element'] == pytest.approx(
            row['ms'] * 1e6 / (2 * 64 * 8))
        assert row['speedup_vs_torch'] > 0 and row['gb_per_s'] > 0


def test_without_a_gpu_the_default_device_refuses(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(sys, 'argv', ['benchmark_kernels.py'])
    assert benchmark_kernels.main() == 2
    assert 'no CUDA GPU is visible' in capsys.readouterr().err
