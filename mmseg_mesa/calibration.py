"""Which layers keep about 16 bits, chosen from the gradient rather than from rules.

Rules (``MesaConfig.batchnorm_refine_below``, ``attention_refine_error``) refine what the model
families they were written for needed; another architecture breaks 8-bit codes somewhere no rule
looks (ConViT's positional projection, whose input is the same small grid of offsets in every
image). ``calibrate`` measures instead, as GACT does for bit widths: on one small step it finds
the converted layers whose 8-bit codes move the parameter gradients beyond
``MesaConfig.calibrate``'s bounds and sets their quantizers' ``keep_refined``, which every pack
honours (``ActivationQuantizer.pack``) and the training state keeps.

The measure. One step with every quantizer refined (about 16 bits: its error is about 1/128 of
8 bits') is the reference; the contribution of a group of layers is the gradient error of a step
in which that group alone keeps 8-bit codes. Rounding errors of different layers are independent,
so their squared gradient errors add, per parameter and over the whole vector: a group's
contribution bounds each member's, and the layers left at 8 bits make together about the sum of
their groups'. Starting from all layers as one group, the group that contributes most to the
bound most exceeded is split in halves and both are measured (two steps), or refined where it is
one layer, until the predicted sum is within the bounds. The prediction is then checked by one
step with all those groups at 8 bits: where a bias the layers share adds their errors in line
rather than in quadrature, the measured union exceeds the sum, and the search goes on with its
predictions scaled by that ratio. A model that holds costs a forward and two steps (refined,
then 8-bit); each layer found costs about twice the log2 of the layer count. Where ``passes``
run out, the groups not split yet are refined whole, the largest first (more memory, never a
looser gradient).
Layers of one role in repeated blocks (``role``: every block's positional projection) sit side
by side in the order halved; once one of them is refined, those of its size follow it (one
draw of each alone would decide each by chance), and the others of the role are measured as
one group and refined together where that group alone exceeds the bounds.

Under torch.distributed every rank steps on its own images and the search decides on the
squared errors summed over the ranks: one choice, and the same steps on every rank, so
collectives inside a step (SyncBatchNorm's) pair up.

The steps leave the run as it was: running estimates, attention readings, rounding streams,
every buffer (BatchNorm statistics), the random state and the parameters' gradients are put back,
and each step starts from them, so the groups differ only in their codes. Its peak is one Mesa
step at the calibration batch plus one copy of the gradients (the reference's): at the first
iteration, before the optimizer has allocated its state (AdamW's: two such copies), so it fits
where the baseline trains on that batch.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import Calibration
from .quantizer import ActivationQuantizer
from .rounding import restore_rounding_state, rounding_state

__all__ = ['CalibrationReport', 'Contribution', 'agree_across_ranks', 'calibrate',
           'first_images', 'refined_layers']

SIGNIFICANT = 1e-3  # parameters below this fraction of the largest gradient norm are not bounded
# One step's squared error of one parameter varies between rounding draws by a factor of a few
# (ConViT's positional projections: worst cosine 0.980-0.992 over three draws of one batch);
# the whole vector's, a sum over every parameter, much less.
DRAW_MARGIN = 2.0
Step = Callable[[], torch.Tensor]  # the calibration batch's forward: the loss to differentiate


@dataclass
class Contribution:
    """One refined layer: its gradient error alone at 8 bits (whole vector, and the parameter it
    moved most, relative to that parameter's gradient) and what refining it keeps more."""

    name: str
    error: float
    parameter: str
    parameter_error: float
    extra_bytes: int


@dataclass
class CalibrationReport:
    """What ``calibrate`` found and what it cost.

    ``before`` / ``after``: whole-gradient error and worst cosine against the refined step, with
    every candidate at 8 bits and with the choice (``after`` is measured by one more step where
    anything was refined). ``step_seconds``: the first step (8-bit codes, the training step's
    own cost); ``seconds``: the whole calibration; ``peak_bytes``: the device's peak during it,
    where the device counts (CUDA), else None.
    """

    candidates: int = 0
    refined: list[Contribution] = field(default_factory=list)
    passes: int = 0
    before: tuple[float, float] = (0.0, 1.0)
    after: tuple[float, float] = (0.0, 1.0)
    extra_bytes: int = 0
    saved_bytes: int = 0
    seconds: float = 0.0
    step_seconds: float = 0.0
    peak_bytes: int | None = None
    exhausted: bool = False

    def format(self) -> str:
        steps = self.seconds / max(self.step_seconds, 1e-9)
        lines = [f'calibration: {len(self.refined)} of {self.candidates} layers refined in '
                 f'{self.passes} steps ({self.seconds:.2f} s, {steps:.1f}x one step'
                 + (f', peak {self.peak_bytes / 2**20:.0f} MiB' if self.peak_bytes else '')
                 + f'); against refined codes: error {self.before[0]:.4f}, worst cosine '
                 f'{self.before[1]:.4f} at 8 bits, {self.after[0]:.4f} / {self.after[1]:.4f} '
                 f'as chosen; +{self.extra_bytes / 2**20:.2f} MiB of '
                 f'{self.saved_bytes / 2**20:.1f} MiB of codes at the calibration batch'
                 + (' (steps ran out: groups refined whole)' if self.exhausted else '')]
        for c in self.refined:
            lines.append(f'  {c.name}: error {c.error:.4f}, {c.parameter} '
                         f'{c.parameter_error:.3f}, +{c.extra_bytes / 2**10:.1f} KiB')
        return '\n'.join(lines)


def refined_layers(model: nn.Module) -> list[str]:
    """The quantizers that keep refined codes by choice (``keep_refined``), by qualified name."""
    return [n for n, m in model.named_modules()
            if isinstance(m, ActivationQuantizer) and m.keep_refined]


class _Snapshot:
    """The state a step changes besides the codes, put back before each step and at the end."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = {(id(m), k): (m, k, b.detach().clone())
                        for m in model.modules() for k, b in m._buffers.items() if b is not None}
        self.readings = {id(q): (q.replay_error.state(), q.map_error.state())
                         for q in _quantizers(model).values()}
        self.rounding = rounding_state()
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.grads = {p: p.grad for p in model.parameters()}

    def restore(self) -> None:
        with torch.no_grad():
            for m, k, saved in self.buffers.values():
                buffer = m._buffers.get(k)
                if buffer is not None:  # in place: wrappers hold references to the estimates
                    buffer.resize_(saved.shape).copy_(saved)
        for q in _quantizers(self.model).values():
            readings = self.readings.get(id(q))
            if readings is None:  # made by a step: as if never run (its estimates too)
                for k in ('lower', 'span', 'seen'):
                    q._buffers[k].resize_(0)
                q.replay_error.restore(None)
                q.map_error.restore(None)
            else:
                _restore_reading(q.replay_error, readings[0])
                _restore_reading(q.map_error, readings[1])
        restore_rounding_state(self.rounding)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore_grads(self) -> None:
        for p, grad in self.grads.items():
            p.grad = grad


def _restore_reading(reading, state) -> None:
    # ``LateReading.state`` is the value, or (value, calls made) where calls are counted
    if isinstance(state, tuple):
        reading.restore(*state)
    else:
        reading.restore(state)


def role(name: str) -> str:
    """A layer's name without its block indices: the layers of one role in repeated blocks
    (every block's positional projection) share it, and often the reason to refine."""
    return re.sub(r'(?<=[._])\d+(?=\.|$)', '#', name)  # ``blocks.3.``, ``features_3.``


def _quantizers(model: nn.Module) -> dict[str, ActivationQuantizer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ActivationQuantizer)}


@contextmanager
def _recording(quantizers: dict[str, ActivationQuantizer], sizes: dict[str, int]
               ) -> Iterator[None]:
    """Count the values each quantizer packs (its cost refined: one byte more per value)."""
    def wrap(name: str, q: ActivationQuantizer, method: str) -> None:
        original = getattr(type(q), method)

        def counted(x: torch.Tensor, *args, **kwargs):
            sizes[name] = sizes.get(name, 0) + x.numel()
            return original(q, x, *args, **kwargs)
        setattr(q, method, counted)  # an instance attribute: shadows the class's method

    for name, q in quantizers.items():
        wrap(name, q, 'pack')
        wrap(name, q, 'pack_standardized')
    try:
        yield
    finally:
        for q in quantizers.values():
            for method in ('pack', 'pack_standardized'):
                q.__dict__.pop(method, None)


def _gradients(model: nn.Module, step: Step, snapshot: _Snapshot) -> list[torch.Tensor | None]:
    snapshot.restore()
    for p in model.parameters():
        p.grad = None
    step().backward()
    grads = [None if p.grad is None else p.grad.detach() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def _across_ranks(values: torch.Tensor, op: str = 'sum') -> torch.Tensor:
    """``values`` summed (or their maximum) over the ranks of torch.distributed: every rank then
    decides alike and takes the same steps, so collectives inside a step (SyncBatchNorm's)
    pair up, and the choice is one for all ranks."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return values
    device = torch.device('cpu')
    if dist.get_backend() == 'nccl':
        device = torch.device('cuda', torch.cuda.current_device())
    out = values.to(device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == 'sum' else dist.ReduceOp.MAX)
    return out.to(values.device)


def _squared_errors(got: list, reference: list) -> torch.Tensor:
    """Per parameter ``||got - reference||^2`` (fp64; a missing gradient is 0), summed over the
    ranks where torch.distributed runs."""
    out = []
    for g, r in zip(got, reference):
        if r is None:
            out.append(0.0 if g is None else float(g.double().pow(2).sum()))
        else:
            diff = r.double() if g is None else (g.double() - r.double())
            out.append(float(diff.pow(2).sum()))
    return _across_ranks(torch.tensor(out, dtype=torch.float64))


class _Measure:
    """Squared errors against the refined reference, and the bounds they are held to."""

    def __init__(self, reference: list, bounds: Calibration, names: list[str]) -> None:
        self.names = names
        norms = _across_ranks(torch.tensor([0.0 if r is None else float(r.double().pow(2).sum())
                                            for r in reference], dtype=torch.float64))
        self.whole_limit = bounds.error ** 2 * float(norms.sum())
        # a gradient off by a relative error e at right angles has cosine 1 / sqrt(1 + e^2);
        # one parameter's error in one step is one draw of a sum of few rounding errors, so
        # the search holds its expectation to DRAW_MARGIN below the limit
        relative = (1.0 / bounds.cosine ** 2 - 1.0) / DRAW_MARGIN
        significant = norms.sqrt() >= SIGNIFICANT * float(norms.sqrt().max())
        self.norms = norms
        self.limits = torch.where(significant, relative * norms,
                                  torch.full_like(norms, math.inf))

    def excess(self, total: torch.Tensor) -> tuple[float, int | None]:
        """The largest ratio of a squared error to its limit, and the parameter it is at
        (None: the whole vector)."""
        per = total / self.limits
        worst = int(per.argmax()) if per.numel() else 0
        whole = float(total.sum()) / self.whole_limit if self.whole_limit > 0 else 0.0
        if per.numel() and float(per[worst]) > whole:
            return float(per[worst]), worst
        return whole, None

    def summary(self, total: torch.Tensor) -> tuple[float, float]:
        """Whole relative error and worst cosine (assuming errors at right angles)."""
        whole = math.sqrt(float(total.sum()) / max(float(self.norms.sum()), 1e-300))
        finite = torch.isfinite(self.limits)
        if not bool(finite.any()):
            return whole, 1.0
        rel = (total[finite] / self.norms[finite]).max()
        return whole, 1.0 / math.sqrt(1.0 + float(rel))

    def observed(self, got: list, reference: list) -> tuple[float, float]:
        """Whole relative error and worst cosine of one step's gradients."""
        whole = math.sqrt(float(_squared_errors(got, reference).sum())
                          / max(float(self.norms.sum()), 1e-300))
        worst = 1.0
        for g, r, limit in zip(got, reference, self.limits.tolist()):
            if r is not None and math.isfinite(limit):
                g = torch.zeros_like(r) if g is None else g
                worst = min(worst, float(torch.nn.functional.cosine_similarity(
                    g.flatten().double(), r.flatten().double(), dim=0)))
        return whole, worst

    def contribution(self, name: str, squared: torch.Tensor, extra: int) -> Contribution:
        finite = torch.isfinite(self.limits)
        rel = torch.where(finite, squared / self.norms.clamp_min(1e-300),
                          torch.zeros_like(squared))
        worst = int(rel.argmax())
        return Contribution(name, math.sqrt(float(squared.sum()) / float(self.norms.sum())),
                            self.names[worst], math.sqrt(float(rel[worst])), extra)


def _without(group: list[str], chosen: dict) -> list[str]:
    return [n for n in group if n not in chosen]


def _share(squared: torch.Tensor, at: int | None) -> float:
    """A group's part of the bound most exceeded: its squared error there."""
    return float(squared.sum()) if at is None else float(squared[at])


def calibrate(model: nn.Module, step: Step, bounds: Calibration) -> CalibrationReport:
    """Set ``keep_refined`` on the quantizers of ``model`` whose 8-bit codes move the gradient
    of ``step`` (the calibration batch's loss) beyond ``bounds``; clear it on the others.

    ``model`` is converted and in training mode; ``step`` runs its forward on a batch small
    enough to train on. Nothing else about the run changes (see the module's docstring).
    """
    start = time.perf_counter()
    cuda = next((p.device for p in model.parameters() if p.is_cuda), None)
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)
    report = CalibrationReport()
    for q in _quantizers(model).values():
        q.keep_refined = False
    snapshot = _Snapshot(model)
    names = [n for n, _ in model.named_parameters()]
    sizes: dict[str, int] = {}
    try:
        # a forward alone makes the call sites' quantizers (they appear at their first call);
        # its graph is dropped unused
        snapshot.restore()
        step()
        # 16-bit layers are refined already
        everything = {n: q for n, q in _quantizers(model).items() if q.spec.bits == 8}
        for q in everything.values():
            q.keep_refined = True
        with _recording(everything, sizes):
            reference = _gradients(model, step, snapshot)
        report.passes = 2
        for q in everything.values():
            q.keep_refined = False
        begun = time.perf_counter()
        coarse = _gradients(model, step, snapshot)  # all at 8 bits: a training step
        report.step_seconds = time.perf_counter() - begun
        report.passes = 3
        # the same sizes on every rank (the largest), so that every rank decides alike
        ordered = sorted(everything)
        counts = _across_ranks(torch.tensor([sizes.get(n, 0) for n in ordered],
                                            dtype=torch.float64), 'max')
        sizes = {n: int(c) for n, c in zip(ordered, counts.tolist()) if c}
        # those that packed, layers of one role in repeated blocks side by side
        candidates = sorted((n for n in everything if sizes.get(n)), key=role)
        report.candidates = len(candidates)
        report.saved_bytes = sum(sizes.values())

        def run(coarse_ones: set[str]) -> list:
            for n in candidates:
                everything[n].keep_refined = n not in coarse_ones
            report.passes += 1
            return _gradients(model, step, snapshot)

        measure = _Measure(reference, bounds, names)
        root = _squared_errors(coarse, reference)
        report.before = measure.observed(coarse, reference)
        del coarse
        frontier: list[tuple[list[str], torch.Tensor]] = [(candidates, root)]
        chosen: dict[str, Contribution] = {}
        # the measured union of the groups over the sum of their measures, per parameter: a
        # bias the layers share adds their errors in line, not in quadrature (ReXNet: halves
        # whose squares summed within 0.02, the whole at 0.027)
        inflation = torch.ones_like(root)
        verified: tuple[frozenset[str], tuple[float, float]] | None = None
        while frontier:
            predicted = sum((v for _, v in frontier), torch.zeros_like(root))
            excess, at = measure.excess(predicted * inflation)
            if excess <= 1.0:
                if len(frontier) == 1 or report.passes + 1 > bounds.passes:
                    break  # one group's measure is its union's
                left_now = frozenset(n for g, _ in frontier for n in g)
                grads = run(set(left_now))
                observed = _squared_errors(grads, reference)
                verified = (left_now, measure.observed(grads, reference))
                del grads
                if measure.excess(observed)[0] <= 1.0:
                    break
                ratio = torch.where(predicted > 0, observed / predicted.clamp_min(1e-300),
                                    torch.ones_like(predicted))
                inflation = torch.maximum(inflation, ratio)
                continue
            index = max(range(len(frontier)), key=lambda i, at=at: _share(frontier[i][1], at))
            group, squared = frontier.pop(index)
            if len(group) == 1:
                found = chosen[group[0]] = measure.contribution(group[0], squared,
                                                                sizes[group[0]])
                # its repeats (its role, its size: the same layer in the blocks of one stage)
                # follow it: each one's own measure would be one draw, the role's is known to
                # matter; the groups they leave are measured again
                like = (role(group[0]), sizes[group[0]])
                for n in candidates:
                    if n not in chosen and (role(n), sizes[n]) == like:
                        chosen[n] = dataclasses.replace(found, name=n, extra_bytes=sizes[n])
                left = []
                for g, v in frontier:
                    rest = _without(g, chosen)
                    if rest and len(rest) < len(g) and report.passes < bounds.passes:
                        v = _squared_errors(run(set(rest)), reference)
                    if rest:
                        left.append((rest, v))
                frontier = left
                continue
            if report.passes + 2 > bounds.passes:  # out of steps: refine it whole
                report.exhausted = True
                for n in group:
                    chosen[n] = measure.contribution(n, squared, sizes[n])
                continue
            half = len(group) // 2
            for part in (group[:half], group[half:]):
                frontier.append((part, _squared_errors(run(set(part)), reference)))
        # the rest of such a role, as one group: refined whole where it alone exceeds the bounds
        # (one step, where splitting it again would rest each layer on a draw of its own)
        for name in sorted({role(n) for n in chosen}):
            rest = [n for n in candidates if role(n) == name and n not in chosen]
            if not rest or report.passes + 1 > bounds.passes:
                continue
            squared = _squared_errors(run(set(rest)), reference)
            if measure.excess(squared)[0] > 1.0:
                for n in rest:
                    chosen[n] = measure.contribution(n, squared, sizes[n])
        for n in candidates:
            everything[n].keep_refined = n in chosen
        report.refined = [chosen[n] for n in candidates if n in chosen]
        report.extra_bytes = sum(c.extra_bytes for c in report.refined)
        left = frozenset(candidates) - set(chosen)
        if verified is not None and verified[0] == left:
            report.after = verified[1]
        elif chosen:
            report.after = measure.observed(run(set(left)), reference)
        else:
            report.after = report.before
        for n, q in everything.items():
            q.keep_refined = n in chosen
    finally:
        snapshot.restore()
        snapshot.restore_grads()
    report.seconds = time.perf_counter() - start
    if cuda is not None:
        report.peak_bytes = torch.cuda.max_memory_allocated(cuda)
    return report


def first_images(batch: Any, n: int) -> Any:
    """The first ``n`` images of an mmengine data batch (a dict or sequence of per-image
    lists or batched tensors)."""
    if isinstance(batch, dict):
        return {k: first_images(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple, torch.Tensor)):
        return batch[:n]
    return batch


def agree_across_ranks(model: nn.Module) -> None:
    """Under torch.distributed, refine a layer wherever any rank chose it: the search decides
    on errors summed over the ranks, so their choices agree already; resuming from rank 0's
    checkpoint must give every rank one choice whatever made them differ."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    quantizers = [q for q in _quantizers(model).values() if q.spec.bits == 8]
    device = next((p.device for p in model.parameters()), torch.device('cpu'))
    if dist.get_backend() == 'nccl' and device.type != 'cuda':
        device = torch.device('cuda', torch.cuda.current_device())
    flags = torch.tensor([q.keep_refined for q in quantizers], dtype=torch.uint8,
                         device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    for q, flag in zip(quantizers, flags.tolist()):
        q.keep_refined = bool(flag)
