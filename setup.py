"""Install mmseg_mesa; build its optional CUDA extension ``mmseg_mesa._C`` when a toolkit is found.

    pip install --no-build-isolation --no-deps -e .

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
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
BUILD_INFO = ROOT / 'mmseg_mesa' / '_build_info.py'
SOURCES = ['csrc/mesa_ops.cpp', 'csrc/mesa_kernels.cu']
DEFAULT_ARCHS = '9.0'


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


def write_build_info(**fields) -> None:
    lines = ['"""Written by setup.py when the package is installed; do not edit."""']
    lines += [f'{key} = {value!r}' for key, value in fields.items()]
    text = '\n'.join(lines) + '\n'
    if not BUILD_INFO.exists() or BUILD_INFO.read_text() != text:
        BUILD_INFO.write_text(text)


def skip_extension(reason: str, **info) -> dict:
    """Install the pure-Python package, recording why (or fail if FORCE_CUDA=1)."""
    if os.environ.get('FORCE_CUDA', '0') == '1':
        raise RuntimeError(f'FORCE_CUDA=1 but the CUDA extension cannot be built ({reason})')
    write_build_info(**dict(info, SKIP_REASON=reason))
    print(f'mmseg_mesa: CUDA extension {reason}', file=sys.stderr)
    return {}


def extension_setup() -> dict:
    """setup() arguments for the extension, or {} with the reason recorded."""
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
    write_build_info(**dict(info, EXTENSION=True, CUDA_ARCH_LIST=archs, CUDA_HOME=cuda_home,
                            SKIP_REASON=None))
    return dict(ext_modules=[extension],
                cmdclass={'build_ext': BuildExtension.with_options(use_ninja=True)})


setup(
    name='mmseg_mesa',
    version='0.1.0',
    description='Mesa memory-saving training (8-bit saved activations) for mmsegmentation',
    packages=find_packages(include=['mmseg_mesa', 'mmseg_mesa.*']),
    **extension_setup(),
)
