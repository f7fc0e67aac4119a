"""The steps of the GPU run, in order of value (``run_steps``); each is a function of the run's
``Check`` and ends with its record in summary.json (see tools/gpu_check.py for what each does)."""
from __future__ import annotations

import json
import os
import re

from .mmcv_setup import step_mmcv, wait_mmcv
from .results import (
    compile_figures,
    format_summary,
    junit_case_counts,
    junit_counts,
    kernel_figures,
    memory_figures,
    merge_junit,
    parse_last_json,
    sync_figures,
)
from .runner import Check
from .settings import (
    CPU_ONLY_TESTS,
    CROSS_DEVICE_TEST,
    ENTRY,
    KERNEL_OF_COPY_MIN,
    PEAK_RATIO_MAX,
    REPO,
    TIME_RATIO_MAX,
)
from .training import step_train


def step_env(check: Check, name: str = 'env', key: str = 'before') -> None:
    if not check.begin(name):
        return
    rc, seconds, proc = check.run(name, [check.python, str(ENTRY), '--report-env'],
                                  check.timeout_for('env'))
    report = parse_last_json(proc.text)
    env_file = check.out / 'env.json'
    data = json.loads(env_file.read_text()) if env_file.exists() else {}
    data[key] = report
    check.write_json('env.json', data)
    missing = sorted(m for m, v in (report or {}).get('modules', {}).items()
                     if not v.get('ok'))
    check.summary.setdefault('environment', {})[key] = {
        k: (report or {}).get(k) for k in ('python', 'torch', 'torch_cuda', 'gpus', 'nvcc')}
    check.summary['environment'][key]['missing'] = missing
    if report and report.get('presets'):
        check.summary['presets'] = report['presets']
    check.outcome(name, rc, seconds, proc, ok=report is not None,
                  note=f'missing: {", ".join(missing) or "nothing"}', missing=missing)


def step_install(check: Check) -> None:
    name = 'install'
    if check.dry:
        check.finish(name, 'skipped', 'dry run: the .venv has the stack')
        return
    if not check.begin(name):
        return
    wheels = sorted(check.wheels.glob('*.whl'))
    if not wheels:
        check.finish(name, 'failed', f'no wheels in {check.wheels}: run '
                     'tools/setup/prepare_gpu_wheels.sh here and carry .gpu-wheels')
        return
    rc, seconds, proc = check.run(name, [
        check.python, '-m', 'pip', 'install', '--no-index', '--no-deps', '--no-compile',
        '--no-cache-dir', '--upgrade', '--target', str(check.site), *map(str, wheels)],
        check.timeout_for('install'))
    check.outcome(name, rc, seconds, proc, wheels=[w.name for w in wheels])
    step_env(check, 'env_after_install', 'after_install')


def step_build_ext(check: Check) -> None:
    name = 'build_ext'
    if not check.begin(name):
        return
    if check.dry:
        rc, seconds, proc = check.run(name, [check.python, '-m', 'mmseg_mesa.info', '--check'],
                                      120)
        check.finish(name, 'skipped', 'dry run: no rebuild in the shared .venv',
                     info=proc.text.splitlines()[-30:])
        return
    rc, seconds, proc = check.run(name, [
        check.python, '-m', 'pip', 'install', '--no-build-isolation', '--no-deps', '--no-index',
        '-v', '-e', '.'], check.timeout_for('build_ext'),
        FORCE_CUDA='1', MAX_JOBS=str(check.args.build_jobs),
        **({'TORCH_CUDA_ARCH_LIST': check.args.cuda_arch} if check.args.cuda_arch else {}))
    # --check: every op of the kernels against the reference on the CPU and the GPU (MesaHook's
    # first-use check), pass or FAIL per op; it exits 1 on a disagreement
    info_rc, _, info = check.run('info', [check.python, '-m', 'mmseg_mesa.info', '--check'], 120)
    loadable = 'built and loadable' in info.text
    note = ('' if loadable else 'mmseg_mesa.info does not report a loadable _C; ') + (
        '' if info_rc == 0 else 'info --check: some op disagrees with the reference')
    check.outcome(name, rc, seconds, proc, ok=loadable and info_rc == 0,
                  info=info.text.splitlines()[-30:], note=note.strip('; '))


