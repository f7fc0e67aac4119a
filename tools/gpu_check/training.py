"""The training step: tools/train.py on the demo config (with AMP on the GPU), then its
checkpoint in the plain config: a strict state-dict load and tools/test.py."""
from __future__ import annotations

import importlib.util
import re
import sys
import time
from typing import Any

from .mmcv_setup import wait_mmcv
from .results import parse_last_json, read_training_run
from .runner import Check
from .settings import ENTRY, MESA_DEMO, PLAIN_DEMO, REPO


def step_train(check: Check) -> None:
    name = 'train'
    wait_mmcv(check)
    if not check.begin(name, needs_s=60):
        return
    demo = load_demo_runs()
    sizes, data_root = check.sizes, check.work / 'demo_data'
    schedule = demo.Schedule(num_train=4 * sizes.train_batch, num_val=8, size=64,
                             max_iters=sizes.train_iters, batch_size=sizes.train_batch,
                             log_interval=1)
    options = demo.option_args(demo.cfg_options(str(data_root), 0, schedule))
    result: dict[str, Any] = dict(iters=sizes.train_iters, batch=sizes.train_batch, runs={})
    start = time.monotonic()
    ok, text = check.python_ok(
        'from mmseg_mesa.demo import write_demo_dataset; '
        f'write_demo_dataset({str(data_root)!r}, num_train={schedule.num_train}, '
        f'num_val={schedule.num_val}, size={schedule.size}, seed=0)', timeout=120)
    passed, notes = ok, [] if ok else [f'dataset: {text[-300:]}']
    checkpoint = None
    for dtype in sizes.amp_dtypes or (None,):
        label = dtype or 'fp32 (no --amp on CPU)'
        if checkpoint is not None and check.remaining() < 60:
            notes.append(f'{label}: skipped, no time left')
            continue
        work_dir = check.work / f'train_{dtype or "fp32"}'
        cmd = [check.python, 'tools/train.py', MESA_DEMO, '--work-dir', str(work_dir)]
        cmd += (['--amp'] if dtype else []) + ['--cfg-options', *options]
        if dtype and dtype != 'float16':
            cmd.append(f'optim_wrapper.dtype={dtype}')
        rc, seconds, proc = check.run(f'train_{dtype or "fp32"}', cmd,
                                      min(check.timeout_for(name), check.remaining() - 30))
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
        check.write_json('train.json', result)
        checkpoint = checkpoint or run.get('checkpoint')
    if checkpoint is None:
        passed = False
        notes.append('no checkpoint was written')
    else:
        rc, _, proc = check.run('load_plain', [check.python, str(ENTRY), '--load-check',
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
        rc, seconds, proc = check.run('test_plain', [
            check.python, 'tools/test.py', PLAIN_DEMO, checkpoint, '--work-dir',
            str(check.work / 'test_plain'), '--cfg-options', *data],
            min(120, max(1, check.remaining())))
        miou = re.findall(r'mIoU: ([0-9.]+)', proc.text)
        result['test_tool'] = dict(rc=rc, seconds=seconds,
                                   miou=float(miou[-1]) if miou else None)
        passed &= rc == 0 and bool(miou)
        if not (rc == 0 and miou):
            notes.append(f'tools/test.py on the plain config: rc {rc}, mIoU {miou}')
            result['test_tool']['tail'] = proc.text[-1500:]
    check.write_json('train.json', result)
    check.summary['figures']['train'] = {
        label: dict(final_loss=r.get('final_loss'), miou=r.get('miou'))
        for label, r in result['runs'].items()}
    check.finish(name, 'passed' if passed else 'failed', '; '.join(notes),
                 seconds=round(time.monotonic() - start, 1))


def load_demo_runs() -> Any:
    """``mmseg_mesa/demo/runs.py`` (standard library only), loaded by its path: its Schedule
    and cfg_options are how demo runs are set, and this process need not import the stack."""
    spec = importlib.util.spec_from_file_location('mesa_demo_runs',
                                                  REPO / 'mmseg_mesa' / 'demo' / 'runs.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
