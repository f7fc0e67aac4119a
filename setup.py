"""Install mmseg_mesa; build its optional CUDA extension ``mmseg_mesa._C`` when a toolkit is found.

    pip install --no-build-isolation -e .      # development (what `make env` does, with --no-deps)
    pip install --no-build-isolation .         # a regular install; `pip wheel` works the same way

The version and the supported Python / torch ranges come from ``mmseg_mesa/version.py`` (read, not
imported: torch may be absent here). ``configs/`` ships inside the package as
``mmseg_mesa/.mim/configs`` (mmseg's layout for installed configs). Under pip's build isolation
torch is not importable, so the package is built without the extension.

Environment:
    MMSEG_MESA_NO_EXT=1   install the pure-Python package only.
    FORCE_CUDA=1          build the extension or fail (default: build only if a toolkit is found).
    CUDA_HOME             the toolkit to use (default: nvcc on PATH, then /usr/local/cuda*).
    TORCH_CUDA_ARCH_LIST  GPU architectures (default: the visible GPUs', else "9.0").
    MAX_JOBS              parallel compile jobs (torch's default: all cores).

Whatever happens, ``mmseg_mesa/_build_info.py`` records it (torch version, archs, or why the
extension was not built); ``python -m mmseg_mesa.info`` and the runtime dispatcher read it.
"""
from __future__ import annotations

import glob
import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUILD_INFO = ROOT / 'mmseg_mesa' / '_build_info.py'
SOURCES = ['csrc/mesa_ops.cpp', 'csrc/mesa_kernels.cu']
DEFAULT_ARCHS = '9.0'
CONFIGS = ROOT / 'configs'
MIM_CONFIGS = Path('mmseg_mesa') / '.mim' / 'configs'


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def version_fields() -> dict:
    """mmseg_mesa/version.py's names (``__version__``, the supported ranges), without importing
    the package: its ``__init__`` needs torch, which a build may not have."""
    return runpy.run_path(str(ROOT / 'mmseg_mesa' / 'version.py'))


class BuildPy(build_py):
    """Writes ``_build_info.py`` and ships ``configs/`` as ``mmseg_mesa/.mim/configs``.

    An editable install imports the source tree, so its build info goes there; a wheel gets its
    own, and building one leaves the source tree's (an editable install's) untouched.
    """

    build_info = ''  # set below, once extension_setup() has decided

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            write_if_changed(BUILD_INFO, self.build_info)
            return
        write_if_changed(Path(self.build_lib) / BUILD_INFO.relative_to(ROOT), self.build_info)
        sources = sorted(CONFIGS.rglob('*.py'))
        if not sources:  # an sdist made without MANIFEST.in's `graft configs`
            raise RuntimeError(f'no configs found in {CONFIGS}: the package would ship none')
        for source in sources:
            target = Path(self.build_lib) / MIM_CONFIGS / source.relative_to(CONFIGS)
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))


def is_toolkit(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, 'bin', 'nvcc')) and \
        os.path.isfile(os.path.join(path, 'include', 'cuda_runtime.h'))


def find_cuda_home() -> str | None:
    """A CUDA toolkit directory (bin/nvcc + include/cuda_runtime.h), or None."""
    explicit = os.environ.get('CUDA_HOME') or os.environ.get('CUDA_PATH')
    if explicit:
        return explicit if is_toolkit(explicit) else None
    candidates = []
    nvcc = shutil.which('nvcc')
    if nvcc:  # /usr/local/bin/nvcc may be a wrapper script, so its parent is only a guess
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append('/usr/local/cuda')
    candidates += sorted(glob.glob('/usr/local/cuda-*'), reverse=True)
    return next((c for c in candidates if is_toolkit(c)), None)


def extra_cuda_includes(cuda_home: str, torch_dir: Path) -> list[str]:
    """Headers torch's CUDA headers need (cusparse.h, ...) that a minimal toolkit lacks.

    pip-installed torch ships them in site-packages/nvidia/<name>/include.
    """
    if os.path.isfile(os.path.join(cuda_home, 'include', 'cusparse.h')):
        return []
    found = glob.glob(str(torch_dir.parent / 'nvidia' / '*' / 'include' / 'cusparse.h'))
    return sorted({os.path.dirname(p) for p in found})


def cuda_arch_list(torch) -> str:
    """Mirror torch's choice (visible GPUs, newest with PTX) but default to 9.0 without a GPU."""
    archs = os.environ.get('TORCH_CUDA_ARCH_LIST', '').strip()
    if archs and archs != 'native':
        return archs
    if torch.cuda.is_available():
        found = sorted({torch.cuda.get_device_capability(i)
                        for i in range(torch.cuda.device_count())})
        names = [f'{major}.{minor}' for major, minor in found]
        names[-1] += '+PTX'
        return ';'.join(names)
    return DEFAULT_ARCHS