def step_tests(check: Check, name: str, files: tuple[str, ...], default_device: str | None
               ) -> None:
    if not check.begin(name):
        return
    junit = check.work / f'{name}.xml'
    junit.unlink(missing_ok=True)
    cmd = [check.python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rs',
           f'--junitxml={junit}', *files]
    env = {}
    if default_device:
        cmd[3:3] = ['-p', 'gpu_check.plugin']  # torch's default device
        cmd += ['-k', ' and '.join(f'not {t}' for t in CPU_ONLY_TESTS)]
        env = dict(GPU_CHECK_DEFAULT_DEVICE=default_device,
                   PYTHONPATH=os.pathsep.join([check.env()['PYTHONPATH'], str(REPO / 'tools')]))
    rc, seconds, proc = check.run(name, cmd, check.timeout_for(name), **env)
    counts = junit_counts(junit)
    merge_junit(sorted(check.work.glob('tests*.xml')), check.out / 'tests.xml')
    skipped = (counts or {}).get('skipped', 0)
    ok = counts is not None and (check.dry or skipped == 0)
    note = f'{counts}' if counts else 'no JUnit XML written'
    if counts and skipped and not check.dry:
        note += ': tests were skipped on the GPU machine'
    cross = junit_case_counts(junit, CROSS_DEVICE_TEST) if name == 'tests' else None
    if cross is not None and (cross['passed'] or cross['failed'] or not check.dry):
        # CPU-kernel codes == CUDA-kernel codes, deterministic and stochastic rounding
        check.summary['acceptance']['cpu_cuda_codes'] = dict(
            value=cross, limit='every case passes',
            holds=cross['passed'] > 0 and not cross['failed'] + cross['skipped'])
    if default_device:
        note += (f' (default device {default_device}; left out, CPU only: '
                 f'{", ".join(CPU_ONLY_TESTS)})')
    check.outcome(name, rc, seconds, proc, ok=ok, note=note, counts=counts,
                  skips=[line for line in proc.lines if line.startswith('SKIPPED')][:20])


def step_kernels(check: Check) -> None:
    name = 'kernels'
    if not check.begin(name):
        return
    path = check.out / 'kernels.json'
    rc, seconds, proc = check.run(name, [check.python, 'tools/benchmark_kernels.py', '--json',
                                         str(path)], check.timeout_for(name))
    if check.dry:
        refused = rc == 2 and 'no CUDA GPU' in proc.text
        check.finish(name, 'skipped' if refused else 'failed',
                     'CUDA only: benchmark_kernels.py refused without a GPU (rc 2)'
                     if refused else f'expected rc 2 without a GPU, got {rc}', rc=rc,
                     seconds=seconds, tail='' if refused else proc.text[-2000:])
        return
    figures = kernel_figures(path)
    check.summary['figures']['kernels'] = figures
    if figures:
        check.summary['acceptance']['kernel_of_copy_min'] = dict(
            value=figures['min_of_copy'], limit=KERNEL_OF_COPY_MIN,
            holds=figures['min_of_copy'] >= KERNEL_OF_COPY_MIN)
    check.outcome(name, rc, seconds, proc, ok=figures is not None,
                  note=f'min of copy {figures["min_of_copy"]:.2f}' if figures else '')


def step_syncs(check: Check) -> None:
    """``benchmark_speed.py --count`` on the memory config at batch 2: kernel ops and host syncs
    of one forward + backward per mode (the dispatcher's count; on the GPU also CUDA's own
    reports, ``set_sync_debug_mode('warn')``) and the step times in turn. Mesa must add no
    syncing op."""
    wait_mmcv(check)
    name = 'syncs'
    if not check.begin(name, needs_s=40):
        return
    path = check.out / 'syncs.json'
    cmd = [check.python, 'tools/benchmark_speed.py', check.sizes.memory_config, '--device',
           'cpu' if check.dry else 'cuda', '--batch', '2', '--iters', str(check.sizes.speed_iters),
           '--warmup', '1', '--count', '--json', str(path)]
    rc, seconds, proc = check.run(name, cmd, check.timeout_for(name))
    figures = sync_figures(path) if rc == 0 else None
    if figures is not None:
        check.summary['figures']['syncs'] = figures
        if not check.dry:
            check.summary['acceptance']['mesa_added_syncs'] = dict(
                value=figures['added_syncs'], limit=0, holds=figures['added_syncs'] == 0)
    check.outcome(name, rc, seconds, proc, ok=figures is not None and not figures['added_syncs'],
                  note=(f'kernel ops {figures["kernel_ratio"]:.2f}x, '
                        f'{figures["added_syncs"]} syncs added' if figures else 'no counts'))


def step_compile(check: Check) -> None:
    """``benchmark_compile.py`` on the memory config at batch 2: the compiled baseline and the
    compiled Mesa model's first step (the compile), graphs, graph breaks (none may be in
    ``mmseg_mesa``), recompiles after the first step (none), gradients against eager Mesa and
    step times next to eager."""
    wait_mmcv(check)
    name = 'compile'
    if not check.begin(name, needs_s=60):
        return
    path = check.out / 'compile.json'
    cmd = [check.python, 'tools/benchmark_compile.py', check.sizes.memory_config, '--device',
           'cpu' if check.dry else 'cuda', '--batch', '2', '--steps', '3',
           '--iters', str(check.sizes.speed_iters), '--json', str(path)]
    rc, seconds, proc = check.run(name, cmd, check.timeout_for(name))
    figures = compile_figures(path) if rc == 0 else None
    if figures is not None:
        check.summary['figures']['compile'] = figures
    ok = figures is not None and figures['breaks_in_mmseg_mesa'] == [] and \
        figures['recompiles_after_first'] == 0
    check.outcome(name, rc, seconds, proc, ok=ok,
                  note=(f'compiled Mesa step {figures["mesa_compiled_ratio"]:.2f}x eager '
                        f'baseline, {len(figures["breaks_in_mmseg_mesa"])} breaks in mmseg_mesa, '
                        f'{figures["recompiles_after_first"]} recompiles' if figures
                        else 'no results'))


