"""Exact recomputation of a cheap-to-recompute, expensive-to-save tail of the graph: the loss.

mmseg upsamples the decode head's 1/4-resolution logits to the label size and takes a
cross-entropy there; autograd then keeps the full-resolution log-softmax (150 classes x H x W):
about a fifth of everything Swin-T UPerNet saves. ``RecomputedLoss`` saves only the input logits
and, in backward, runs the same loss code again with grad enabled, so the gradients are those of
the unfused path (same ops in the same order) with no quantization involved.

A loss may begin with a part that is not differentiable and costs more than it keeps: matching
predictions to the ground truth (Mask2Former's Hungarian assignment). ``targets_fn`` names that
part: it runs once, in forward, and backward hands its result to the loss again rather than
running it a second time.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .autocast import record_autocast, replayed_autocast, returns_owned

LossFn = Callable[..., dict[str, torch.Tensor]]
TargetsFn = Callable[..., Any]


def is_differentiable(name: str) -> bool:
    """mmengine sums the entries whose name contains 'loss'; the rest (acc_seg) are metrics."""
    return 'loss' in name


class RecomputedLoss(torch.autograd.Function):
    """``loss_fn(*inputs)`` (a dict of tensors, mmseg's convention) saving only ``inputs``; with
    ``targets_fn``, ``loss_fn(targets, *inputs)``, where ``targets = targets_fn(*inputs)`` runs
    once, in forward, without grad, and backward reuses what it returned.

    Backward runs ``loss_fn`` again from the random state it started from in forward (after
    ``targets_fn``), so a loss that samples (Mask2Former's points, OHEM) draws the same numbers,
    and the model's own random stream is left where the forward left it.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, loss_fn: LossFn, targets_fn: TargetsFn | None, names_out: list[str],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        record_autocast(ctx, inputs[0])
        with torch.no_grad():
            # detached: a view of an input would claim requires_grad with no grad_fn, which
            # module hooks that follow gradients (MemTracker's) refuse
            detached = [t.detach() for t in inputs]
            ctx.targets = () if targets_fn is None else (targets_fn(*detached),)
            ctx.rng = random_state(inputs[0].device)
            ctx.loss_fn = loss_fn
            result = loss_fn(*ctx.targets, *detached)
        ctx.names = list(result)
        names_out[:] = ctx.names
        ctx.mark_non_differentiable(*[v for k, v in result.items() if not is_differentiable(k)])
        ctx.save_for_backward(*inputs)
        return tuple(result.values())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        inputs = ctx.saved_tensors
        wanted = ctx.needs_input_grad[3:]
        with torch.enable_grad(), replayed_random_state(*ctx.rng), replayed_autocast(ctx):
            leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, wanted)]
            result = ctx.loss_fn(*ctx.targets, *leaves)
        pairs = [(result[name], g) for name, g in zip(ctx.names, grads)
                 if is_differentiable(name) and g is not None and result[name].requires_grad]
        wrt = [leaf for leaf in leaves if leaf.requires_grad]
        if not pairs or not wrt:
            return (None, None, None, *[None] * len(inputs))
        found = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                         allow_unused=True))
        return (None, None, None,
                *[next(found) if leaf.requires_grad else None for leaf in leaves])


def random_state(device: torch.device) -> tuple[torch.Tensor, torch.device, torch.Tensor | None]:
    """torch's CPU random state, and the CUDA one of ``device`` where it is a GPU."""
    cuda = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
    return torch.get_rng_state(), device, cuda


@contextlib.contextmanager
def replayed_random_state(cpu: torch.Tensor, device: torch.device,
                          cuda: torch.Tensor | None) -> Iterator[None]:
    """Run the block from a recorded random state; the streams are as they were after it."""
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def recomputed_losses(loss_fn: LossFn, *inputs: torch.Tensor,
                      targets_fn: TargetsFn | None = None) -> dict[str, torch.Tensor]:
    """``loss_fn(*inputs)`` with only ``inputs`` saved for backward.

    Args:
        loss_fn: the loss, a dict of tensors; with ``targets_fn``, called as
            ``loss_fn(targets, *inputs)``.
        inputs: the tensors the loss is differentiated for, saved for backward.
        targets_fn: the loss's part that gives no gradient to ``inputs`` (the ground truth
            matched to them): run once, in forward, without grad, on the inputs' values; what
            it returns is kept until backward, so it should be small. Defaults to None.
    """
    names: list[str] = []
    outputs = RecomputedLoss.apply(loss_fn, targets_fn, names, *inputs)
    return dict(zip(names, outputs))
