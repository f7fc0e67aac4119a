"""mmcv on a bare machine: a carried wheel with ops if it loads; else its Python part from the
carried sdist with a stand-in for the compiled ops (mmseg imports ``mmcv.ops`` at start; Mesa,
Swin and UPerNet call no mmcv op), or, with ``--mmcv-build-s N``, its CPU ops built in the
background for at most N seconds."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from .runner import Check, Proc
from .settings import (
    FOREGROUND_CORES,
    MMCV_SDIST,
    MMCV_VERSION,
    PINNING_MIN_CORES,
)

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


def mmcv_build_script(python: str, sdist: Path, build: Path, site: Path, with_ops: bool) -> str:
    """Unpack, apply the C++20 fix of tools/setup/build_mmcv.sh, build the wheel, install it."""
    source = f'{build}/mmcv-{MMCV_VERSION}'
    return f'''set -euo pipefail
rm -rf "{build}"; mkdir -p "{build}"
tar -xzf "{sdist}" -C "{build}"
sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "{source}/setup.py"
"{python}" -m pip wheel {'-v ' if with_ops else ''}--no-deps --no-build-isolation --no-index \\
  -w "{build}/dist" "{source}"
"{python}" -m pip install --no-index --no-deps --no-compile --upgrade --target "{site}" \\
  "{build}"/dist/*.whl
'''


def step_mmcv(check: Check) -> None:
    """Check mmcv's ops; if they are missing: the stand-in, or their build in the background
    (joined in ``wait_mmcv``) with ``--mmcv-build-s``."""
    name = 'mmcv'
    if not check.begin(name):
        return
    ok, text = check.python_ok('import mmcv, mmcv.ops, mmcv._ext as ext; '
                               'print(mmcv.__version__, ext.__file__)')
    stand_in = ok and '/mmcv/_ext.py' in text
    if stand_in and check.args.mmcv_build_s <= 0:
        check.finish(name, 'passed', 'the stand-in mmcv._ext of an earlier run is in place')
        return
    if ok and not stand_in:
        check.finish(name, 'passed', f'mmcv with ops loads: {text.splitlines()[-1]}')
        return
    sdist = check.wheels / MMCV_SDIST
    if check.dry or not sdist.exists():
        why = 'dry run builds nothing' if check.dry else f'no {MMCV_SDIST} in {check.wheels}'
        check.finish(name, 'failed', f'mmcv.ops does not load ({text[-300:]}); {why}')
        return
    if check.args.mmcv_build_s <= 0:
        mmcv_stand_in(check, None)
        return
    check.mmcv_pending = True
    cores = os.cpu_count() or 1
    pin = cores >= PINNING_MIN_CORES
    jobs = max(1, cores - FOREGROUND_CORES) if pin else cores
    script = mmcv_build_script(check.python, sdist, check.work / 'mmcv_build', check.site,
                               with_ops=True)
    cmd = ['bash', '-c', script]
    foreground = f'0-{FOREGROUND_CORES - 1}'
    if pin and shutil.which('taskset') and subprocess.run(
            ['taskset', '-c', foreground, 'true'], capture_output=True).returncode == 0:
        cmd = ['taskset', '-c', f'{FOREGROUND_CORES}-{cores - 1}', *cmd]
        check.pinned = True
    check.mmcv_build = Proc(check, name, cmd, check.env(
        CUDA_VISIBLE_DEVICES='', FORCE_CUDA='0', MMCV_WITH_OPS='1', MAX_JOBS=str(jobs)))
    check.record(name, status='running', note=f'building with CPU ops, {jobs} jobs, in the '
                 'background', pinned=check.pinned)


def wait_mmcv(check: Check) -> None:
    """Before the first step that imports mmseg: join the mmcv build, or fall back."""
    if not check.mmcv_pending:
        return
    check.mmcv_pending = False
    name, proc = 'mmcv', check.mmcv_build
    assert proc is not None
    left = check.args.mmcv_build_s - (time.monotonic() - proc.start)
    rc, seconds = proc.wait(min(left, check.remaining() - 60))
    if rc == 0 and check.python_ok('import mmcv.ops')[0]:
        built = sorted((check.work / 'mmcv_build' / 'dist').glob('mmcv-*.whl'))
        limit = check.args.file_limit_mib
        returned = [w for w in built if limit is None or w.stat().st_size <= limit * 2 ** 20]
        for wheel in returned:  # carry it next time: no build then
            shutil.copy2(wheel, check.out / wheel.name)
        check.finish(name, 'passed', f'built with CPU ops in {seconds} s' +
                     (f'; {returned[0].name} is in OUT' if returned else ''), seconds=seconds)
        return
    mmcv_stand_in(check, proc, f'timed out after {seconds} s' if rc is None
                  else f'failed (rc {rc})')


def mmcv_stand_in(check: Check, build: Proc | None, why: str = '') -> None:
    """mmcv's Python part and a stand-in mmcv._ext: by choice (no ``build``) or as the
    fallback of a build that failed or ran out of time."""
    name = 'mmcv'
    fallback = mmcv_build_script(check.python, check.wheels / MMCV_SDIST,
                                 check.work / 'mmcv_lite', check.site, with_ops=False)
    lite_rc, _, lite = check.run('mmcv_lite', ['bash', '-c', fallback], 120, MMCV_WITH_OPS='0')
    if lite_rc == 0:
        (check.site / 'mmcv' / '_ext.py').write_text(MMCV_EXT_STAND_IN)
    loads = lite_rc == 0 and check.python_ok('import mmseg.models')[0]
    chosen = build is None and loads
    what = ('mmcv without ops and a stand-in mmcv._ext (Mesa, Swin and UPerNet call no mmcv '
            'op)' if loads else 'mmcv without ops failed to build or import')
    check.finish(name, 'passed' if chosen else 'failed',
                 what if build is None else f'the CPU-ops build {why}; {what}',
                 tail='' if chosen else (build.text[-2000:] if build else '') + '\n' +
                 lite.text[-1000:])
