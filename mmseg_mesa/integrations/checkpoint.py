"""Loading mmengine checkpoints on torch >= 2.6 without turning off ``weights_only``.

mmengine 0.10.7 calls ``torch.load`` without ``weights_only``; since torch 2.6 that means
``weights_only=True``, which refuses the non-tensor objects mmengine stores in its own checkpoints
(message-hub history buffers with numpy arrays, ...), so resuming and ``tools/test.py`` fail.
Instead of loading every file with ``weights_only=False`` (which would execute arbitrary pickled
code from any file), we allow exactly the types mmengine writes. Files with anything else are
still refused.

One of them needs care: a HistoryBuffer pickles its statistics methods as
``getattr(HistoryBuffer, 'min')``. Allowing ``builtins.getattr`` itself would let a crafted file
fetch any attribute reachable from an allowed object (``os.system`` through a function's
globals) and plant it where mmengine later calls it; we map that global to a getattr that only
returns HistoryBuffer's registered statistics methods.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

# HistoryBuffer._set_default_statistics registers these on every buffer.
_DEFAULT_STATISTICS = frozenset({'min', 'max', 'mean', 'current'})


def _history_buffer_statistic(owner: Any, name: str) -> Any:
    """``getattr`` restricted to what mmengine pickles: ``HistoryBuffer.<statistic>``."""
    from mmengine.logging.history_buffer import HistoryBuffer

    allowed = _DEFAULT_STATISTICS | set(HistoryBuffer._statistics_methods)
    if owner is not HistoryBuffer or name not in allowed:
        raise pickle.UnpicklingError(
            f'mmseg_mesa: refusing getattr({owner!r}, {name!r}) in a checkpoint: only '
            'HistoryBuffer statistics are allowed')
    return getattr(owner, name)


def mmengine_checkpoint_globals() -> list:
    """The classes and functions that an mmengine / mmseg checkpoint pickles besides tensors."""
    from mmengine.logging.history_buffer import HistoryBuffer

    multiarray = getattr(np, '_core', np.core).multiarray
    scalar_types = [np.dtype(name).type for name in (
        'bool', 'int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32', 'uint64',
        'float16', 'float32', 'float64')]
    dtype_classes = [type(np.dtype(t)) for t in scalar_types]
    return [HistoryBuffer, np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar,
            *scalar_types, *dtype_classes, (_history_buffer_statistic, 'builtins.getattr')]


def allow_mmengine_checkpoints() -> None:
    """Register mmengine's checkpoint types as safe for ``torch.load(weights_only=True)``."""
    torch.serialization.add_safe_globals(mmengine_checkpoint_globals())
