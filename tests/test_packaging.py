"""The package as a user installs it: the supported versions, enforced at import, and the wheel.

The wheel is built (without the CUDA extension) from a copy of the source tree, so that building
it here never rewrites the source tree's ``_build_info.py`` or ``build/``. It is installed into a
fresh virtualenv that sees this environment's packages (the pinned stack) through a ``.pth`` file,
with no package index: pip must find every declared dependency satisfied by the pinned stack.
"""
from __future__ import annotations

import email
import os
import os.path as osp
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import mmseg_mesa
from mmseg_mesa import version

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ['setup.py', 'pyproject.toml', 'MANIFEST.in', 'README.md', 'csrc', 'configs',
           'mmseg_mesa']
SWIN_T = 'swin/mesa_swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
NO_EXT = dict(os.environ, MMSEG_MESA_NO_EXT='1', OMP_NUM_THREADS='1')
SENTINEL = '# the source tree\'s build info; building a wheel must leave it alone\n'


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=NO_EXT, capture_output=True,
                          text=True, timeout=300)


def check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope='module')
def source(tmp_path_factory) -> Path:
    """What setup.py builds from, without build outputs (.so, _build_info.py, caches)."""
    src = tmp_path_factory.mktemp('src')
    ignore = shutil.ignore_patterns('__pycache__', '*.so', '_build_info.py', '.mim')
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    (src / 'mmseg_mesa' / '_build_info.py').write_text(SENTINEL)
    return src


@pytest.fixture(scope='module')
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp('wheel')
    check(run(sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation',
              '--no-index', '-w', out, source))
    (built,) = out.glob('mmseg_mesa-*.whl')
    return built


