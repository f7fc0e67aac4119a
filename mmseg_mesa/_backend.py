"""Chooses between the compiled kernels (CPU and CUDA) and the pure-PyTorch reference.

``'auto'`` runs the compiled kernels of the tensor's device (the CPU kernels for CPU tensors,
the CUDA kernels for CUDA tensors), ``'cuda'`` requires CUDA tensors and the CUDA kernels,
``'torch'`` always runs the reference; all three give the same codes. The extension is
optional: when it is missing or unusable, ``'auto'`` uses the torch path and one warning says
why; ``'cuda'`` then raises, because the user asked for the kernels explicitly.
Before loading ``mmseg_mesa._C`` we compare what ``setup.py`` recorded in ``_build_info.py`` with
the running torch: an extension built for another torch may fail to import or, worse, crash.
"""
from __future__ import annotations

import re
import warnings
from types import ModuleType

import torch

REINSTALL = 'reinstall with `pip install --no-build-isolation --no-deps -e .`'

_EXT: ModuleType | None = None
_EXT_ERROR: str | None = None
_LOADED = False
_WARNED = False
_DEVICE_ERRORS: dict[int, str | None] = {}


def build_info() -> ModuleType | None:
    """What ``setup.py`` recorded at install time, or None when the package was never built."""
    try:
        from . import _build_info  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _build_info


def _unusable_reason() -> str | None:
    info = build_info()
    if info is None:
        return f'not built: mmseg_mesa/_build_info.py is missing (never installed); {REINSTALL}'
    if not info.EXTENSION:
        return info.SKIP_REASON
    if info.TORCH_VERSION != torch.__version__:
        return (f'built for torch {info.TORCH_VERSION}, but torch {torch.__version__} is '
                f'running; {REINSTALL}')
    return None


def load_extension() -> tuple[ModuleType | None, str | None]:
    """Load the kernels once; return (``mmseg_mesa.kernels`` or None, why they are unavailable)."""
    global _EXT, _EXT_ERROR, _LOADED
    if not _LOADED:
        _LOADED = True
        _EXT_ERROR = _unusable_reason()
        if _EXT_ERROR is None:
            try:
                from . import kernels
            except (ImportError, OSError, AttributeError) as err:  # missing .so, symbols, ...
                _EXT_ERROR = f'mmseg_mesa._C failed to load ({type(err).__name__}: {err})'
            else:
                if kernels.TORCH_VERSION != torch.__version__.split('+')[0]:
                    _EXT_ERROR = (f'mmseg_mesa._C was compiled against torch headers '
                                  f'{kernels.TORCH_VERSION}, but torch {torch.__version__} is '
                                  f'running; {REINSTALL}')
                else:
                    _EXT = kernels
    return _EXT, _EXT_ERROR


def _parse_arch(entry: str) -> tuple[int, int, bool, bool] | None:
    match = re.fullmatch(r'(\d+)\.(\d+)(a?)(\+PTX)?', entry.strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), bool(match[3]), bool(match[4])


def arch_covers(arch_list: str, capability: tuple[int, int]) -> bool | None:
    """Whether kernels built for ``arch_list`` (TORCH_CUDA_ARCH_LIST syntax) run on a GPU of
    ``capability``: a cubin of the same major and an older or equal minor, or older PTX. None
    when the list cannot be parsed (named architectures): then we do not block anything."""
    entries = [_parse_arch(e) for e in re.split(r'[;\s]+', arch_list.strip()) if e]
    if not entries or None in entries:
        return None
    for major, minor, specific, ptx in entries:
        if specific and (major, minor) != capability:
            continue
        if (major == capability[0] and minor <= capability[1]) or \
                (ptx and (major, minor) <= capability):
            return True
    return False


def device_error(device: torch.device) -> str | None:
    """Why the loaded kernels cannot run on ``device`` (an architecture they were not built
    for), or None."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_ERRORS:
        info = build_info()
        capability = torch.cuda.get_device_capability(index)
        archs = info.CUDA_ARCH_LIST if info is not None else None
        covered = arch_covers(archs, capability) if archs else None
        _DEVICE_ERRORS[index] = None if covered is not False else (
            f'mmseg_mesa._C was built for TORCH_CUDA_ARCH_LIST={archs!r}, which does not cover '
            f'cuda:{index} (sm_{capability[0]}{capability[1]}); set TORCH_CUDA_ARCH_LIST and '
            f'{REINSTALL}')
    return _DEVICE_ERRORS[index]


def cuda_kernels_error(ext: ModuleType, device: torch.device) -> str | None:
    """Why the loaded extension cannot run CUDA tensors on ``device``, or None."""
    if not ext.CUDA_KERNELS:
        info = build_info()
        reason = getattr(info, 'CUDA_SKIP_REASON', None) or 'not built'
        return f'mmseg_mesa._C has no CUDA kernels ({reason})'
    return device_error(device)


def kernels_for(x: torch.Tensor, backend: str) -> ModuleType | None:
    """The kernel module to use for ``x`` under ``backend``, or None for the torch reference."""
    global _WARNED
    if backend == 'torch':
        return None
    if x.is_cpu and backend == 'auto':  # the usual case, first: every pack and unpack asks
        ext = load_extension()[0]
        if ext is not None:
            return ext
    if not x.is_cuda:
        if backend == 'cuda':
            raise RuntimeError("mesa backend='cuda' needs CUDA tensors; got a tensor on "
                               f'{x.device}')
        if x.device.type != 'cpu':  # meta, mps, ...: no kernels, the reference runs
            return None
    ext, error = load_extension()
    if ext is not None:
        error = cuda_kernels_error(ext, x.device) if x.is_cuda else None
    if error is None:
        return ext
    if backend == 'cuda':
        raise RuntimeError(f"mesa backend='cuda' but the CUDA extension is unavailable ({error})")
    if not _WARNED:
        _WARNED = True
        kind = 'CUDA kernels' if x.is_cuda else 'compiled extension'
        warnings.warn(f'mmseg_mesa: {kind} unavailable ({error}); using the slower '
                      'pure-PyTorch quantizer. Run `python -m mmseg_mesa.info` for details.',
                      stacklevel=3)
    return None
