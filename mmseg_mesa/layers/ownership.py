"""Whether a tensor's memory may take another result: nothing else reads it again.

An op may write its output into an input's storage (``ctx.mark_dirty``) only where no one reads
the input afterwards, and a backward its input gradient into the incoming gradient only where no
one else reads that: no caller, hook or list keeps it, no autograd node saved it or waits for
it, no other tensor shares its storage. This is asked of the interpreter and of torch (reference
and use counts) rather than assumed from which layer made the tensor, so a hook that keeps a
tensor, or a layer that saves its output for backward, turns the reuse off on its own.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

_storage_use_count = getattr(torch._C, '_storage_Use_Count', None)


def _references(holder: list[Any], index: int) -> int:
    return sys.getrefcount(holder[index])


# What ``_references`` gives for an object that only the list refers to (interpreters differ in
# the temporary references they count).
_SOLE = _references([object()], 0)


def sole_reference(holder: list[Any], index: int) -> bool:
    """Whether ``holder[index]`` is a tensor that only ``holder`` refers to and that has its
    storage to itself, so that it may be overwritten once read.

    Python references count every holder of the tensor object; an autograd node that saved the
    tensor as an input holds it from C++, which keeps its Python object referenced too. The
    storage's use count is one for the tensor and one for its Python storage object: a view, a
    ``detach()`` or an output saved by the tensor's maker adds one. A leaf that requires grad is
    never overwritten (autograd forbids it), nor is anything where torch does not report storage
    use counts.
    """
    t = holder[index]
    if (not isinstance(t, torch.Tensor) or _storage_use_count is None or t._is_view()
            or (t.is_leaf and t.requires_grad) or t.numel() == 0):
        return False
    del t
    if _references(holder, index) != _SOLE:
        return False
    return _storage_use_count(holder[index].untyped_storage()._cdata) == 2

