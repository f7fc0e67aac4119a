"""The GPU run in one command: install what a bare GPU machine lacks, build the CUDA extension,
test it, measure it, and leave every result under OUT as it goes.

    bash tools/gpu_check.sh                          # on the lent GPU machine (OUT=$OUT)
    bash tools/gpu_check.sh --dry-run --out DIR      # here, on CPU, with .venv (the test runs it)

Steps, in order of value; each has its own timeout and all end within ``--budget`` seconds:

  env                 python, torch, CUDA, GPU, nvcc and which imports are missing (env.json)
  install             the carried wheels (.gpu-wheels/, tools/setup/prepare_gpu_wheels.sh)
                      into a --target folder on PYTHONPATH
  mmcv                mmcv 2.1.0: a carried wheel with ops if it loads; else, by default,
                      mmcv's Python part from the carried sdist with a stand-in for its compiled
                      ops (mmseg imports mmcv.ops at start; Mesa, Swin and UPerNet call no
                      mmcv op). --mmcv-build-s N builds the CPU ops in the background instead
                      (GPU hidden: CUDA ops would take far longer), with the stand-in if that
                      fails or takes longer than N seconds
  build_ext           mmseg_mesa._C for sm_90 (``pip install --no-build-isolation -e .``)
  tests               tests/test_extension.py: kernel == reference bit for bit, DIVISION
                      through the CUDA quantizer; no test may skip on the GPU machine (tests.xml)
  tests_cuda_default  the layer / DIVISION / quantizer tests with torch's default device set to
                      the GPU, so their modules and tensors live there and backend='auto' takes
                      the kernels (less the tests that draw from a CPU generator; tests.xml)
  kernels             tools/benchmark_kernels.py (kernels.json)
  memory_bN           tools/benchmark_memory.py on Swin-T UPerNet 512x512: baseline and the
                      default preset in fp32 and AMP, batch 2 before the training run and 8
                      after it (memory.json; the acceptance figures in summary.json)
  train               tools/train.py --amp on the demo config (fp16 with dynamic loss scale,
                      then bf16), finite losses, then the checkpoint in the plain config: a
                      strict state-dict load and tools/test.py (train.json)
  memory_presets_bN   the other presets in fp32 and AMP at both batches (into memory.json)

summary.json is rewritten at every step's start and end, gpu_check.log gets every line as it
comes, so a run killed at its limit still leaves what it did. At most 8 files come back from the
GPU machine: these 7 and the mmcv wheel when one was built there (carry it next time: put it in
.gpu-wheels/).

The dry run is the same code on CPU with tiny sizes. It installs and builds nothing (the .venv
has it all and is shared), runs two tests of test_extension.py (one whose CUDA cases skip) and
one quantizer test through the default-device plugin, expects benchmark_kernels.py to refuse
without a GPU, runs tools/benchmark_memory.py on CPU on the demo model (64x64, batch 2, three
modes), trains without --amp (mmengine's AmpOptimWrapper needs a GPU) and loads the checkpoint
into the plain model but does not run tools/test.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import os.path as osp
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SWIN_T = 'configs/swin/mesa_swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
MESA_DEMO = 'configs/demo/mesa_swin-mini_upernet_demo.py'
PLAIN_DEMO = 'configs/demo/swin-mini_upernet_demo.py'
MMCV_SDIST = 'mmcv-2.1.0.tar.gz'
OUT_FILES = ('summary.json', 'gpu_check.log', 'env.json', 'tests.xml', 'kernels.json',
             'memory.json', 'train.json')
RETURNED_FILE_LIMIT = 16 * 2 ** 20  # the device returns files up to 16 MiB
# What tools/gpu_check.py's steps import, under their import names (env.json lists each).
MODULES = ['torch', 'numpy', 'cv2', 'matplotlib', 'scipy', 'yaml', 'rich', 'regex', 'packaging',
           'PIL', 'pytest', 'ninja', 'setuptools', 'pkg_resources', 'wheel', 'addict', 'yapf',
           'platformdirs', 'termcolor', 'ftfy', 'wcwidth', 'prettytable', 'mmengine', 'mmcv',
           'mmcv.ops', 'mmseg', 'mmseg.models', 'mmengine.runner', 'mmseg_mesa',
           'mmseg_mesa.integrations', 'mmseg_mesa._C']
# Acceptance of issue 14 (on the GPU): the default preset against the baseline.
PEAK_RATIO_MAX, TIME_RATIO_MAX, KERNEL_OF_COPY_MIN = 0.45, 1.10, 0.7
# Written as mmcv/_ext.py only when mmcv's ops could not be built: mmcv.ops (which mmseg imports
# at start) then loads, and any mmcv op that is called says why it cannot run.
MMCV_EXT_STAND_IN = '''\
"""Stand-in for mmcv's compiled ops, written by tools/gpu_check.py: they could not be built."""


def __getattr__(name):
    if name.startswith('__'):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f'mmcv op {name} is unavailable: this mmcv was installed without '
                           'its compiled ops (tools/gpu_check.py stand-in)')
    return unavailable
