"""Which implementation runs the quantizer: the compiled kernels or the pure-PyTorch reference.

Three backends satisfy ``QuantBackend``, one signature per operation: ``kernels.CPU`` and
``kernels.CUDA`` (the compiled extension ``mmseg_mesa._C``) and ``reference.REFERENCE``. Each
declares the device types it runs and says why it cannot run a given device;
``select_backend`` is the one place that picks among them. ``'auto'`` runs the compiled
kernels of the tensor's device, ``'cuda'`` requires CUDA tensors and the CUDA kernels,
``'torch'`` always runs the reference; all three give the same codes. The extension is
optional: when it is missing or cannot run a device, ``'auto'`` uses the reference and one
warning says why; ``'cuda'`` then raises, because the user asked for the kernels explicitly.

Before loading ``mmseg_mesa._C`` we compare what ``setup.py`` recorded in ``_build_info.py`` with
the running torch: an extension built for another torch may fail to import or, worse, crash.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch

from .reference import REFERENCE

REINSTALL = 'reinstall with `pip install --no-build-isolation --no-deps -e .`'


class QuantBackend(Protocol):
    """What the quantizer and ``saved.PackedMask`` run; the reference and the kernels alike.

    Tensors are contiguous where the kernels need it (the callers make them so); ``lower``,
    ``span``, ``scale`` are fp32 and ``seen`` bool, one per group, on ``x``'s device.
    """

    name: str  # how ``python -m mmseg_mesa.info`` names it
    SUPPORTED_DEVICES: frozenset[str] | None  # device types it runs; None: every device

    def not_supported_reasons(self, device: torch.device) -> list[str]:
        """Why it cannot run tensors on ``device`` (empty: it can)."""
        ...

    def observe(self, x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor,
                seen: torch.Tensor, group_dim: int, group_size: int, decay: float
                ) -> torch.Tensor:
        """Update the running estimates in place (``reference.ema_update``); return the
        ``(2, G)`` range covering this batch."""
        ...

    def quantize(self, x: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, bits: int,
                 group_dim: int, group_size: int, stochastic: bool,
                 counter: tuple[int, int] | None = None, pack: bool = False) -> torch.Tensor:
        """uint8 codes shaped like ``x``; with ``pack``, bit-packed and flat when
        ``bits < 8``. Stochastic rounding draws at ``counter``, by default the device's next
        stream position (``rounding.rounding_counter``)."""
        ...

    def dequantize(self, codes: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor,
                   group_dim: int, group_size: int, dtype: torch.dtype, bits: int = 8,
                   shape: torch.Size | None = None, divisor: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """``codes * scale + lower`` in ``dtype``, shaped ``shape`` (by default the codes'), each
        value divided by its row's ``divisor`` (fp32, one per row) where given."""
        ...

    def observe_quantize(self, x: torch.Tensor, lower: torch.Tensor, span: torch.Tensor,
                         seen: torch.Tensor, group_dim: int, group_size: int, decay: float,
                         bits: int, stochastic: bool, pack: bool = False,
                         counter: tuple[int, int] | None = None,
                         mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                         rows: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``observe`` then ``quantize`` over its range: ``(codes, lower, scale)``; with
        ``mean`` and ``rstd``, those of ``(x - mean) * rstd`` without building it, one of each
        per group, or per row of the ``(rows, channels * inner)`` view with ``rows``
        (``reference.observe_then_quantize``)."""
        ...

    def refine(self, x: torch.Tensor, codes: torch.Tensor, lower: torch.Tensor,
               scale: torch.Tensor, group_dim: int, group_size: int,
               mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fine codes of ``x``'s 8-bit ``codes`` with their lower and scale
        (``reference.refine_reference``)."""
        ...

    def dequantize_refined(self, codes: torch.Tensor, fine: torch.Tensor, lower: torch.Tensor,
                           scale: torch.Tensor, fine_lower: torch.Tensor,
                           fine_scale: torch.Tensor, group_dim: int, group_size: int,
                           dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """Coarse and fine codes decoded and added in fp32, in ``dtype``."""
        ...

    def norm_terms(self, rstd: torch.Tensor, decoded_invstd: torch.Tensor,
                   weight: torch.Tensor | None, eps: float, reliable: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """BatchNorm's per-channel backward terms (``reference.norm_terms_reference``)."""
        ...

    def pack_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A mask as 1 bit per element, in ``bitpack``'s layout."""
        ...

    def unpack_mask(self, data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The bool tensor of ``shape`` that ``pack_mask`` packed into ``data``."""
        ...

    def pack_positive(self, x: torch.Tensor) -> torch.Tensor:
        """``pack_mask(x > 0)``."""
        ...

    def mask_select(self, values: torch.Tensor, data: torch.Tensor, shape: torch.Size
                    ) -> torch.Tensor:
        """``torch.where(unpack_mask(data, shape), values, 0)``."""
        ...

    def mask_select_(self, values: torch.Tensor, data: torch.Tensor, shape: torch.Size
                     ) -> torch.Tensor:
        """``mask_select`` written into ``values``, which it returns."""
        ...


@dataclass
class ExtensionState:
    """What this process knows about the compiled extension.

    Process-wide because each fact is: a shared library loads once per process (and a load that
    failed is not retried at every pack), a GPU's architecture does not change while the
    process runs, and the warning that the slower reference runs instead is given once per
    process, not once per layer. Tests replace ``EXTENSION`` to stand for other builds.
    """

    loaded: bool = False  # whether loading was tried
    module: ModuleType | None = None  # ``mmseg_mesa.kernels`` once loaded and usable
    error: str | None = None  # why it is not usable
    warned: bool = False  # whether the fallback warning was given
    # per CUDA device index: why the kernels cannot run there (None: they can)
    device_errors: dict[int, str | None] = field(default_factory=dict)


EXTENSION = ExtensionState()
_CPU = torch.device('cpu')


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
    state = EXTENSION
    if not state.loaded:
        state.loaded = True
        state.error = _unusable_reason()
        if state.error is None:
            try:
                from . import kernels
            except (ImportError, OSError, AttributeError) as err:  # missing .so, symbols, ...
                state.error = f'mmseg_mesa._C failed to load ({type(err).__name__}: {err})'
            else:
                if kernels.TORCH_VERSION != torch.__version__.split('+')[0]:
                    state.error = (f'mmseg_mesa._C was compiled against torch headers '
                                   f'{kernels.TORCH_VERSION}, but torch {torch.__version__} is '
                                   f'running; {REINSTALL}')
                else:
                    state.module = kernels
    return state.module, state.error


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
    errors = EXTENSION.device_errors
    if index not in errors:
        info = build_info()
        capability = torch.cuda.get_device_capability(index)
        archs = info.CUDA_ARCH_LIST if info is not None else None
        covered = arch_covers(archs, capability) if archs else None
        errors[index] = None if covered is not False else (
            f'mmseg_mesa._C was built for TORCH_CUDA_ARCH_LIST={archs!r}, which does not cover '
            f'cuda:{index} (sm_{capability[0]}{capability[1]}); set TORCH_CUDA_ARCH_LIST and '
            f'{REINSTALL}')
    return errors[index]


def choose_backend(device: torch.device, requested: str = 'auto'
                   ) -> tuple[QuantBackend, str | None]:
    """The backend for tensors on ``device`` under ``requested``, and why the compiled kernels
    do not run there where they were wanted and cannot (None otherwise). No warning, no error:
    ``select_backend`` gives those; ``python -m mmseg_mesa.info`` reports this."""
    if requested == 'torch':
        return REFERENCE, None
    ext, error = load_extension()
    if ext is None:
        return REFERENCE, error
    reasons: list[str] = []
    for backend in ext.BACKENDS:
        if device.type in backend.SUPPORTED_DEVICES:
            why = backend.not_supported_reasons(device)
            if not why:
                return backend, None
            reasons += why
    # no kernels for this device type (meta, mps, ...): the reference, and nothing to explain
    return REFERENCE, '; '.join(reasons) if reasons else None


def select_backend(x: torch.Tensor, requested: str = 'auto') -> QuantBackend:
    """The backend that runs ``x`` under ``requested`` (``'auto'``, ``'cuda'``, ``'torch'``).

    The only place that decides. Asked of the tensor, CPU first: every unpack and mask asks,
    and ``x.device`` builds a device object (a few us). Where ``'auto'`` falls back to the
    reference for want of kernels, one warning per process says why; ``'cuda'`` raises.
    """
    if x.is_cpu:
        if requested == 'auto':
            ext = EXTENSION.module
            if ext is not None:
                return ext.CPU
        device = _CPU
    else:
        device = x.device
    if requested == 'cuda' and device.type != 'cuda':
        raise RuntimeError(f"mesa backend='cuda' needs CUDA tensors; got a tensor on {device}")
    backend, reason = choose_backend(device, requested)
    if reason is not None:
        if requested == 'cuda':
            raise RuntimeError(
                f"mesa backend='cuda' but the CUDA extension is unavailable ({reason})")
        if not EXTENSION.warned:
            EXTENSION.warned = True
            kind = 'CUDA kernels' if device.type == 'cuda' else 'compiled extension'
            warnings.warn(f'mmseg_mesa: {kind} unavailable ({reason}); using the slower '
                          'pure-PyTorch quantizer. Run `python -m mmseg_mesa.info` for '
                          'details.', stacklevel=3)
    return backend
