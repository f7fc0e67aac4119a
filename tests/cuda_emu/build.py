"""Builds ``csrc/mesa_kernels.cu`` with the emulator (``emu.h``) into a library of CPU ops,
``torch.ops.mesa_emu.*``, with g++ against torch's headers.

The kernels are compiled as they are: the only rewrites are each ``kernel<<<config>>>(args)``
into a call of the emulator's launch, and the device the host code checks its tensors against
(the emulated device's tensors are CPU tensors). The library is cached by the hash of every
input, so a test session builds it once, and concurrent test workers wait for one build.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / 'csrc'
KERNELS = CSRC / 'mesa_kernels.cu'
SOURCES = [KERNELS, HERE / 'faulty_kernels.cu', HERE / 'emu.cpp', HERE / 'ops.cpp']
# The flags of the CPU kernels' numerics (setup.py): no contraction, no fast math.
FLAGS = ['-std=c++20', '-O1', '-g0', '-ffp-contract=off', '-fno-fast-math', '-fPIC',
         '-Wall', '-Wno-unused-function', '-Wno-unknown-pragmas']
SANITIZE = ['-fsanitize=address,undefined', '-fno-sanitize-recover=undefined',
            '-fno-omit-frame-pointer']

LAUNCH = re.compile(r'\b([A-Za-z_]\w*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(\s*(\)?)', re.S)


def rewrite(source: str, path: Path) -> str:
    """``kernel<<<cfg>>>(args)`` -> ``::mesa_emu::launch("kernel", config(cfg), kernel, args)``,
    and the host checks' device type CUDA -> CPU; lines keep their numbers in ``path``."""
    def launch(match: re.Match) -> str:
        kernel, cfg, closed = match.group(1), match.group(2), match.group(3)
        head = f'::mesa_emu::launch("{kernel}", ::mesa_emu::config({cfg}), {kernel}'
        return head + (')' if closed else ', ')

    rewritten = LAUNCH.sub(launch, source)
    rewritten = re.sub(r'c10::DeviceType::CUDA\b', 'c10::DeviceType::CPU', rewritten)
    if '<<<' in rewritten:
        raise RuntimeError(f'{path.name}: a kernel launch the emulator build cannot rewrite')
    return f'#line 1 "{path.relative_to(HERE.parents[1])}"\n{rewritten}'


def cache_root() -> Path:
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return Path(base) / 'mmseg-mesa' / 'cuda_emu'


def _key(sanitize: bool) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCES + list((HERE / 'include').rglob('*.h')) + [HERE / 'emu.h',
                       Path(__file__)] + list(CSRC.glob('*.h'))):
        digest.update(str(path.relative_to(HERE.parents[1])).encode())
        digest.update(path.read_bytes())
    digest.update(repr((FLAGS, SANITIZE if sanitize else [], torch.__version__,
                        sys.version_info[:2])).encode())
    return digest.hexdigest()[:16]


def _compile_command(source: Path, obj: Path, sanitize: bool) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f'-I{HERE / "include"}', f'-I{HERE}', f'-I{CSRC}']
    includes += [f'-isystem{p}' for p in cpp_extension.include_paths()]
    includes.append(f'-isystem{sysconfig.get_paths()["include"]}')
    return ['g++', *FLAGS, *(SANITIZE if sanitize else []), f'-D_GLIBCXX_USE_CXX11_ABI={abi}',
            *includes, '-x', 'c++', '-c', str(source), '-o', str(obj)]


def build(sanitize: bool = False) -> Path:
    """The emulated library's path, built first if the cache has none for these inputs."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    name = f'{"asan-" if sanitize else ""}{_key(sanitize)}'
    library = root / name / 'libmesa_emu.so'
    with open(root / f'{name}.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        work = root / name
        work.mkdir(exist_ok=True)
        jobs = []
        for source in SOURCES:
            compiled = source
            if source.suffix == '.cu':
                compiled = work / f'{source.stem}.emu.cpp'
                compiled.write_text(rewrite(source.read_text(), source))
            jobs.append((compiled, work / f'{source.stem}.o'))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = list(pool.map(
                lambda job: subprocess.run(_compile_command(*job, sanitize), capture_output=True,
                                           text=True), jobs))
        for (source, _), result in zip(jobs, results):
            if result.returncode != 0:
                raise RuntimeError(f'emulated build of {source.name} failed:\n{result.stderr}')
        libs = [f'-L{p}' for p in cpp_extension.library_paths()]
        rpath = [f'-Wl,-rpath,{p}' for p in cpp_extension.library_paths()]
        partial = library.with_suffix('.partial')
        link = ['g++', '-shared', *(SANITIZE if sanitize else []), *(str(o) for _, o in jobs),
                *libs, *rpath, '-lc10', '-ltorch_cpu', '-ltorch', '-o', str(partial)]
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f'emulated build failed to link:\n{result.stderr}')
        os.replace(partial, library)
        return library


def load(sanitize: bool = False) -> object:
    """``torch.ops.mesa_emu``, built and loaded once per process."""
    if not hasattr(torch.ops, 'mesa_emu') or not hasattr(torch.ops.mesa_emu, 'observe'):
        torch.ops.load_library(str(build(sanitize)))
    return torch.ops.mesa_emu
