"""Install mmseg_mesa and build its optional extension ``mmseg_mesa._C``.

The extension holds the quantizer's CPU kernels, built with the host compiler whenever torch is
importable at build time, and its CUDA kernels, added when torch has CUDA support and a CUDA
toolkit is found (one source of arithmetic for both: ``csrc/mesa_numerics.h``).

    pip install --no-build-isolation -e .      # development (what `make env` does, with --no-deps)
    pip install --no-build-isolation .         # a regular install; `pip wheel` works the same way

The version and the supported Python / torch ranges come from ``mmseg_mesa/version.py`` (read, not
imported: torch may be absent here). ``configs/`` ships inside the package as
``mmseg_mesa/.mim/configs`` (mmseg's layout for installed configs). Under pip's build isolation
torch is not importable, so the package is built without the extension. A failed compile
installs the pure-Python package and records why (unless FORCE_CUDA=1).

Environment:
    MMSEG_MESA_NO_EXT=1   install the pure-Python package only.
    FORCE_CUDA=1          build the CUDA kernels or fail (default: only if a toolkit is found).
    CUDA_HOME             the toolkit to use (default: nvcc on PATH, then /usr/local/cuda*).
    TORCH_CUDA_ARCH_LIST  GPU architectures (default: the visible GPUs', else "9.0").
    MAX_JOBS              parallel compile jobs (torch's default: all cores).

Whatever happens, ``mmseg_mesa/_build_info.py`` records it (torch version, whether the CPU and
the CUDA kernels were built, archs, or why not); ``python -m mmseg_mesa.info`` and the runtime
dispatcher read it.
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
CPU_SOURCES = ['csrc/mesa_ops.cpp', 'csrc/mesa_cpu.cpp']
CUDA_SOURCES = ['csrc/mesa_kernels.cu']
# No contraction into fused multiply-adds and no fast-math: the kernels must match the
# pure-PyTorch reference bit for bit (csrc/mesa_numerics.h).
CXX_FLAGS = ['-O3', '-std=c++20', '-ffp-contract=off', '-fno-fast-math']
# at::parallel_for splits work over torch's threads only in code compiled with OpenMP when torch's
# parallel backend is OpenMP (ATen/ParallelOpenMP.h is inline); without the flag the CPU kernels
# would run on one thread. The extension then uses torch's own libgomp (same soname).
OPENMP_FLAGS = ['-fopenmp']
NVCC_FLAGS = ['-O3', '-std=c++20', '--prec-div=true', '--fmad=false', '--ftz=false']
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


def recorded_failure(build_info: str, error: BaseException) -> str:
    """``build_info`` rewritten for a package installed without its extension after ``error``."""
    fields = runpy_text(build_info)
    fields.update(EXTENSION=False, CPU_KERNELS=False, CPU_OPENMP=False, CUDA_KERNELS=False,
                  SKIP_REASON=f'not built: compiling it failed ({type(error).__name__}: '
                              f'{str(error).strip().splitlines()[-1] if str(error) else ""}); '
                              'see the install log')
    return build_info_text(**fields)


def runpy_text(text: str) -> dict:
    namespace: dict = {}
    exec(compile(text, '_build_info.py', 'exec'), namespace)  # noqa: S102 (our own file)
    return {k: v for k, v in namespace.items() if k.isupper()}


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


def openmp_flags(torch) -> list[str]:
    """``OPENMP_FLAGS`` where torch's intra-op threads are OpenMP's and the compiler is GCC-like
    on Linux; else none (torch's native backend needs no flag)."""
    openmp = 'parallel backend: OpenMP' in torch.__config__.parallel_info()
    return OPENMP_FLAGS if openmp and sys.platform.startswith('linux') else []


def build_info_text(**fields) -> str:
    lines = ['"""Written by setup.py when the package is installed; do not edit."""']
    lines += [f'{key} = {value!r}' for key, value in fields.items()]
    return '\n'.join(lines) + '\n'


def skip_extension(reason: str, **info) -> tuple[dict, str]:
    """Install the pure-Python package, recording why (or fail if FORCE_CUDA=1)."""
    if os.environ.get('FORCE_CUDA', '0') == '1':
        raise RuntimeError(f'FORCE_CUDA=1 but the CUDA extension cannot be built ({reason})')
    print(f'mmseg_mesa: extension {reason}', file=sys.stderr)
    return {}, build_info_text(**dict(info, SKIP_REASON=reason))


def build_extension_class(base):
    """``base`` (torch's BuildExtension) made optional: a failed compile leaves the package
    pure Python, with the failure in ``_build_info.py``, unless FORCE_CUDA=1."""

    class OptionalBuildExtension(base):
        def run(self) -> None:
            try:
                super().run()
            except Exception as error:  # compiler, ninja or linker failure
                if os.environ.get('FORCE_CUDA', '0') == '1':
                    raise
                print(f'mmseg_mesa: building the extension failed ({error}); installing the '
                      'pure-Python package', file=sys.stderr)
                text = recorded_failure(BuildPy.build_info, error)
                BuildPy.build_info = text
                if self.inplace or getattr(self, 'editable_mode', False):
                    write_if_changed(BUILD_INFO, text)
                else:
                    write_if_changed(Path(self.build_lib) / BUILD_INFO.relative_to(ROOT), text)

    return OptionalBuildExtension


def extension_setup() -> tuple[dict, str]:
    """setup() arguments for the extension (or {}) and the ``_build_info.py`` that records it.

    The CPU kernels are built whenever torch is importable; the CUDA kernels join them in one
    CUDAExtension when torch has CUDA support and a toolkit is found.
    """
    info = dict(TORCH_VERSION=None, TORCH_CUDA_VERSION=None, EXTENSION=False,
                CPU_KERNELS=False, CPU_OPENMP=False, CUDA_KERNELS=False, CUDA_ARCH_LIST=None,
                CUDA_HOME=None, CUDA_SKIP_REASON=None)
    if os.environ.get('MMSEG_MESA_NO_EXT', '0') == '1':
        return skip_extension('not built: MMSEG_MESA_NO_EXT=1 was set at install time', **info)
    try:
        import torch
    except ImportError:  # pip's build isolation hides the environment's torch
        return skip_extension('not built: torch was not importable at install time (install '
                              'with --no-build-isolation)', **info)
    info.update(TORCH_VERSION=torch.__version__, TORCH_CUDA_VERSION=torch.version.cuda)
    cuda_home = find_cuda_home() if torch.version.cuda is not None else None
    if torch.version.cuda is None:
        cuda_reason = f'not built: torch {torch.__version__} has no CUDA support'
    elif cuda_home is None:
        cuda_reason = ('not built: no CUDA toolkit (nvcc) was found at install time; set '
                       'CUDA_HOME and reinstall')
    else:
        cuda_reason = None
    if cuda_reason is not None and os.environ.get('FORCE_CUDA', '0') == '1':
        raise RuntimeError(f'FORCE_CUDA=1 but the CUDA kernels cannot be built ({cuda_reason})')

    # ninja (faster, parallel) is found on PATH; pip does not put the venv's bin there.
    os.environ['PATH'] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', '')
    include_dirs = [str(ROOT / 'csrc')]
    openmp = openmp_flags(torch)
    cxx_flags = CXX_FLAGS + openmp
    if cuda_reason is None:
        # torch.utils.cpp_extension reads these when it is imported.
        os.environ['CUDA_HOME'] = cuda_home
        archs = cuda_arch_list(torch)
        os.environ['TORCH_CUDA_ARCH_LIST'] = archs
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
        torch_dir = Path(torch.__file__).resolve().parent
        extension = CUDAExtension(
            name='mmseg_mesa._C',
            sources=CPU_SOURCES + CUDA_SOURCES,
            include_dirs=include_dirs + extra_cuda_includes(cuda_home, torch_dir),
            define_macros=[('MMSEG_MESA_WITH_CUDA', '1')],
            extra_compile_args={'cxx': cxx_flags, 'nvcc': NVCC_FLAGS},
            extra_link_args=openmp,
        )
        info.update(CUDA_KERNELS=True, CUDA_ARCH_LIST=archs, CUDA_HOME=cuda_home)
    else:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
        print(f'mmseg_mesa: CUDA kernels {cuda_reason}; building the CPU kernels only',
              file=sys.stderr)
        extension = CppExtension(name='mmseg_mesa._C', sources=CPU_SOURCES,
                                 include_dirs=include_dirs,
                                 extra_compile_args={'cxx': cxx_flags},
                                 extra_link_args=openmp)
        info.update(CUDA_SKIP_REASON=cuda_reason)
    build_ext = build_extension_class(BuildExtension.with_options(use_ninja=True))
    return (dict(ext_modules=[extension], cmdclass={'build_ext': build_ext}),
            build_info_text(**dict(info, EXTENSION=True, CPU_KERNELS=True, CPU_OPENMP=bool(openmp),
                                   SKIP_REASON=None)))


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