def build_info_text(**fields) -> str:
    lines = ['"""Written by setup.py when the package is installed; do not edit."""']
    lines += [f'{key} = {value!r}' for key, value in fields.items()]
    return '\n'.join(lines) + '\n'


def skip_extension(reason: str, **info) -> tuple[dict, str]:
    """Install the pure-Python package, recording why (or fail if FORCE_CUDA=1)."""
    if os.environ.get('FORCE_CUDA', '0') == '1':
        raise RuntimeError(f'FORCE_CUDA=1 but the CUDA extension cannot be built ({reason})')
    print(f'mmseg_mesa: CUDA extension {reason}', file=sys.stderr)
    return {}, build_info_text(**dict(info, SKIP_REASON=reason))


def extension_setup() -> tuple[dict, str]:
    """setup() arguments for the extension (or {}) and the ``_build_info.py`` that records it."""
    info = dict(TORCH_VERSION=None, TORCH_CUDA_VERSION=None, EXTENSION=False,
                CUDA_ARCH_LIST=None, CUDA_HOME=None)
    if os.environ.get('MMSEG_MESA_NO_EXT', '0') == '1':
        return skip_extension('not built: MMSEG_MESA_NO_EXT=1 was set at install time', **info)
    try:
        import torch
    except ImportError:  # pip's build isolation hides the environment's torch
        return skip_extension('not built: torch was not importable at install time (install '
                              'with --no-build-isolation)', **info)
    info.update(TORCH_VERSION=torch.__version__, TORCH_CUDA_VERSION=torch.version.cuda)
    if torch.version.cuda is None:
        return skip_extension(f'not built: torch {torch.__version__} has no CUDA support',
                              **info)
    cuda_home = find_cuda_home()
    if cuda_home is None:
        return skip_extension('not built: no CUDA toolkit (nvcc) was found at install time; '
                              'set CUDA_HOME and reinstall', **info)

    # torch.utils.cpp_extension reads these when it is imported.
    os.environ['CUDA_HOME'] = cuda_home
    archs = cuda_arch_list(torch)
    os.environ['TORCH_CUDA_ARCH_LIST'] = archs
    # ninja (faster, parallel) is found on PATH; pip does not put the venv's bin there.
    os.environ['PATH'] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', '')
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    torch_dir = Path(torch.__file__).resolve().parent
    extension = CUDAExtension(
        name='mmseg_mesa._C',
        sources=SOURCES,
        include_dirs=[str(ROOT / 'csrc')] + extra_cuda_includes(cuda_home, torch_dir),
        extra_compile_args={
            'cxx': ['-O3', '-std=c++20'],
            # IEEE division and no multiply-add contraction: the kernels must match the
            # pure-PyTorch reference bit for bit (see csrc/mesa_kernels.cu).
            'nvcc': ['-O3', '-std=c++20', '--prec-div=true', '--fmad=false', '--ftz=false'],
        },
    )
    return (dict(ext_modules=[extension],
                 cmdclass={'build_ext': BuildExtension.with_options(use_ninja=True)}),
            build_info_text(**dict(info, EXTENSION=True, CUDA_ARCH_LIST=archs,
                                   CUDA_HOME=cuda_home, SKIP_REASON=None)))


VERSION = version_fields()
# The stack mmseg-mesa is tested on is pinned in requirements/; these ranges are what it supports.
# mmcv is mmsegmentation 1.2's own range (it refuses other versions at import); mmengine 0.10.7's
# checkpoint types are what mmseg_mesa.integrations.checkpoint allow-lists.
INSTALL_REQUIRES = [
    VERSION['TORCH_REQUIREMENT'],
    'mmengine>=0.10.7,<1.0.0',
    'mmcv>=2.0.0rc4,<2.2.0',
    'mmsegmentation>=1.2.2,<1.3.0',
    'ftfy',   # mmseg imports them (its text encoder) but does not declare them
    'regex',
]
EXTRAS_REQUIRE = {
    'test': ['pytest'],
    'dev': ['pytest', 'ruff', 'matplotlib'],  # matplotlib: tools/demo.py and benchmark plots
}

extension, BuildPy.build_info = extension_setup()
setup(
    name='mmseg_mesa',
    version=VERSION['__version__'],
    description='Mesa memory-saving training (8-bit saved activations) for mmsegmentation',
    long_description=(ROOT / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    python_requires=VERSION['PYTHON_REQUIRES'],
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    packages=find_packages(include=['mmseg_mesa', 'mmseg_mesa.*']),
    ext_modules=extension.get('ext_modules', []),
    cmdclass=dict(extension.get('cmdclass', {}), build_py=BuildPy),
    zip_safe=False,
)