'''


@dataclass(frozen=True)
class Sizes:
    """What a run covers: the GPU run's sizes, or the dry run's tiny ones."""

    test_files: tuple[str, ...]
    cuda_default_files: tuple[str, ...]
    memory_config: str
    memory_batches: tuple[int, ...]
    memory_iters: int | None             # None: benchmark_memory's default
    memory_modes: tuple[str, ...]        # measured at each batch; the acceptance compares these
    memory_presets: bool                 # then every other preset, with and without AMP
    train_iters: int
    train_batch: int
    amp_dtypes: tuple[str, ...]          # AmpOptimWrapper dtypes; () trains without --amp
    test_tool: bool                      # also evaluate the checkpoint with tools/test.py
    caps: dict[str, int] = field(default_factory=dict)  # step -> timeout in seconds


LAYER_TESTS = ('tests/test_layers.py', 'tests/test_division.py', 'tests/test_quantizer.py')
# Left out of the CUDA-default run: they draw from a CPU torch.Generator (test_layers.py's
# upstream_grad), which torch refuses next to CUDA tensors whatever Mesa does.
CPU_GENERATOR_TESTS = ('test_gradients_match', 'test_gradients_after_running_estimates_settle',
                       'test_autocast', 'test_layernorm_gradients_hold_for_tokens_of_any_spread',
                       'test_piecewise_torch_path_equals_one_pass')
GPU = Sizes(test_files=('tests/test_extension.py',), cuda_default_files=LAYER_TESTS,
            memory_config=SWIN_T, memory_batches=(2, 8), memory_iters=None,
            memory_modes=('baseline', 'mesa:default', 'amp', 'mesa:default+amp'),
            memory_presets=True, train_iters=20, train_batch=8, amp_dtypes=('float16', 'bfloat16'),
            test_tool=True,
            caps=dict(env=90, install=90, build_ext=300, tests=200, tests_cuda_default=150,
                      kernels=150, memory=150, memory_presets=150, train=200))
DRY = Sizes(test_files=('tests/test_extension.py::test_arch_coverage',
                        'tests/test_extension.py::test_kernels_match_reference'),
            cuda_default_files=('tests/test_quantizer.py::test_mask_round_trip',),
            memory_config=MESA_DEMO, memory_batches=(2,), memory_iters=1,
            memory_modes=('baseline', 'mesa:default', 'amp'), memory_presets=False,
            train_iters=2, train_batch=2,
            amp_dtypes=(), test_tool=False,
            caps=dict(env=180, build_ext=120, tests=240, tests_cuda_default=120,
                      kernels=120, memory=240, train=360))
MIN_STEP_S = 20    # a step that would get less than this is skipped
RESERVE_S = 10     # kept for the last summary


class Proc:
    """A child process in its own session: its output streamed into the log with a prefix and
    kept in memory; on timeout the whole process group is killed (compilers included)."""

    def __init__(self, check: Check, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name, self.lines = name, deque(maxlen=4000)
        self.start = time.monotonic()
        check.log(f'$ {" ".join(cmd)}', name)
        self.popen = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors='replace',
                                      start_new_session=True)
        self.thread = threading.Thread(target=self._stream, args=(check,), daemon=True)
        self.thread.start()

    def _stream(self, check: Check) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip('\n')
            self.lines.append(line)
            check.log(line, self.name)

    def wait(self, timeout: float) -> tuple[int | None, float]:
        """(exit code or None when it was killed at ``timeout``, seconds since start)."""
        try:
            rc: int | None = self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self.thread.join(timeout=10)
        return rc, round(time.monotonic() - self.start, 1)

    def kill(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    @property
    def text(self) -> str:
        return '\n'.join(self.lines)


class Check:
    """The run: its steps, their records in summary.json, and one log."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.dry = args, args.dry_run
        self.sizes = DRY if self.dry else GPU
        self.out, self.work = Path(args.out).resolve(), Path(args.work).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        for stale in [*(self.out / n for n in OUT_FILES), *self.out.glob('mmcv-*.whl'),
                      *self.work.glob('tests*.xml'), *self.work.glob('memory_b*.json')]:
            stale.unlink(missing_ok=True)  # a dry run into the same folders starts afresh
        self.site = self.work / 'site'
        self.wheels = (REPO / args.wheels).resolve()
        self.python = osp.abspath(args.python) if os.sep in args.python else args.python
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self._log_lock = threading.Lock()
        self._log = open(self.out / 'gpu_check.log', 'a', buffering=1)
        self.summary: dict[str, Any] = dict(
            mode='dry-run (CPU)' if self.dry else 'gpu',
            started=time.strftime('%Y-%m-%d %H:%M:%S %Z'), budget_s=args.budget,
            python=self.python, steps={}, figures={}, acceptance={})
        self.mmcv_build: Proc | None = None
        self.mmcv_pending = False
        self.pinned = False  # foreground work pinned to cores 0-3 while mmcv builds

    # ------------------------------------------------------------------ records
    def log(self, line: str, prefix: str = 'gpu_check') -> None:
        stamp = f'{time.monotonic() - self.t0:7.1f}'
        with self._log_lock:
            self._log.write(f'{stamp} [{prefix}] {line}\n')

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log(line)

    def write_json(self, name: str, data: Any) -> None:
        (self.out / name).write_text(json.dumps(data, indent=2, default=str) + '\n')

    def record(self, name: str, **fields: Any) -> dict:
        entry = self.summary['steps'].setdefault(name, {})
        entry.update(fields)
        self.summary['elapsed_s'] = round(time.monotonic() - self.t0, 1)
        self.write_json('summary.json', self.summary)
        return entry

    def finish(self, name: str, status: str, note: str = '', **fields: Any) -> str:
        self.record(name, status=status, note=note, **fields)
        self.say(f'== {name}: {status}' + (f' ({note})' if note else ''))
        return status

    def remaining(self) -> float:
        return self.deadline - RESERVE_S - time.monotonic()

    def timeout_for(self, name: str) -> float:
        cap = self.sizes.caps.get(name.split('_b')[0], 120)
        return min(cap, self.remaining())

    # ------------------------------------------------------------------ processes
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        paths = ([str(self.site)] if not self.dry else []) + [str(REPO)]
        env['PYTHONPATH'] = os.pathsep.join(paths + [p for p in [env.get('PYTHONPATH')] if p])
        env.setdefault('OMP_NUM_THREADS', '1' if self.dry else '4')
        env.update(PYTHONUNBUFFERED='1', MPLBACKEND='Agg', **extra)
        return env

    def pin(self, cmd: list[str]) -> list[str]:
        """Keep foreground work on cores 0-3 while mmcv builds on the others."""
        if self.pinned and self.mmcv_build is not None and self.mmcv_build.popen.poll() is None:
            return ['taskset', '-c', '0-3', *cmd]
        return cmd

    def run(self, name: str, cmd: list[str], timeout: float, **env: str) -> tuple[
            int | None, float, Proc]:
        proc = Proc(self, name, self.pin(cmd), self.env(**env))
        rc, seconds = proc.wait(timeout)
        return rc, seconds, proc

    def python_ok(self, code: str, timeout: float = 60) -> tuple[bool, str]:
        try:
            result = subprocess.run([self.python, '-c', code], cwd=REPO, env=self.env(),
                                    capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f'timed out after {timeout} s: {code}'
        return result.returncode == 0, (result.stdout + result.stderr).strip()[-1500:]

    def guarded(self, name: str, step: Any) -> None:
        """Run a step; a bug in this script fails that step only, not the steps after it."""
        try:
            step()
        except Exception as error:
            self.finish(name, 'failed', f'gpu_check.py raised {type(error).__name__}: {error}')

    def begin(self, name: str, needs_s: float = MIN_STEP_S) -> bool:
        if self.remaining() < needs_s:
            self.finish(name, 'skipped', f'no time left ({self.remaining():.0f} s of the budget)')
            return False
        self.say(f'== {name} ...')
        self.record(name, status='running')
        return True

    def outcome(self, name: str, rc: int | None, seconds: float, proc: Proc, ok: bool = True,
                note: str = '', **fields: Any) -> str:
        if rc is None:
            return self.finish(name, 'timed_out', note or f'killed after {seconds} s',
                               seconds=seconds, tail=proc.text[-2000:], **fields)
        status = 'passed' if rc == 0 and ok else 'failed'
        return self.finish(name, status, note, rc=rc, seconds=seconds,
                           tail=proc.text[-2000:] if status != 'passed' else '', **fields)

    # ------------------------------------------------------------------ steps
    def step_env(self, name: str = 'env', key: str = 'before') -> None:
        if not self.begin(name):
            return
        rc, seconds, proc = self.run(name, [self.python, __file__, '--report-env'],
                                     self.timeout_for('env'))
        report = parse_last_json(proc.text)
        env_file = self.out / 'env.json'
        data = json.loads(env_file.read_text()) if env_file.exists() else {}
        data[key] = report
        self.write_json('env.json', data)
        missing = sorted(m for m, v in (report or {}).get('modules', {}).items()
                         if not v.get('ok'))
        self.summary.setdefault('environment', {})[key] = {
            k: (report or {}).get(k) for k in ('python', 'torch', 'torch_cuda', 'gpus', 'nvcc')}
        self.summary['environment'][key]['missing'] = missing
        if report and report.get('presets'):
            self.summary['presets'] = report['presets']
        self.outcome(name, rc, seconds, proc, ok=report is not None,
                     note=f'missing: {", ".join(missing) or "nothing"}', missing=missing)

    def step_install(self) -> None:
        name = 'install'
        if self.dry:
            self.finish(name, 'skipped', 'dry run: the .venv has the stack')
            return
        if not self.begin(name):
            return
        wheels = sorted(self.wheels.glob('*.whl'))
        if not wheels:
            self.finish(name, 'failed', f'no wheels in {self.wheels}: run '
                        'tools/setup/prepare_gpu_wheels.sh here and carry .gpu-wheels')
            return
        rc, seconds, proc = self.run(name, [
            self.python, '-m', 'pip', 'install', '--no-index', '--no-deps', '--no-compile',
            '--no-cache-dir', '--upgrade', '--target', str(self.site), *map(str, wheels)],
            self.timeout_for('install'))
        self.outcome(name, rc, seconds, proc, wheels=[w.name for w in wheels])
        self.step_env('env_after_install', 'after_install')

    def step_mmcv(self) -> None:
        """Check mmcv's ops; if they are missing: the stand-in, or their build in the background
        (joined in wait_mmcv) with ``--mmcv-build-s``."""
        name = 'mmcv'
        if not self.begin(name):
            return
        ok, text = self.python_ok('import mmcv, mmcv.ops, mmcv._ext as ext; '
                                  'print(mmcv.__version__, ext.__file__)')
        stand_in = ok and '/mmcv/_ext.py' in text
        if stand_in and self.args.mmcv_build_s <= 0:
            self.finish(name, 'passed', 'the stand-in mmcv._ext of an earlier run is in place')
            return
        if ok and not stand_in:
            self.finish(name, 'passed', f'mmcv with ops loads: {text.splitlines()[-1]}')
            return
        sdist = self.wheels / MMCV_SDIST
        if self.dry or not sdist.exists():
            why = 'dry run builds nothing' if self.dry else f'no {MMCV_SDIST} in {self.wheels}'
            self.finish(name, 'failed', f'mmcv.ops does not load ({text[-300:]}); {why}')
            return
        if self.args.mmcv_build_s <= 0:
            self.mmcv_stand_in(None)
            return
        self.mmcv_pending = True
        cores = os.cpu_count() or 1
        jobs = max(1, cores - 4) if cores >= 8 else cores
        script = mmcv_build_script(self.python, sdist, self.work / 'mmcv_build', self.site,
                                   with_ops=True)
        cmd = ['bash', '-c', script]
        if cores >= 8 and shutil.which('taskset') and subprocess.run(
                ['taskset', '-c', '0-3', 'true'], capture_output=True).returncode == 0:
            cmd = ['taskset', '-c', f'4-{cores - 1}', *cmd]
            self.pinned = True
        self.mmcv_build = Proc(self, name, cmd, self.env(
            CUDA_VISIBLE_DEVICES='', FORCE_CUDA='0', MMCV_WITH_OPS='1', MAX_JOBS=str(jobs)))
        self.record(name, status='running', note=f'building with CPU ops, {jobs} jobs, in the '
                    'background', pinned=self.pinned)

    def wait_mmcv(self) -> None:
        """Before the first step that imports mmseg: join the mmcv build, or fall back."""
        if not self.mmcv_pending:
            return
        self.mmcv_pending = False
        name, proc = 'mmcv', self.mmcv_build
        assert proc is not None
        left = self.args.mmcv_build_s - (time.monotonic() - proc.start)
        rc, seconds = proc.wait(min(left, self.remaining() - 60))
        if rc == 0 and self.python_ok('import mmcv.ops')[0]:
            built = sorted((self.work / 'mmcv_build' / 'dist').glob('mmcv-*.whl'))
            returned = [w for w in built if w.stat().st_size <= RETURNED_FILE_LIMIT]
            for wheel in returned:  # carry it next time: no build then
                shutil.copy2(wheel, self.out / wheel.name)
            self.finish(name, 'passed', f'built with CPU ops in {seconds} s' +
                        (f'; {returned[0].name} is in OUT' if returned else ''),
                        seconds=seconds)
            return
        self.mmcv_stand_in(proc, f'timed out after {seconds} s' if rc is None
                           else f'failed (rc {rc})')

    def mmcv_stand_in(self, build: Proc | None, why: str = '') -> None:
        """mmcv's Python part and a stand-in mmcv._ext: by choice (no ``build``) or as the
        fallback of a build that failed or ran out of time."""
        name = 'mmcv'
        fallback = mmcv_build_script(self.python, self.wheels / MMCV_SDIST,
                                     self.work / 'mmcv_lite', self.site, with_ops=False)
        lite_rc, _, lite = self.run('mmcv_lite', ['bash', '-c', fallback], 120,
                                    MMCV_WITH_OPS='0')
        if lite_rc == 0:
            (self.site / 'mmcv' / '_ext.py').write_text(MMCV_EXT_STAND_IN)
        loads = lite_rc == 0 and self.python_ok('import mmseg.models')[0]
        chosen = build is None and loads
        what = ('mmcv without ops and a stand-in mmcv._ext (Mesa, Swin and UPerNet call no mmcv '
                'op)' if loads else 'mmcv without ops failed to build or import')
        self.finish(name, 'passed' if chosen else 'failed',
                    what if build is None else f'the CPU-ops build {why}; {what}',
                    tail='' if chosen else (build.text[-2000:] if build else '') + '\n' +
                    lite.text[-1000:])

    def step_build_ext(self) -> None:
        name = 'build_ext'
        if not self.begin(name):
            return
        if self.dry:
            rc, seconds, proc = self.run(name, [self.python, '-m', 'mmseg_mesa.info'], 60)
            self.finish(name, 'skipped', 'dry run: no rebuild in the shared .venv',
                        info=proc.text.splitlines()[-8:])
            return
        rc, seconds, proc = self.run(name, [
            self.python, '-m', 'pip', 'install', '--no-build-isolation', '--no-deps', '--no-index',
            '-v', '-e', '.'], self.timeout_for('build_ext'),
            TORCH_CUDA_ARCH_LIST='9.0', FORCE_CUDA='1', MAX_JOBS='4')
        info_rc, _, info = self.run('info', [self.python, '-m', 'mmseg_mesa.info'], 60)
        loadable = info_rc == 0 and 'built and loadable' in info.text
        self.outcome(name, rc, seconds, proc, ok=loadable, info=info.text.splitlines()[-8:],
                     note='' if loadable else 'mmseg_mesa.info does not report a loadable _C')

    def step_tests(self, name: str, files: tuple[str, ...], default_device: str | None) -> None:
        if not self.begin(name):
            return
        junit = self.work / f'{name}.xml'
        junit.unlink(missing_ok=True)
        cmd = [self.python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rs',
               f'--junitxml={junit}', *files]
        env = {}
        if default_device:
            cmd[3:3] = ['-p', 'gpu_check']  # this file, as a plugin: pytest_configure below
            cmd += ['-k', ' and '.join(f'not {t}' for t in CPU_GENERATOR_TESTS)]
            env = dict(GPU_CHECK_DEFAULT_DEVICE=default_device,
                       PYTHONPATH=os.pathsep.join([self.env()['PYTHONPATH'], str(REPO / 'tools')]))
        rc, seconds, proc = self.run(name, cmd, self.timeout_for(name), **env)
        counts = junit_counts(junit)
        merge_junit(sorted(self.work.glob('tests*.xml')), self.out / 'tests.xml')
        skipped = (counts or {}).get('skipped', 0)
        ok = counts is not None and (self.dry or skipped == 0)
        note = f'{counts}' if counts else 'no JUnit XML written'
        if counts and skipped and not self.dry:
            note += ': tests were skipped on the GPU machine'
        if default_device:
            note += (f' (default device {default_device}; left out, CPU generators: '
                     f'{", ".join(CPU_GENERATOR_TESTS)})')
        self.outcome(name, rc, seconds, proc, ok=ok, note=note, counts=counts,
                     skips=[line for line in proc.lines if line.startswith('SKIPPED')][:20])

    def step_kernels(self) -> None:
        name = 'kernels'
        if not self.begin(name):
            return
        path = self.out / 'kernels.json'
        rc, seconds, proc = self.run(name, [self.python, 'tools/benchmark_kernels.py', '--json',
                                            str(path)], self.timeout_for(name))
        if self.dry:
            refused = rc == 2 and 'no CUDA GPU' in proc.text
            self.finish(name, 'skipped' if refused else 'failed',
                        'CUDA only: benchmark_kernels.py refused without a GPU (rc 2)'
                        if refused else f'expected rc 2 without a GPU, got {rc}', rc=rc,
                        seconds=seconds, tail='' if refused else proc.text[-2000:])
            return
        figures = kernel_figures(path)
        self.summary['figures']['kernels'] = figures
        if figures:
            self.summary['acceptance']['kernel_of_copy_min'] = dict(
                value=figures['min_of_copy'], limit=KERNEL_OF_COPY_MIN,
                holds=figures['min_of_copy'] >= KERNEL_OF_COPY_MIN)
        self.outcome(name, rc, seconds, proc, ok=figures is not None,
                     note=f'min of copy {figures["min_of_copy"]:.2f}' if figures else '')

    def step_memory(self, name: str, batch: int, modes: list[str]) -> None:
        """One tools/benchmark_memory.py run; its modes join the batch's entry of memory.json
        (one run per group of modes: a run cut at its timeout loses only its own group)."""
        self.wait_mmcv()
        if not self.begin(name, needs_s=40):
            return
        device = 'cpu' if self.dry else 'cuda'
        raw = self.work / f'{name}.json'
        cmd = [self.python, 'tools/benchmark_memory.py', self.sizes.memory_config, '--device',
               device, '--batch', str(batch), '--modes', *modes, '--json', str(raw)]
        if self.sizes.memory_iters:
            cmd += ['--iters', str(self.sizes.memory_iters)]
        rc, seconds, proc = self.run(name, cmd, self.timeout_for(name))
        results = json.loads(raw.read_text()) if rc == 0 and raw.exists() else None
        merged_path = self.out / 'memory.json'
        merged = json.loads(merged_path.read_text()) if merged_path.exists() else {}
        if results is not None:
            entry = merged.setdefault(f'batch_{batch}', {**results, 'modes': {}, 'runs': []})
            entry['modes'].update(results['modes'])
            entry['runs'].append(dict(step=name, modes=modes, seconds=seconds))
            self.write_json('memory.json', merged)
            figures = memory_figures(entry)
            self.summary['figures'][f'memory_b{batch}'] = figures
            for precision, row in figures.items() if not self.dry else ():
                peak = ('cuda_peak_bytes_ratio' if row.get('cuda_peak_bytes_ratio') is not None
                        else 'peak_bytes_ratio')
                for key, limit in ((peak, PEAK_RATIO_MAX), ('step_time_s_ratio', TIME_RATIO_MAX)):
                    if row.get(key) is not None:
                        self.summary['acceptance'][f'b{batch} {precision} {key}'] = dict(
                            value=row[key], limit=limit, holds=row[key] <= limit)
        self.outcome(name, rc, seconds, proc, ok=results is not None, modes=modes,
                     note='' if results is not None else 'no results JSON')

    def step_train(self) -> None:
        name = 'train'
        self.wait_mmcv()
        if not self.begin(name, needs_s=60):
            return
        demo = load_demo_tool()
        sizes, data_root = self.sizes, self.work / 'demo_data'
        schedule = demo.Schedule(num_train=4 * sizes.train_batch, num_val=8, size=64,
                                 max_iters=sizes.train_iters, batch_size=sizes.train_batch,
                                 log_interval=1)
        options = demo.option_args(demo.cfg_options(str(data_root), 0, schedule))
        result: dict[str, Any] = dict(iters=sizes.train_iters, batch=sizes.train_batch, runs={})
        start = time.monotonic()
        ok, text = self.python_ok(
            'from mmseg_mesa.demo import write_demo_dataset; '
            f'write_demo_dataset({str(data_root)!r}, num_train={schedule.num_train}, '
            f'num_val={schedule.num_val}, size={schedule.size}, seed=0)', timeout=120)
        passed, notes = ok, [] if ok else [f'dataset: {text[-300:]}']
        checkpoint = None
        for dtype in sizes.amp_dtypes or (None,):
            label = dtype or 'fp32 (no --amp on CPU)'
            if checkpoint is not None and self.remaining() < 60:
                notes.append(f'{label}: skipped, no time left')
                continue
            work_dir = self.work / f'train_{dtype or "fp32"}'
            cmd = [self.python, 'tools/train.py', MESA_DEMO, '--work-dir', str(work_dir)]
            cmd += (['--amp'] if dtype else []) + ['--cfg-options', *options]
            if dtype and dtype != 'float16':
                cmd.append(f'optim_wrapper.dtype={dtype}')
            rc, seconds, proc = self.run(f'train_{dtype or "fp32"}', cmd,
                                         min(self.timeout_for(name), self.remaining() - 30))
            run = read_training_run(work_dir, sizes.train_iters)
            run.update(rc=rc, seconds=seconds, mesa_converted='Mesa converted' in proc.text,
                       amp_wrapper='AmpOptimWrapper' in proc.text)
            run_ok = (rc == 0 and run['finite'] and run['iterations'] == sizes.train_iters
                      and run['mesa_converted'] and run['amp_wrapper'] == bool(dtype))
            if not run_ok:
                run['tail'] = proc.text[-2000:]
                notes.append(f'{label}: rc {rc}, {run["iterations"]} iterations, finite '
                             f'{run["finite"]}, converted {run["mesa_converted"]}, '
                             f'AmpOptimWrapper {run["amp_wrapper"]}')
            passed &= run_ok
            result['runs'][label] = run
            self.write_json('train.json', result)
            checkpoint = checkpoint or run.get('checkpoint')
        if checkpoint is None:
            passed = False
            notes.append('no checkpoint was written')
        else:
            rc, _, proc = self.run('load_plain', [self.python, __file__, '--load-check',
                                                  PLAIN_DEMO, checkpoint], 120)
            result['plain_load'] = parse_last_json(proc.text) or dict(rc=rc,
                                                                      tail=proc.text[-1500:])
            loaded = rc == 0 and result['plain_load'].get('strict_ok') is True
            passed &= loaded
            if not loaded:
                notes.append('the checkpoint does not load strictly into the plain model')
        if checkpoint is not None and not sizes.test_tool:
            notes.append('dry run: the checkpoint is not evaluated with tools/test.py')
        elif checkpoint is not None:
            data = [f'{s}_dataloader.dataset.data_root={data_root}' for s in ('val', 'test')]
            rc, seconds, proc = self.run('test_plain', [
                self.python, 'tools/test.py', PLAIN_DEMO, checkpoint, '--work-dir',
                str(self.work / 'test_plain'), '--cfg-options', *data],
                min(120, max(1, self.remaining())))
            miou = re.findall(r'mIoU: ([0-9.]+)', proc.text)
            result['test_tool'] = dict(rc=rc, seconds=seconds,
                                       miou=float(miou[-1]) if miou else None)
            passed &= rc == 0 and bool(miou)
            if not (rc == 0 and miou):
                notes.append(f'tools/test.py on the plain config: rc {rc}, mIoU {miou}')
                result['test_tool']['tail'] = proc.text[-1500:]
        self.write_json('train.json', result)
        self.summary['figures']['train'] = {
            label: dict(final_loss=r.get('final_loss'), miou=r.get('miou'))
            for label, r in result['runs'].items()}
        self.finish(name, 'passed' if passed else 'failed', '; '.join(notes),
                    seconds=round(time.monotonic() - start, 1))

    # ------------------------------------------------------------------ the run
    def main(self) -> int:
        self.say(f'gpu_check: {self.summary["mode"]}, budget {self.args.budget} s, OUT {self.out}')
        self.guarded('env', self.step_env)
        self.guarded('install', self.step_install)
        only = self.args.only
        if only and not any(o.startswith(('memory', 'train')) for o in only):  # no mmseg
            self.finish('mmcv', 'skipped', 'no step in --only imports mmseg')
        else:
            self.guarded('mmcv', self.step_mmcv)
        self.guarded('build_ext', self.step_build_ext)
        others = [f'mesa:{p}' for p in self.summary.get('presets', []) if p != 'default']
        presets = others + [f'{m}+amp' for m in others] if self.sizes.memory_presets else []
        first, *rest = self.sizes.memory_batches
        modes = list(self.sizes.memory_modes)
        steps = [
            ('tests', lambda: self.step_tests('tests', self.sizes.test_files, None)),
            ('tests_cuda_default', lambda: self.step_tests(
                'tests_cuda_default', self.sizes.cuda_default_files,
                'cpu' if self.dry else 'cuda')),
            ('kernels', self.step_kernels),
            (f'memory_b{first}', lambda: self.step_memory(f'memory_b{first}', first, modes)),
            ('train', self.step_train),
            *[(f'memory_b{b}', lambda b=b: self.step_memory(f'memory_b{b}', b, modes))
              for b in rest],
            *[(f'memory_presets_b{b}', lambda b=b: self.step_memory(
                f'memory_presets_b{b}', b, presets)) for b in self.sizes.memory_batches
              if presets]]
        for name, step in steps:
            if only and not {name, re.sub(r'_b\d+$', '', name)} & set(only):
                self.finish(name, 'skipped', 'not in --only')
            else:
                self.guarded(name, step)
        if self.mmcv_build is not None and self.mmcv_build.popen.poll() is None:
            self.mmcv_build.kill()
        if self.mmcv_pending:
            self.finish('mmcv', 'skipped', 'no step that needs it ran')
        statuses = {k: v.get('status') for k, v in self.summary['steps'].items()}
        self.summary['result'] = dict(
            passed=sorted(k for k, s in statuses.items() if s == 'passed'),
            failed=sorted(k for k, s in statuses.items() if s == 'failed'),
            timed_out=sorted(k for k, s in statuses.items() if s == 'timed_out'),
            skipped=sorted(k for k, s in statuses.items() if s == 'skipped'))
        self.record('end', status='done')
        self.say(format_summary(self.summary))
        return 0 if not (self.summary['result']['failed'] or
                         self.summary['result']['timed_out']) else 1


# ---------------------------------------------------------------------- helpers
def mmcv_build_script(python: str, sdist: Path, build: Path, site: Path, with_ops: bool) -> str:
    """Unpack, apply the C++20 fix of tools/setup/build_mmcv.sh, build the wheel, install it."""
    return f'''set -euo pipefail