@pytest.fixture(scope='module')
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv (no site packages of its own) with the wheel installed, which sees
    this environment's packages through a .pth file."""
    env = tmp_path_factory.mktemp('venv')
    check(run(sys.executable, '-m', 'venv', '--without-pip', env))
    python = env / 'bin' / 'python'
    site = check(run(python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'))
    stack = {sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']}
    (Path(site.strip()) / 'pinned_stack.pth').write_text('\n'.join(sorted(stack)) + '\n')
    # --ignore-installed: this environment's own (editable) mmseg_mesa is not pip's to replace.
    check(run(python, '-m', 'pip', 'install', '--no-index', '--no-deps', '--ignore-installed',
              wheel))
    return env


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith('.dist-info/METADATA'))
        return email.message_from_bytes(archive.read(name))


# --- the supported range -----------------------------------------------------------------

def test_version_lives_in_version_py():
    assert mmseg_mesa.__version__ is version.__version__
    assert re.fullmatch(r'\d+\.\d+\.\d+', version.__version__)


def test_tested_releases_are_the_pin_and_the_ci_run():
    oldest, newest = version.TORCH_TESTED
    core = (ROOT / 'requirements' / 'core.txt').read_text()
    assert re.search(rf'^torch=={re.escape(newest)}$', core, re.M), 'the pin is the newest tested'
    assert version.TORCH_MIN == version.torch_release(oldest)
    assert 'TORCH_TESTED' in (ROOT / '.ci' / 'run').read_text(), '.ci/run tests the oldest'
    assert version.TORCH_REQUIREMENT == f'torch>={version.TORCH_MIN[0]}.{version.TORCH_MIN[1]}'


def test_running_torch_is_supported_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        version.check_supported_versions()
    assert version.torch_release(torch.__version__) >= version.TORCH_MIN


@pytest.mark.parametrize('found, release', [
    ('2.14.1+cu130', (2, 14)), ('2.13.0+cpu', (2, 13)), ('2.15.0a0+git1234', (2, 15)),
    ('10.0.0', (10, 0))])
def test_torch_release(found, release):
    assert version.torch_release(found) == release


@pytest.mark.parametrize('old', ['2.3.1', '2.1.2+cu121', '2.0.0', '1.13.1'])
def test_torch_too_old_to_run_fails_naming_the_supported_range(old, monkeypatch):
    monkeypatch.setattr(torch, '__version__', old)
    with pytest.raises(ImportError) as error:
        version.check_torch()
    assert f'torch {old} is installed, older than 2.4' in str(error.value)
    assert version.SUPPORTED_TORCH in str(error.value)
    assert 'torch >= 2.13 (tested: 2.13.0, 2.14.1)' in str(error.value)


@pytest.mark.parametrize('untested, word', [('2.4.0', 'older'), ('2.12.1', 'older'),
                                            ('2.15.0', 'newer'), ('3.0.0', 'newer')])
def test_untested_torch_warns(untested, word):
    with pytest.warns(version.UnsupportedTorchWarning,
                      match=re.escape(f'supports {version.SUPPORTED_TORCH}; torch {untested} '
                                      f'is {word} and untested')):
        version.check_torch(untested)


def test_missing_torch_names_the_supported_range(monkeypatch):
    monkeypatch.setitem(sys.modules, 'torch', None)  # `import torch` now raises ImportError
    with pytest.raises(ImportError, match=re.escape(f'needs {version.SUPPORTED_TORCH}, but '
                                                    'torch is not installed')):
        version.check_torch()


def test_unreadable_torch_version_is_an_error():
    with pytest.raises(ImportError, match="cannot read the torch version 'nightly'"):
        version.check_torch('nightly')


def test_old_python_is_refused():
    with pytest.raises(ImportError, match=r'needs Python >=3\.11, but this is Python 3\.10\.12'):
        version.check_python((3, 10, 12, 'final', 0))
    version.check_python((3, 11, 0, 'final', 0))


# --- the wheel and an install from it ----------------------------------------------------

@pytest.mark.slow
def test_wheel_ships_the_package_and_the_configs(wheel, source):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    modules = {p.relative_to(source).as_posix() for p in (source / 'mmseg_mesa').rglob('*.py')}
    assert modules <= names
    configs = {f'mmseg_mesa/.mim/configs/{p.relative_to(source / "configs").as_posix()}'
               for p in (source / 'configs').rglob('*.py')}
    assert 'mmseg_mesa/.mim/configs/_base_/mesa.py' in configs
    assert f'mmseg_mesa/.mim/configs/{SWIN_T}' in configs
    assert configs <= names
    assert (source / 'mmseg_mesa' / '_build_info.py').read_text() == SENTINEL
    assert not (source / 'mmseg_mesa' / '.mim').exists()


@pytest.mark.slow
def test_wheel_metadata(wheel):
    meta = metadata(wheel)
    assert meta['Version'] == version.__version__
    assert meta['Requires-Python'] == version.PYTHON_REQUIRES
    requires = meta.get_all('Requires-Dist')
    for requirement in (version.TORCH_REQUIREMENT, 'mmcv<2.2.0,>=2.0.0rc4',
                        'mmsegmentation<1.3.0,>=1.2.2', 'mmengine<1.0.0,>=0.10.7'):
        assert requirement in requires
    assert 'pytest; extra == "test"' in requires
    assert meta.get_payload().startswith('# mmseg-mesa')  # the README


@pytest.mark.slow
def test_declared_dependencies_are_met_by_the_pinned_stack(venv, source):
    """No index: pip must find torch, mmengine, mmcv, mmsegmentation, ... already installed."""
    python = venv / 'bin' / 'python'
    out = check(run(python, '-m', 'pip', 'install', '--dry-run', '--no-index',
                    '--no-build-isolation', source))
    assert 'Would install mmseg_mesa' in out or 'Would install mmseg-mesa' in out, out


@pytest.mark.slow
def test_installed_package_imports_and_loads_its_configs(venv, tmp_path):
    python = venv / 'bin' / 'python'
    script = f'''
import os.path as osp, mmseg_mesa
from mmseg_mesa import _build_info
from mmengine.config import Config
root = osp.dirname(mmseg_mesa.__file__)
cfg = Config.fromfile(osp.join(root, '.mim', 'configs', {SWIN_T!r}))
print(root)
print(mmseg_mesa.__version__, _build_info.SKIP_REASON)
print(cfg.model.backbone.type, cfg.custom_hooks[0].type, cfg.mesa.bits, cfg.custom_imports)
'''
    root, versions, cfg = check(run(python, '-c', script, cwd=tmp_path)).splitlines()
    assert Path(root).is_relative_to(venv)
    assert versions == f'{version.__version__} not built: MMSEG_MESA_NO_EXT=1 was set at ' \
                       'install time'
    assert cfg.startswith("SwinTransformer MesaHook 8 {'imports': ['mmseg_mesa.integrations']")


@pytest.mark.slow
def test_installed_package_refuses_an_old_torch_at_import(venv, tmp_path):
    python = venv / 'bin' / 'python'
    result = run(python, '-c', "import torch; torch.__version__ = '2.1.2'; import mmseg_mesa",
                 cwd=tmp_path)
    assert result.returncode != 0
    assert (f'ImportError: mmseg_mesa needs {version.SUPPORTED_TORCH}, but torch 2.1.2 is '
            'installed, older than 2.4') in result.stderr
    assert osp.join(str(venv), 'lib') in result.stderr  # the installed copy raised it
