"""The package version and the Python / torch releases it supports, in one place.

``setup.py`` runs this file on its own (a build may run where torch is absent);
``mmseg_mesa/__init__.py`` calls :func:`check_supported_versions` before anything else.

Supported (and declared to pip) is torch >= the oldest tested release: ``.ci/run`` runs the core
tests on 2.13.0 in a second virtualenv, the pinned stack uses 2.14.1. At import, a torch the code
cannot run on is an ImportError naming the supported range, so it fails there rather than inside
a backward pass: the code needs torch >= 2.4 (``torch.get_autocast_dtype``,
``torch.is_autocast_enabled(device_type)``, ``torch.serialization.add_safe_globals``). A torch
between that and the tested releases, or newer than them, imports with an
``UnsupportedTorchWarning``: it may well work, but nothing here has run on it.
"""
from __future__ import annotations

import re
import sys
import warnings

__version__ = '0.1.0'

PYTHON_MIN = (3, 11)                  # tested: 3.11
TORCH_TESTED = ('2.13.0', '2.14.1')   # oldest (.ci/run's second venv) and newest (the pin)
TORCH_MIN = tuple(int(part) for part in TORCH_TESTED[0].split('.')[:2])  # (major, minor)
TORCH_RUNS = (2, 4)  # the APIs named above: older torch lacks them (layers would fail in use)

PYTHON_REQUIRES = f'>={PYTHON_MIN[0]}.{PYTHON_MIN[1]}'
TORCH_REQUIREMENT = f'torch>={TORCH_MIN[0]}.{TORCH_MIN[1]}'
SUPPORTED_TORCH = (f'torch >= {TORCH_MIN[0]}.{TORCH_MIN[1]} '
                   f'(tested: {", ".join(TORCH_TESTED)})')


class UnsupportedTorchWarning(UserWarning):
    """torch is outside the tested releases (but new enough for the code to run)."""


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
    """Raise ImportError for a torch that is missing or too old to run; warn for an untested one.

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
    if release < TORCH_RUNS:
        raise ImportError(f'mmseg_mesa needs {SUPPORTED_TORCH}, but torch {version} is '
                          f'installed, older than {TORCH_RUNS[0]}.{TORCH_RUNS[1]} (whose APIs it '
                          'uses); install a supported torch (and an mmcv built for it)')
    if release < TORCH_MIN:
        warnings.warn(f'mmseg_mesa supports {SUPPORTED_TORCH}; torch {version} is older and '
                      'untested', UnsupportedTorchWarning, stacklevel=3)
    elif release > torch_release(TORCH_TESTED[-1]):
        warnings.warn(f'mmseg_mesa supports {SUPPORTED_TORCH}; torch {version} is newer and '
                      'untested', UnsupportedTorchWarning, stacklevel=3)


def check_supported_versions() -> None:
    """Python and torch, as :mod:`mmseg_mesa` checks them at import."""
    check_python()
    check_torch()