rm -rf "{build}"; mkdir -p "{build}"
tar -xzf "{sdist}" -C "{build}"
sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "{build}/mmcv-2.1.0/setup.py"
"{python}" -m pip wheel {'-v ' if with_ops else ''}--no-deps --no-build-isolation --no-index \
  -w "{build}/dist" "{build}/mmcv-2.1.0"
"{python}" -m pip install --no-index --no-deps --no-compile --upgrade --target "{site}" \
  "{build}"/dist/*.whl
'''


def parse_last_json(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (how the helper modes answer)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith('{'):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def junit_counts(path: Path) -> dict[str, int] | None:
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == 'testsuite' else root.findall('testsuite')
    return {key: sum(int(s.get(key, 0)) for s in suites)
            for key in ('tests', 'failures', 'errors', 'skipped')}


def merge_junit(paths: list[Path], target: Path) -> None:
    """One tests.xml from every pytest run (the device returns 8 files at most)."""
    root = ET.Element('testsuites')
    for path in paths:
        tree = ET.parse(path).getroot()
        for suite in [tree] if tree.tag == 'testsuite' else tree.findall('testsuite'):
            suite.set('name', path.stem)
            root.append(suite)
    ET.ElementTree(root).write(target, encoding='utf-8', xml_declaration=True)


def kernel_figures(path: Path) -> dict | None:
    if not path.exists():
        return None
    rows = json.loads(path.read_text()).get('kernels', [])
    if not rows:
        return None
    return dict(min_of_copy=min(r['of_copy'] for r in rows),
                of_copy={f'{r["case"]} {r["dtype"]} {r["op"]}': round(r['of_copy'], 3)
                         for r in rows},
                copy_gb_per_s=rows[0].get('copy_gb_per_s'))


def memory_figures(results: dict) -> dict:
    """The default preset against the baseline, in fp32 and AMP (against AMP alone).

    ``cuda_peak_bytes`` is torch.cuda.max_memory_allocated() over a step (what the acceptance
    names); ``peak_bytes`` is benchmark_memory.py's own step peak (older versions: the CUDA one).
    """
    modes = results.get('modes', {})
    figures = {}
    for precision, base, mesa in (('fp32', 'baseline', 'mesa:default'),
                                  ('amp', 'amp', 'mesa:default+amp')):
        if base not in modes or mesa not in modes:
            continue
        b, m = modes[base], modes[mesa]
        row: dict[str, float | None] = {
            f'baseline_{key[:-6]}_gib': round(b[key] / 2 ** 30, 3) if b.get(key) else None
            for key in ('cuda_peak_bytes', 'peak_bytes')}
        row.update({f'{key}_ratio': round(m[key] / b[key], 4) if m.get(key) and b.get(key)
                    else None for key in ('cuda_peak_bytes', 'peak_bytes', 'step_time_s',
                                          'saved_bytes')})
        figures[precision] = row
    return figures


def read_training_run(work_dir: Path, iters: int) -> dict:
    """Losses, validation mIoU and the checkpoint of a tools/train.py run."""
    runs = sorted(p for p in work_dir.glob('*/vis_data/scalars.json'))
    losses, miou = [], None
    if runs:
        for line in runs[-1].read_text().splitlines():
            record = json.loads(line)
            if 'mIoU' in record:
                miou = float(record['mIoU'])
            elif 'loss' in record:
                losses.append(float(record['loss']))
    checkpoint = work_dir / f'iter_{iters}.pth'
    return dict(iterations=len(losses), losses=losses,
                finite=bool(losses) and all(math.isfinite(x) for x in losses),
                final_loss=losses[-1] if losses else None, miou=miou,
                checkpoint=str(checkpoint) if checkpoint.exists() else None)