def step_memory(check: Check, name: str, batch: int, modes: list[str]) -> None:
    """One tools/benchmark_memory.py run; its modes join the batch's entry of memory.json
    (one run per group of modes: a run cut at its timeout loses only its own group)."""
    wait_mmcv(check)
    if not check.begin(name, needs_s=40):
        return
    device = 'cpu' if check.dry else 'cuda'
    raw = check.work / f'{name}.json'
    cmd = [check.python, 'tools/benchmark_memory.py', check.sizes.memory_config, '--device',
           device, '--batch', str(batch), '--modes', *modes, '--json', str(raw)]
    if check.sizes.memory_iters:
        cmd += ['--iters', str(check.sizes.memory_iters)]
    rc, seconds, proc = check.run(name, cmd, check.timeout_for(name))
    results = json.loads(raw.read_text()) if rc == 0 and raw.exists() else None
    merged_path = check.out / 'memory.json'
    merged = json.loads(merged_path.read_text()) if merged_path.exists() else {}
    if results is not None:
        entry = merged.setdefault(f'batch_{batch}', {**results, 'modes': {}, 'runs': []})
        entry['modes'].update(results['modes'])
        entry['runs'].append(dict(step=name, modes=modes, seconds=seconds))
        check.write_json('memory.json', merged)
        figures = memory_figures(entry)
        check.summary['figures'][f'memory_b{batch}'] = figures
        for precision, row in figures.items() if not check.dry else ():
            peak = ('cuda_peak_bytes_ratio' if row.get('cuda_peak_bytes_ratio') is not None
                    else 'peak_bytes_ratio')
            for key, limit in ((peak, PEAK_RATIO_MAX), ('step_time_s_ratio', TIME_RATIO_MAX)):
                if row.get(key) is not None:
                    check.summary['acceptance'][f'b{batch} {precision} {key}'] = dict(
                        value=row[key], limit=limit, holds=row[key] <= limit)
    check.outcome(name, rc, seconds, proc, ok=results is not None, modes=modes,
                  note='' if results is not None else 'no results JSON')


def run_steps(check: Check) -> int:
    """Every step in order of value; 0 when none failed or timed out."""
    check.say(f'gpu_check: {check.summary["mode"]}, budget {check.args.budget} s, '
              f'OUT {check.out}')
    check.guarded('env', lambda: step_env(check))
    check.guarded('install', lambda: step_install(check))
    only = check.args.only
    if only and not any(o.startswith(('memory', 'train', 'syncs')) for o in only):  # no mmseg
        check.finish('mmcv', 'skipped', 'no step in --only imports mmseg')
    else:
        check.guarded('mmcv', lambda: step_mmcv(check))
    check.guarded('build_ext', lambda: step_build_ext(check))
    others = [f'mesa:{p}' for p in check.summary.get('presets', []) if p != 'default']
    presets = others + [f'{m}+amp' for m in others] if check.sizes.memory_presets else []
    first, *rest = check.sizes.memory_batches
    modes = list(check.sizes.memory_modes)
    steps = [
        ('tests', lambda: step_tests(check, 'tests', check.sizes.test_files, None)),
        ('tests_cuda_default', lambda: step_tests(
            check, 'tests_cuda_default', check.sizes.cuda_default_files,
            'cpu' if check.dry else 'cuda')),
        ('kernels', lambda: step_kernels(check)),
        ('syncs', lambda: step_syncs(check)),
        (f'memory_b{first}', lambda: step_memory(check, f'memory_b{first}', first, modes)),
        ('train', lambda: step_train(check)),
        *[(f'memory_b{b}', lambda b=b: step_memory(check, f'memory_b{b}', b, modes))
          for b in rest],
        *[(f'memory_presets_b{b}', lambda b=b: step_memory(
            check, f'memory_presets_b{b}', b, presets)) for b in check.sizes.memory_batches
          if presets],
        ('compile', lambda: step_compile(check))]
    for name, step in steps:
        if only and not {name, re.sub(r'_b\d+$', '', name)} & set(only):
            check.finish(name, 'skipped', 'not in --only')
        else:
            check.guarded(name, step)
    if check.mmcv_build is not None and check.mmcv_build.popen.poll() is None:
        check.mmcv_build.kill()
    if check.mmcv_pending:
        check.finish('mmcv', 'skipped', 'no step that needs it ran')
    statuses = {k: v.get('status') for k, v in check.summary['steps'].items()}
    check.summary['result'] = dict(
        passed=sorted(k for k, s in statuses.items() if s == 'passed'),
        failed=sorted(k for k, s in statuses.items() if s == 'failed'),
        timed_out=sorted(k for k, s in statuses.items() if s == 'timed_out'),
        skipped=sorted(k for k, s in statuses.items() if s == 'skipped'))
    check.record('end', status='done')
    check.say(format_summary(check.summary))
    return 0 if not (check.summary['result']['failed'] or
                     check.summary['result']['timed_out']) else 1
