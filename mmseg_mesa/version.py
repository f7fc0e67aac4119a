"""The package version and the Python / torch releases it supports, in one place.

``setup.py`` runs this file on its own (a build may run where torch is absent);
``mmseg_mesa/__init__.py`` calls :func:`check_supported_versions` before anything else, so an
unsupported torch fails at ``import mmseg_mesa`` naming the range, not later inside a backward
pass. The code itself needs torch >= 2.4 (``torch.get_autocast_dtype``,
``torch.is_autocast_enabled(device_type)``, ``torch.serialization.add_safe_globals``); the
minimum is the oldest release that is tested: ``.ci/run`` runs the core tests on 2.13.0 in a
second virtualenv, the pinned stack uses 2.14.1. Releases newer than the tested ones import with
a warning: nothing here has run on them.
"""
from __future__ import annotations

import re
import sys
import warnings

__version__ = '0.1.0'

PYTHON_MIN = (3, 11)                  # tested: 3.11
TORCH_TESTED = ('2.13.0', '2.14.1')   # oldest (.ci/run's second venv) and newest (the pin)
TORCH_MIN = tuple(int(part) for part in TORCH_TESTED[0].split('.')[:2])  # (major, minor)

PYTHON_REQUIRES = f'>={PYTHON_MIN[0]}.{PYTHON_MIN[1]}'
TORCH_REQUIREMENT = f'torch>={TORCH_MIN[0]}.{TORCH_MIN[1]}'
SUPPORTED_TORCH = (f'torch >= {TORCH_MIN[0]}.{TORCH_MIN[1]} '
                   f'(tested: {", ".join(TORCH_TESTED)})')


class UnsupportedTorchWarning(UserWarning):
    """torch is newer than every release mmseg_mesa was tested on."""


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``'2.14.1+cu128'`` or ``'2.15.0a0'``."""
    match = re.match(r'(\d+)\.(\d+)', version)
    if match is None:
        raise ImportError(f'mmseg_mesa cannot read the torch version {version!r}; it needs '
                          f'{SUPPORTED_TORCH}')
    return int(match.group(1)), int(match.group(2))


def check_python(version_info: tuple[int, ...] = tuple(sys.version_info)) -> None:
    if tuple(version_info[:2]) < PYTHON_MIN:
        found = '.'.join(str(v) for v in version_info[:3])
        raise ImportError(f'mmseg_mesa needs Python {PYTHON_REQUIRES}, but this is Python {found}')


def check_torch(version: str | None = None) -> None:
    """Raise ImportError for a torch older than the supported range; warn for an untested newer one.

    Args:
        version: the torch version to check. Defaults to the installed ``torch.__version__``.
    """
    if version is None:
        try:
            import torch
        except ImportError as error:
            raise ImportError(f'mmseg_mesa needs {SUPPORTED_TORCH}, but torch is not '
                              f'installed ({error})') from error
        version = str(torch.__version__)
    release = torch_release(version)
    if release < TORCH_MIN:
        raise ImportError(f'mmseg_mesa needs {SUPPORTED_TORCH}, but torch {version} is '
                          'installed; install a supported torch (and an mmcv built for it)')
    if release > torch_release(TORCH_TESTED[-1]):
        warnings.warn(f'mmseg_mesa was tested on {SUPPORTED_TORCH}; torch {version} is newer '
                      'and untested', UnsupportedTorchWarning, stacklevel=3)


def check_supported_versions() -> None:
    """Python and torch, as :mod:`mmseg_mesa` checks them at import."""
    check_python()
    check_torch()