def load_demo_tool() -> Any:
    """tools/demo.py as a module: its Schedule and cfg_options are how demo runs are set."""
    spec = importlib.util.spec_from_file_location('mesa_demo_tool', REPO / 'tools' / 'demo.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def format_summary(summary: dict) -> str:
    lines = [f'\ngpu_check summary ({summary["mode"]}, {summary.get("elapsed_s")} s):']
    for name, step in summary['steps'].items():
        if name == 'end':
            continue
        seconds = f'{step["seconds"]:.0f} s' if step.get('seconds') is not None else ''
        lines.append(f'  {name:<20} {step.get("status", ""):<10} {seconds:>6}  '
                     f'{str(step.get("note", ""))[:150]}')
    for key, value in summary['acceptance'].items():
        lines.append(f'  acceptance {key}: {value["value"]} (limit {value["limit"]}) '
                     f'{"holds" if value["holds"] else "FAILS"}')
    return '\n'.join(lines)


# ---------------------------------------------------------------------- helper modes
def report_env() -> dict:
    """What this Python has (run as ``gpu_check.py --report-env`` under the steps' env)."""
    import importlib
    import platform
    report: dict[str, Any] = dict(python=sys.version.split()[0], executable=sys.executable,
                                  platform=platform.platform(), cpus=os.cpu_count())
    modules: dict[str, dict] = {}
    for module in MODULES:
        try:
            imported = importlib.import_module(module)
            modules[module] = dict(ok=True, version=str(getattr(imported, '__version__', '')),
                                   file=str(getattr(imported, '__file__', '')))
        except Exception as error:  # any failure to import is the finding
            modules[module] = dict(ok=False, error=f'{type(error).__name__}: {error}'[:400])
    report['modules'] = modules
    try:
        import torch
        report.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                      cuda_available=torch.cuda.is_available(), gpus=[])
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            report['gpus'].append(dict(name=props.name, capability=f'{props.major}.{props.minor}',
                                       memory_gib=round(props.total_memory / 2 ** 30, 1),
                                       multiprocessors=props.multi_processor_count))
    except Exception as error:
        report['torch_error'] = repr(error)
    try:
        from mmseg_mesa.config import PRESETS
        report['presets'] = list(PRESETS)
    except Exception as error:
        report['presets_error'] = repr(error)
    for tool, args in (('nvcc', ['--version']), ('nvidia-smi', [
            '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader']),
            ('gcc', ['--version']), ('ninja', ['--version']), ('taskset', ['--version'])):
        path = shutil.which(tool)
        if path is None:
            report[tool.replace('-', '_')] = None
            continue
        try:
            out = subprocess.run([path, *args], capture_output=True, text=True, timeout=30)
            lines = (out.stdout or out.stderr).strip().splitlines()
            release = [line for line in lines if 'release' in line]
            report[tool.replace('-', '_')] = (release or lines or [''])[0]
        except (OSError, subprocess.TimeoutExpired) as error:
            report[tool.replace('-', '_')] = f'failed: {error}'
    return report


