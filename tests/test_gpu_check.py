"""tools/gpu_check.sh, the one-command GPU run, in its CPU dry run: the same steps and files, so
the script cannot rot between the runs on a lent GPU machine."""
import ast
import json
import math
import os
import os.path as osp
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
# Result files are named in letters, digits, ".", "_" and "-" (a device that returns files
# by name may refuse others).
RETURNABLE = re.compile(r'^[A-Za-z0-9._-]+$')


def gpu_check(out, work, *args, timeout=900):
    cmd = ['bash', osp.join(ROOT, 'tools', 'gpu_check.sh'), '--dry-run', '--out', str(out),
           '--work', str(work), *args]
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS='1')
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope='module')
def dry_run(tmp_path_factory):
    base = tmp_path_factory.mktemp('gpu_check')
    proc = gpu_check(base / 'out', base / 'work')
    return proc, base / 'out'


def load(out, name):
    return json.loads((out / name).read_text())


@pytest.mark.slow
def test_dry_run_passes_and_leaves_only_returnable_files(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir())
    assert len(files) <= 8 and all(RETURNABLE.match(name) for name in files), files
    assert {'summary.json', 'gpu_check.log', 'env.json', 'tests.xml', 'memory.json',
            'train.json'} <= set(files)
    assert 'gpu_check summary' in proc.stdout  # the run tool shows the end of stdout


@pytest.mark.slow
def test_summary_says_what_ran_and_what_is_cuda_only(dry_run):
    _, out = dry_run
    summary = load(out, 'summary.json')
    status = {name: step['status'] for name, step in summary['steps'].items()}
    assert status == {'env': 'passed', 'install': 'skipped', 'mmcv': 'passed',
                      'build_ext': 'skipped', 'tests': 'passed', 'tests_cuda_default': 'passed',
                      'kernels': 'skipped', 'syncs': 'passed', 'memory_b2': 'passed',
                      'train': 'passed', 'compile': 'passed', 'end': 'done'}
    assert summary['result']['failed'] == [] and summary['result']['timed_out'] == []
    assert 'refused without a GPU' in summary['steps']['kernels']['note']
    assert summary['acceptance'] == {}  # no GPU figures from a CPU run
    log = (out / 'gpu_check.log').read_text()
    assert summary['figures']['syncs']['added_syncs'] == 0  # the dispatcher's count on CPU
    assert summary['figures']['syncs']['kernel_ratio'] > 1
    assert summary['figures']['compile']['breaks_in_mmseg_mesa'] == []
    assert summary['figures']['compile']['recompiles_after_first'] == 0
    for step in ('env', 'tests', 'tests_cuda_default', 'syncs', 'memory_b2', 'train_fp32',
                 'load_plain'):
        assert f'[{step}] ' in log, step


@pytest.mark.slow
def test_environment_report_matches_this_interpreter(dry_run):
    _, out = dry_run
    report = load(out, 'env.json')['before']
    assert report['torch'] == torch.__version__
    assert report['python'] == sys.version.split()[0]
    assert report['modules']['mmseg.models']['ok'] and report['modules']['mmengine.runner']['ok']
    assert report['cuda_available'] == torch.cuda.is_available()
    from mmseg_mesa.config import PRESETS
    assert report['presets'] == list(PRESETS)


@pytest.mark.slow
def test_junit_has_both_pytest_runs(dry_run):
    _, out = dry_run
    suites = {s.get('name'): s for s in ET.parse(out / 'tests.xml').getroot()}
    assert set(suites) == {'tests', 'tests_cuda_default'}
    main = suites['tests']
    assert int(main.get('tests')) > 5 and int(main.get('failures')) == 0
    assert int(main.get('errors')) == 0
    if not torch.cuda.is_available():  # test_extension's kernel tests need a GPU
        assert int(main.get('skipped')) > 0


