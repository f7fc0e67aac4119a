"""The kernels' first-use check (``mmseg_mesa.selfcheck``): ``python -m mmseg_mesa.info
--check`` passes here and fails for a kernel made to disagree, and ``MesaHook`` runs it once
per process before training on a GPU and stops with a way around a disagreement.

The hook's check runs on CUDA devices only; here it is forced onto the CPU kernels.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mmseg_mesa import _backend, info, selfcheck, state
from mmseg_mesa.reference import Reference

BUILD = _backend.build_info()
BUILT = BUILD is not None and BUILD.EXTENSION
requires_build = pytest.mark.skipif(not BUILT, reason='package installed without the extension')
CPU = torch.device('cpu')


def disagreeing(function):
    """``function`` with the first element of its (uint8 codes) result flipped in its lowest
    bit: one code in one case of many."""
    def wrapped(*args, **kwargs):
        codes = function(*args, **kwargs).clone()
        if codes.numel():
            codes.view(-1)[0] ^= 1
        return codes
    return wrapped


@pytest.fixture
def cpu_kernels():
    from mmseg_mesa import kernels
    return kernels.CPU


@requires_build
def test_cpu_kernels_agree_with_the_reference_in_every_op(cpu_kernels):
    start = time.perf_counter()
    checks = selfcheck.check_backend(cpu_kernels, CPU)
    elapsed = time.perf_counter() - start
    assert [c.op for c in checks] == list(selfcheck.OPS)
    assert all(c.ok and c.device == 'cpu' and c.backend == 'cpu kernels' for c in checks), checks
    assert all('cases bit-identical' in c.detail for c in checks)
    assert elapsed < 5.0  # a fraction of a second on a free core; it runs before training


def test_check_fails_the_op_that_disagrees_and_only_that_one():
    """Needs no extension: a backend that is the reference but for one op."""
    skewed = Reference()
    skewed.name = 'skewed'
    skewed.dequantize = lambda *a, **k: Reference.dequantize(*a, **k) * 1.0001
    checks = {c.op: c for c in selfcheck.check_backend(skewed, CPU)}
    assert not checks['dequantize'].ok
    assert 'elements differ from the reference' in checks['dequantize'].detail
    assert 'float32' in checks['dequantize'].detail  # names the first case that disagreed
    assert all(c.ok for op, c in checks.items() if op != 'dequantize')


def test_check_reports_an_op_that_raises_and_goes_on():
    broken = Reference()

    def pack_mask(mask):
        raise RuntimeError('no kernel image is available for execution on the device')
    broken.pack_mask = pack_mask
    checks = {c.op: c for c in selfcheck.check_backend(broken, CPU)}
    assert not checks['pack_mask'].ok
    assert 'raised RuntimeError: no kernel image' in checks['pack_mask'].detail
    assert checks['unpack_mask'].ok and checks['mask_select'].ok


def test_check_compares_bits_not_values():
    """-0.0 == 0.0 and NaN != NaN as values; the check holds the bits."""
    assert selfcheck._difference(torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    nan = torch.tensor([float('nan')], dtype=torch.bfloat16)
    assert selfcheck._difference(nan, nan.clone()) is None
    assert 'dtype' in selfcheck._difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


@requires_build
def test_info_check_prints_every_op_and_exits_0(capsys):
    assert info.main(['--check']) == 0
    out = capsys.readouterr().out
    assert 'cpu: cpu kernels against the pure-PyTorch reference (' in out
    for op in selfcheck.OPS:
        assert any(line.split()[:2] == [op, 'pass'] for line in out.splitlines()), op
    assert 'FAIL' not in out


@requires_build
def test_info_check_fails_for_a_kernel_made_to_disagree(monkeypatch, capsys, cpu_kernels):
    monkeypatch.setattr(cpu_kernels, 'quantize', disagreeing(cpu_kernels.quantize))
    assert info.main(['--check']) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = [line.split()[0] for line in lines if 'FAIL' in line.split()[1:2]]
    assert failed == ['quantize']  # observe_quantize runs its own kernel on CPU
    assert any("backend='torch'" in line for line in lines)


@pytest.mark.slow
@requires_build
def test_info_check_command_exits_0():
    result = subprocess.run([sys.executable, '-m', 'mmseg_mesa.info', '--check'],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'quantize' in result.stdout and 'pass' in result.stdout


def test_info_check_without_compiled_kernels_has_nothing_to_check(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, 'compiled_backend', lambda device, requested='auto': None)
    assert info.main(['--check']) == 0
    assert 'cpu: no compiled kernels run here' in capsys.readouterr().out


# ---------------------------------------------------------------- MesaHook before training

@pytest.fixture
def forced_on_cpu(monkeypatch):
    """The hook's check as it runs on a GPU, on the CPU kernels, in a fresh process state;
    counts how often the check itself runs."""
    runs = []
    check_backend = selfcheck.check_backend

    def counted(backend, device):
        runs.append(device)
        return check_backend(backend, device)
    monkeypatch.setattr(selfcheck, 'FIRST_USE_DEVICE_TYPES', frozenset({'cpu', 'cuda'}))
    monkeypatch.setattr(selfcheck, 'check_backend', counted)
    monkeypatch.setattr(state, 'KERNEL_CHECKS', {})
    return runs


def runner_of(model):
    return SimpleNamespace(model=model, logger=logging.getLogger('mesa-test'),
                           cfg=SimpleNamespace(get=lambda key, default=None: None))


def started_hook(mesa=True):
    pytest.importorskip('mmengine')
    from mmseg_mesa.integrations.hook import MesaHook
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    hook = MesaHook(mesa=mesa)
    runner = runner_of(model)
    hook.before_run(runner)
    return hook, runner


@requires_build
def test_hook_stops_training_on_kernels_that_disagree(forced_on_cpu, monkeypatch, cpu_kernels):
    monkeypatch.setattr(cpu_kernels, 'quantize', disagreeing(cpu_kernels.quantize))
    hook, runner = started_hook()
    with pytest.raises(selfcheck.KernelMismatchError) as error:
        hook.before_train(runner)
    message = str(error.value)
    assert 'quantize' in message and 'observe_quantize' not in message
    assert 'cpu kernels' in message and 'on cpu' in message
    assert "mesa = dict(backend='torch')" in message
    # once per process: a second start (another hook, another runner) reuses the verdict
    other, other_runner = started_hook()
    with pytest.raises(selfcheck.KernelMismatchError):
        other.before_train(other_runner)
    assert forced_on_cpu == [CPU]


@requires_build
def test_hook_checks_once_per_process_and_trains_on_kernels_that_agree(forced_on_cpu, caplog):
    for _ in range(2):
        hook, runner = started_hook()
        with caplog.at_level(logging.INFO, logger='mesa-test'):
            hook.before_train(runner)
    assert forced_on_cpu == [CPU]
    assert (f'the cpu kernels agree with the reference on cpu ({len(selfcheck.OPS)} ops)'
            in caplog.text)


def test_hook_checks_nothing_that_runs_the_reference(forced_on_cpu):
    hook, runner = started_hook(mesa={'backend': 'torch'})
    hook.before_train(runner)
    assert forced_on_cpu == []


def test_hook_checks_no_cpu_model_by_default(monkeypatch):
    runs = []
    monkeypatch.setattr(selfcheck, 'check_backend', lambda *a: runs.append(a) or [])
    hook, runner = started_hook()
    hook.before_train(runner)
    assert runs == []  # FIRST_USE_DEVICE_TYPES is the GPU's


def test_hook_without_mesa_checks_nothing(forced_on_cpu):
    hook, runner = started_hook(mesa=None)  # the runner's config has no mesa
    hook.before_train(runner)
    assert forced_on_cpu == []