def load_check(config: str, checkpoint: str) -> dict:
    """Load a checkpoint strictly into the model of ``config`` (plain mmseg, no Mesa)."""
    import torch
    from mmengine.config import Config
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    from mmseg_mesa.integrations import allow_mmengine_checkpoints
    register_all_modules()
    allow_mmengine_checkpoints()
    cfg = Config.fromfile(config)
    model = MODELS.build(cfg.model)
    state = torch.load(checkpoint, map_location='cpu')['state_dict']
    missing, unexpected = model.load_state_dict(state, strict=False)
    mesa_modules = sorted({type(m).__name__ for m in model.modules() if 'Mesa' in type(m).__name__})
    return dict(config=config, missing=list(missing), unexpected=list(unexpected),
                mesa_modules=mesa_modules,
                strict_ok=not missing and not unexpected and not mesa_modules, keys=len(state))


def pytest_configure(config: Any) -> None:
    """As a pytest plugin (``-p gpu_check``): make $GPU_CHECK_DEFAULT_DEVICE torch's default
    device, so tests that create modules and tensors without naming a device run there."""
    device = os.environ.get('GPU_CHECK_DEFAULT_DEVICE')
    if device:
        import torch
        torch.set_default_device(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--dry-run', action='store_true',
                        help='CPU, tiny sizes, nothing installed or built (what the test runs)')
    parser.add_argument('--out', default=os.environ.get('OUT'),
                        help='where results go (default: $OUT)')
    parser.add_argument('--work', default=None,
                        help='scratch folder (default: /tmp/gpu_check, or OUT/../gpu_check_work '
                             'in a dry run); never inside OUT: only 8 files come back')
    parser.add_argument('--budget', type=float, default=None,
                        help='seconds for the whole run (default: 510 on the GPU machine, '
                             '900 in a dry run: its steps are short, unless the CPU is shared)')
    parser.add_argument('--wheels', default='.gpu-wheels', help='carried wheels and sdists')
    parser.add_argument('--python', default=sys.executable,
                        help='the Python every step runs (default: this one)')
    parser.add_argument('--only', type=lambda v: v.split(','), default=None,
                        metavar='STEP,...', help='run only these of the steps after the set-up '
                        '(tests, tests_cuda_default, kernels, train, memory_b2, memory_b8, '
                        'memory_presets_b2, ...; memory or memory_presets: both batches): a '
                        'rerun; env, install, mmcv and build_ext always run (quick once done)')
    parser.add_argument('--mmcv-build-s', type=float, default=0, metavar='SECONDS',
                        help="build mmcv's CPU ops from the carried sdist, in the background, "
                        'for at most this long before the stand-in is used instead (about '
                        '2,800 core-seconds: some 4 minutes on 12 cores, which the first '
                        'memory step waits for). Default: 0, the stand-in at once: Mesa, Swin '
                        'and UPerNet call no mmcv op')
    parser.add_argument('--report-env', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--load-check', nargs=2, metavar=('CONFIG', 'CHECKPOINT'),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report_env or args.load_check:
        return args
    if not args.out:
        parser.error('give --out DIR (or set OUT)')
    if args.budget is None:
        args.budget = 900.0 if args.dry_run else 510.0
    if args.work is None:
        args.work = (osp.join(osp.dirname(osp.abspath(args.out)), 'gpu_check_work')
                     if args.dry_run else '/tmp/gpu_check')
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    if work == out or out in work.parents:
        parser.error('--work must not be inside --out (only 8 files come back from OUT)')
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_env:
        print(json.dumps(report_env(), default=str))
        return 0
    if args.load_check:
        print(json.dumps(load_check(*args.load_check)))
        return 0
    return Check(args).main()


if __name__ == '__main__':
    sys.exit(main())
