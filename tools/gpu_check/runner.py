"""The run's machinery: child processes, the log, summary.json and the time budget.

Every step is a function of ``Check`` (``steps``, ``mmcv_setup``): it asks ``begin`` for time,
runs its tools with ``run`` (streamed into gpu_check.log with the step's name as prefix) and
records its outcome, so that summary.json says what ran at every moment.
"""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .settings import (
    DRY,
    FOREGROUND_CORES,
    GPU,
    MIN_STEP_S,
    OUT_FILES,
    REPO,
    RESERVE_S,
    STEP_THREADS,
)


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
        self.mmcv_build: Proc | None = None  # mmcv's ops building in the background
        self.mmcv_pending = False  # that build is not joined yet (mmcv_setup.wait_mmcv)
        self.pinned = False  # steps pinned to the first FOREGROUND_CORES while mmcv builds

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

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        paths = ([str(self.site)] if not self.dry else []) + [str(REPO)]
        env['PYTHONPATH'] = os.pathsep.join(paths + [p for p in [env.get('PYTHONPATH')] if p])
        env.setdefault('OMP_NUM_THREADS', '1' if self.dry else str(STEP_THREADS))
        env.update(PYTHONUNBUFFERED='1', MPLBACKEND='Agg', **extra)
        return env

    def pin(self, cmd: list[str]) -> list[str]:
        """Keep the steps on the first cores while mmcv builds on the others."""
        if self.pinned and self.mmcv_build is not None and self.mmcv_build.popen.poll() is None:
            return ['taskset', '-c', f'0-{FOREGROUND_CORES - 1}', *cmd]
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

    def guarded(self, name: str, step: Callable[[], Any]) -> None:
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
