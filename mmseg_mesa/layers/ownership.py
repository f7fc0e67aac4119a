"""Whether a tensor's memory may take another result: nothing else reads it again.

An op may write its output into an input's storage (``ctx.mark_dirty``) only where no one reads
the input afterwards, and a backward its input gradient into the incoming gradient only where no
one else reads that: no caller, hook or list keeps it, no autograd node saved it or waits for
it, no other tensor shares its storage. This is asked of the interpreter and of torch (reference
and use counts) rather than assumed from which layer made the tensor, so a hook that keeps a
tensor, or a layer that saves its output for backward, turns the reuse off on its own.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
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


def owned_gradients(backward: Callable) -> Callable:
    """Decorates an autograd Function's backward (outermost): ``ctx.owned_grads`` says, per
    incoming gradient, whether nothing else holds it (``sole_gradient``), so that backward may
    write its result into it."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        ctx.owned_grads = tuple(sole_gradient(grads, i) for i in range(len(grads)))
        return backward(ctx, *grads)

    return wrapper


def sole_gradient(grads: tuple, index: int) -> bool:
    """Whether ``grads[index]``, a gradient as autograd hands it to a backward decorated with
    ``owned_gradients``, is held by nothing else: no other node's input buffer (the engine passes
    one gradient to every input of an addition), no tensor hook that kept it, no view or alias.

    C++ holders count in the tensor's use count; Python holders in its references, against what
    a gradient nothing else holds has there (``_sole_gradient_references``).
    """
    g = grads[index]
    if (not isinstance(g, torch.Tensor) or _storage_use_count is None
            or not hasattr(g, '_use_count') or g._is_view() or g._use_count() != 1):
        return False
    if _storage_use_count(g.untyped_storage()._cdata) != 2:
        return False
    del g
    return _references(grads, index) == _sole_gradient_references()


@functools.cache
def _sole_gradient_references() -> int:
    """``_references`` of a fresh gradient in a backward called as ``owned_gradients`` calls it
    (the engine's and the call's own tuples hold it): measured once on a probe."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
            seen.append(_references(grads, 0))
            return grads[0]

    x = torch.zeros(1, requires_grad=True)
    with torch.enable_grad():
        torch.autograd.grad((Probe.apply(x) * 2).sum(), x)
    return seen[0]
