"""Mesa under ``torch.compile``, next to the compiled baseline and to eager Mesa.

What a user of ``torch.compile`` meets: the first step's time (the compile), recompiles in
later steps, graph breaks and the frames they happen in, the step time once compiled, and
whether the compiled step's gradients are eager Mesa's. ``tools/benchmark_compile.py`` is the
command line over it.

Random ops: inductor draws its own random numbers unless ``fallback_random`` is set, so
dropout and drop-path masks of a compiled step would differ from an eager step's; every
comparison here runs with ``torch._inductor.config.fallback_random = True`` (``same_random``).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .fidelity import Gradients, relative_error, worst_cosine
from .memory import synchronize
from .models import loss_of

_PACKAGE = os.sep + 'mmseg_mesa' + os.sep


@contextlib.contextmanager
def same_random() -> Iterator[None]:
    """Compiled random ops draw from torch's generator, as eager ones do."""
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fallback_random=True):
        yield


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (each compile or recompile of a frame)."""
    from torch._dynamo.utils import counters
    return int(counters['stats']['unique_graphs'])


def breaks_counted() -> int:
    from torch._dynamo.utils import counters
    return int(sum(counters['graph_break'].values()))


def step_gradients(forward: Callable, model: torch.nn.Module, batch: tuple, seed: int = 1
                   ) -> tuple[float, Gradients]:
    """The loss and the parameter gradients of one step of ``forward`` (the model or its
    compiled form), from ``seed``."""
    torch.manual_seed(seed)
    loss = loss_of(forward(*batch, mode='loss'))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def timed_step(forward: Callable, model: torch.nn.Module, batch: tuple,
               optimizer: torch.optim.Optimizer | None) -> float:
    device = next(model.parameters()).device.type
    synchronize(device)
    start = time.perf_counter()
    loss_of(forward(*batch, mode='loss')).backward()
    if optimizer is not None:
        optimizer.step()
    model.zero_grad(set_to_none=True)
    synchronize(device)
    return time.perf_counter() - start


def first_steps(forward: Callable, model: torch.nn.Module, batch: tuple, steps: int,
                optimizer: torch.optim.Optimizer | None) -> tuple[dict, float, Gradients]:
    """The first ``steps`` training steps of a compiled forward: the first one's time (it
    compiles), the graphs and breaks met in it, and the recompiles (graphs compiled) after it;
    with the first step's loss and gradients (from seed 1, before any optimizer step)."""
    graphs, breaks = compiled_graphs(), breaks_counted()
    start = time.perf_counter()
    loss, grads = step_gradients(forward, model, batch)
    result = dict(first_step_s=time.perf_counter() - start, graphs=compiled_graphs() - graphs,
                  graph_breaks=breaks_counted() - breaks)
    after_first = compiled_graphs()
    for _ in range(steps - 1):
        timed_step(forward, model, batch, optimizer)
    result['recompiles_after_first'] = compiled_graphs() - after_first
    return result, loss, grads


def break_sites(model: torch.nn.Module, batch: tuple) -> dict:
    """``torch._dynamo.explain`` over one loss forward: graphs, graph breaks, and each break
    whose frame is in ``mmseg_mesa`` (file:line and reason). It resets dynamo first, so every
    frame is traced anew: what this process compiled before compiles again at its next call."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*batch, mode='loss')
    ours = []
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        if frame is not None and _PACKAGE in frame.filename:
            ours.append(f'{frame.filename.rsplit(_PACKAGE, 1)[1]}:{frame.lineno}: '
                        f'{reason.reason.splitlines()[0]}')
    return dict(graphs=explained.graph_count, graph_breaks=explained.graph_break_count,
                breaks_in_mmseg_mesa=ours)


def gradient_match(compiled: Gradients, eager: Gradients, eager_again: Gradients) -> dict:
    """The compiled step's gradients against an eager step's from the same seed, with the
    spread between two eager steps (two rounding draws) as the yardstick."""
    return dict(relative_error=relative_error(compiled, eager),
                worst_cosine=worst_cosine(compiled, eager),
                eager_draws_relative_error=relative_error(eager_again, eager))


def summary(result: dict[str, Any]) -> str:
    """The table ``tools/benchmark_compile.py`` prints."""
    lines = [f'{"mode":<18} {"first step s":>12} {"step s":>8} {"ratio":>6} {"graphs":>6} '
             f'{"breaks":>6} {"recompiles":>10}']
    base = result['modes'].get('baseline', {}).get('step_s')
    for mode, m in result['modes'].items():
        ratio = f'{m["step_s"] / base:.2f}' if base else '-'
        lines.append(f'{mode:<18} {m.get("first_step_s", 0):12.1f} {m["step_s"]:8.3f} '
                     f'{ratio:>6} {m.get("graphs", "-"):>6} {m.get("graph_breaks", "-"):>6} '
                     f'{m.get("recompiles_after_first", "-"):>10}')
    if 'breaks' in result:
        b = result['breaks']
        lines.append(f'explain (mesa compiled, one forward): {b["graphs"]} graphs, '
                     f'{b["graph_breaks"]} breaks, {len(b["breaks_in_mmseg_mesa"])} in '
                     'mmseg_mesa')
        lines += [f'    {site}' for site in b['breaks_in_mmseg_mesa']]
    if 'gradients' in result:
        g = result['gradients']
        lines.append(f'gradients, compiled Mesa vs eager Mesa (same seed): error '
                     f'{g["relative_error"]:.4f}, worst cosine {g["worst_cosine"]:.4f}; '
                     f'two eager draws: error {g["eager_draws_relative_error"]:.4f}')
    if 'losses' in result:
        lines.append('loss of one step (same seed): ' + ', '.join(
            f'{k} {v:.6f}' for k, v in result['losses'].items()))
    return '\n'.join(lines)
