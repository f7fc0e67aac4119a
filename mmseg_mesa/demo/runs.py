"""Training runs of the demo model through ``tools/train.py``, as ``tools/demo.py`` and
``tools/benchmark_training.py`` start and read them: config overrides, one subprocess per run
(its output streamed, its CPU time and peak RSS recorded), and what its ``scalars.json`` says."""
from __future__ import annotations

import collections
import json
import os
import os.path as osp
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Schedule:
    """Dataset size and training length of a demo run."""

    num_train: int
    num_val: int
    size: int
    max_iters: int | None  # None keeps the config's schedule
    batch_size: int | None = None
    log_interval: int | None = None
    timed_steps: int = 7  # training steps of each model timed in turn (after one untimed)


FULL = Schedule(num_train=2000, num_val=200, size=64, max_iters=None)
QUICK = Schedule(num_train=16, num_val=8, size=64, max_iters=6, batch_size=4, log_interval=2,
                 timed_steps=2)


def cfg_options(data_root: str, seed: int, schedule: Schedule) -> dict[str, Any]:
    """Overrides of the demo configs: data location, seed and (when set) the schedule."""
    options: dict[str, Any] = {'randomness.seed': seed}
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        options[f'{loader}.dataset.data_root'] = data_root
    if schedule.batch_size is not None:
        options['train_dataloader.batch_size'] = schedule.batch_size
    if schedule.log_interval is not None:
        options['default_hooks.logger.interval'] = schedule.log_interval
    if schedule.max_iters is not None:
        iters = schedule.max_iters
        warmup = max(1, iters // 10)
        options.update({
            'train_cfg.max_iters': iters, 'train_cfg.val_interval': iters,
            'default_hooks.checkpoint.interval': iters,
            'param_scheduler.0.end': warmup, 'param_scheduler.1.begin': warmup,
            'param_scheduler.1.end': iters})
    return options


def option_args(options: dict[str, Any]) -> list[str]:
    return [f'{key}={value}' for key, value in options.items()]


_TRAIN_LINE = re.compile(
    r'Iter\(train\)\s*\[\s*(\d+)/(\d+)\].*?eta:\s*(\S+).*?\sloss:\s*([-\d.e]+)')


def progress_line(line: str) -> str | None:
    """A one-line summary of an mmengine training log line (``iter 200/1000  eta 0:02:10
    loss 0.3512``), ``'validation'`` for the validation's result line, None for the rest."""
    match = _TRAIN_LINE.search(line)
    if match:
        it, total, eta, loss = match.groups()
        return f'iter {int(it):>{len(total)}}/{total}  eta {eta}  loss {float(loss):.4f}'
    if 'Iter(val)' in line and 'mIoU' in line:
        return 'validation: ' + line.split('Iter(val)', 1)[1].strip()
    return None


class TrainingRun:
    """One ``tools/train.py`` subprocess: its output streamed with a prefix, its usage recorded.

    A thread streams the child's output (every line, or what ``show`` makes of each line, where
    it returns one; the last lines are printed in full if the run fails) and then reaps it with
    ``os.wait4``, which gives the child's own peak RSS and CPU time (not those of this process
    or of another run).
    """

    def __init__(self, name: str, train_script: str, config: str, work_dir: str,
                 options: dict[str, Any], threads: int,
                 show: Callable[[str], str | None] | None = None) -> None:
        self.name, self.work_dir = name, work_dir
        os.makedirs(work_dir, exist_ok=True)
        self._before = set(os.listdir(work_dir))
        self._show = show
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        cmd = [sys.executable, '-u', train_script, config,
               '--work-dir', work_dir, '--cfg-options', *option_args(options)]
        env = dict(os.environ)
        repo = osp.dirname(osp.dirname(osp.abspath(train_script)))
        env['PYTHONPATH'] = os.pathsep.join(p for p in (repo, env.get('PYTHONPATH')) if p)
        env['OMP_NUM_THREADS'] = env['MKL_NUM_THREADS'] = str(threads)
        print(f'[{name}] $ {" ".join(cmd)}', flush=True)
        self._start = time.perf_counter()
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env=env, text=True, bufsize=1)
        self._result: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._stream_and_reap, daemon=True)
        self._thread.start()

    def _stream_and_reap(self) -> None:
        proc = self._proc
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                self._tail.append(line)
                shown = line if self._show is None else self._show(line)
                if shown is not None:
                    print(f'[{self.name}] {shown.rstrip()}', flush=True)
        _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss is in KiB on Linux
        proc.returncode = os.waitstatus_to_exitcode(status)
        self._result = dict(train_time_s=round(time.perf_counter() - self._start, 2),
                            cpu_time_s=round(usage.ru_utime + usage.ru_stime, 2),
                            peak_rss_bytes=int(usage.ru_maxrss) * 1024)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> dict[str, Any]:
        """Wait for the run; its wall and CPU time, peak RSS and run directory."""
        self._thread.join()
        if self._proc.returncode != 0:
            if self._show is not None:
                print(''.join(f'[{self.name}] {line}' for line in self._tail), end='')
            raise SystemExit(f'the {self.name} run failed (exit code {self._proc.returncode}); '
                             f'see its log above and under {self.work_dir}')
        runs = sorted(set(os.listdir(self.work_dir)) - self._before)
        runs = [r for r in runs
                if osp.isfile(osp.join(self.work_dir, r, 'vis_data', 'scalars.json'))]
        if not runs:
            raise SystemExit(f'the {self.name} run wrote no vis_data/scalars.json under '
                             f'{self.work_dir}')
        return dict(self._result, run_dir=osp.join(self.work_dir, runs[-1]))


def read_scalars(run_dir: str) -> dict[str, Any]:
    """Loss curve, final loss and validation metrics from a run's ``scalars.json``."""
    iters, losses, times, val = [], [], [], {}
    with open(osp.join(run_dir, 'vis_data', 'scalars.json')) as f:
        for line in f:
            record = json.loads(line)
            if 'mIoU' in record:
                val = record
            elif 'loss' in record:
                iters.append(record['iter'])
                losses.append(record['loss'])
                times.append(record.get('time'))
    if not val:
        raise SystemExit(f'no validation result (mIoU) in {run_dir}/vis_data/scalars.json')
    times = [t for t in times if t is not None]
    return dict(miou=float(val['mIoU']), aacc=float(val.get('aAcc', 'nan')),
                macc=float(val.get('mAcc', 'nan')), final_loss=float(losses[-1]),
                iter_time_s=round(sum(times) / len(times), 4) if times else None,
                loss_curve=dict(iter=iters, loss=losses))