@pytest.mark.slow
def test_memory_benchmark_results(dry_run):
    _, out = dry_run
    results = load(out, 'memory.json')['batch_2']
    assert results['device'] == 'cpu' and results['size'] == [64, 64]  # the demo model's
    modes = results['modes']
    assert list(modes) == ['baseline', 'mesa:default', 'amp']
    assert all(m['saved_bytes'] > 0 and m['step_time_s'] > 0 for m in modes.values())
    assert modes['mesa:default']['saved_bytes'] < 0.5 * modes['baseline']['saved_bytes']
    figures = load(out, 'summary.json')['figures']['memory_b2']
    assert figures['fp32']['saved_bytes_ratio'] == pytest.approx(
        modes['mesa:default']['saved_bytes'] / modes['baseline']['saved_bytes'], rel=1e-3)


@pytest.mark.slow
def test_training_run_and_plain_checkpoint(dry_run):
    _, out = dry_run
    train = load(out, 'train.json')
    (run,) = train['runs'].values()
    assert run['rc'] == 0 and run['iterations'] == train['iters'] == 2
    assert all(math.isfinite(x) for x in run['losses']) and run['mesa_converted']
    assert run['amp_wrapper'] is False  # mmengine's AmpOptimWrapper needs a GPU
    assert train['plain_load']['strict_ok'] and train['plain_load']['keys'] > 100
    assert train['plain_load']['mesa_modules'] == []
    assert 0.0 <= run['miou'] <= 100.0  # the validation at the end of training


@pytest.mark.slow
def test_budget_guard_skips_steps_and_still_writes_the_summary(tmp_path):
    proc = gpu_check(tmp_path / 'out', tmp_path / 'work', '--budget', '25', timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = load(tmp_path / 'out', 'summary.json')
    skipped = [name for name, step in summary['steps'].items()
               if step['status'] == 'skipped' and 'no time left' in step.get('note', '')]
    assert 'env' in skipped and 'train' in skipped and 'memory_b2' in skipped


@pytest.mark.slow
def test_work_folder_inside_out_is_refused(tmp_path):
    proc = gpu_check(tmp_path / 'out', tmp_path / 'out' / 'work', timeout=60)
    assert proc.returncode == 2 and '--work must not be inside --out' in proc.stderr


def test_machine_limits_are_options_with_workstation_defaults(tmp_path):
    """Time, file size, CUDA architectures and build jobs are options; by default a run gets 30
    minutes, no file limit, torch's choice of architectures (the visible GPUs') and every core."""
    from tools.gpu_check.cli import parse_args
    default = parse_args(['--out', str(tmp_path / 'out')])
    assert (default.budget, default.file_limit_mib, default.cuda_arch) == (1800.0, None, None)
    assert default.build_jobs == (os.cpu_count() or 1)
    tight = parse_args(['--out', str(tmp_path / 'out'), '--budget', '510', '--file-limit-mib',
                        '16', '--cuda-arch', '9.0', '--build-jobs', '4'])
    assert (tight.budget, tight.file_limit_mib, tight.cuda_arch, tight.build_jobs) == (
        510.0, 16.0, '9.0', 4)


def test_layer_tests_draw_from_cpu_generators_on_the_default_device():
    """The CUDA-default step runs the layer tests with a GPU as torch's default device, where
    ``torch.randn(..., generator=cpu_generator)`` raises: every draw from a generator there names
    its device (``conftest.drawn``), or the GPU run fails on test code, not on Mesa."""
    from tools.gpu_check.settings import LAYER_TESTS
    files = [*LAYER_TESTS, 'tests/layer_cases.py']
    bare = []
    for name in files:
        tree = ast.parse(open(osp.join(ROOT, name)).read())
        bare += [f'{name}:{node.lineno}' for node in ast.walk(tree)
                 if isinstance(node, ast.Call)
                 and {k.arg for k in node.keywords} & {'generator', 'device'} == {'generator'}
                 and ast.unparse(node.func) != 'drawn']
    assert not bare, bare
