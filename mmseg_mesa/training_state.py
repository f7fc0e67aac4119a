"""What a Mesa training run holds besides the model's state dict, for checkpoints.

Every ``ActivationQuantizer`` keeps running estimates of its groups' ranges (non-persistent
buffers, so that ``state_dict`` keys stay plain mmseg's), and stochastic rounding draws from a
stream whose position advances with every pack (``rounding``). A run resumed without them
restarts every estimate from its next batch and redraws the rounding noise, so it drifts from
the uninterrupted run. ``training_state`` gathers both into one plain dict of tensors and ints
(loadable with ``torch.load(weights_only=True)``) that a checkpoint keeps beside its state dict;
``restore_training_state`` puts them back into a converted model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .quantizer import ActivationQuantizer
from .rounding import check_rounding_state, restore_rounding_state, rounding_state

STATE_FORMAT = 1
ESTIMATES = ('lower', 'span', 'seen')
# The replay errors of attention operands the host has received (``host.LateReading``s of the
# quantizer), beside the estimates where one was measured: fp64 ``[value, calls made]`` (a
# state saved before calls were counted holds the value alone); a resumed run measures and
# decides from them as the uninterrupted one would.
READINGS = ('replay_error', 'map_error')
# Whether the quantizer keeps refined codes by the calibration's choice
# (``ActivationQuantizer.keep_refined``, ``calibration``): a bool, present where it does; a
# resumed run keeps the choice rather than calibrating again.
REFINED = 'refined'


# Quantizers made lazily live under ``<module>.mesa_sites.<key>``.
DEFERRED_SEPARATOR = '.mesa_sites.'


def load_estimates(quantizer: ActivationQuantizer, values: dict[str, torch.Tensor]) -> None:
    """Put saved running estimates into ``quantizer``, in place, on its device."""
    device = quantizer.lower.device
    with torch.no_grad():
        for key in ESTIMATES:
            value = values[key]
            buffer = getattr(quantizer, key)
            # in place: wrappers that hold the buffers keep valid references
            buffer.resize_(value.shape).copy_(value.to(device=device, dtype=buffer.dtype))
    for key in READINGS:
        reading = values.get(key)
        if reading is None:
            getattr(quantizer, key).restore(None)
        else:
            value, *calls = reading.reshape(-1).tolist()
            getattr(quantizer, key).restore(value, int(calls[0]) if calls else 0)
    quantizer.keep_refined = bool(values[REFINED]) if REFINED in values else False


def _calls_valid(reading: torch.Tensor) -> bool:
    """Whether a saved reading's count of calls, where it has one, is a count."""
    if reading.numel() == 1:
        return True
    calls = float(reading.reshape(-1)[1])
    return calls >= 0 and calls == int(calls)


def _entry(quantizer: ActivationQuantizer) -> dict[str, torch.Tensor]:
    entry = {key: getattr(quantizer, key).detach().cpu().clone() for key in ESTIMATES}
    for key in READINGS:
        value, calls = getattr(quantizer, key).state()
        if value is not None:
            entry[key] = torch.tensor([value, calls], dtype=torch.float64)
    if quantizer.keep_refined:
        entry[REFINED] = torch.tensor(True)
    return entry


def quantizers(model: nn.Module) -> dict[str, ActivationQuantizer]:
    """The model's quantizers by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ActivationQuantizer)}


def training_state(model: nn.Module) -> dict[str, Any]:
    """``{'format', 'estimates': {quantizer name: {lower, span, seen[, READINGS, REFINED]}},
    'rounding'}``: every quantizer's estimates (CPU copies; empty where it has seen no batch, as
    where the layer saves another layer's codes), the replay errors it has received where it
    measured them, and the rounding streams' positions."""
    estimates = {name: _entry(quantizer) for name, quantizer in quantizers(model).items()}
    return {'format': STATE_FORMAT, 'estimates': estimates, 'rounding': rounding_state()}


@dataclass
class RestoreReport:
    """What ``restore_training_state`` did: quantizers restored, quantizers of the model the
    state had nothing for (they start from their next batch), and saved estimates that matched
    no quantizer of the model (another model or preset)."""

    restored: int = 0
    fresh: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)

    def format(self) -> str:
        def names(items: list[str]) -> str:
            return ', '.join(items[:3]) + (', ...' if len(items) > 3 else '')

        text = f'restored the running estimates of {self.restored} quantizers'
        if self.fresh:
            text += (f'; {len(self.fresh)} start from their next batch '
                     f'(none saved: {names(self.fresh)})')
        if self.unused:
            text += f'; {len(self.unused)} saved ones match no quantizer ({names(self.unused)})'
        return text


def _check(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get('format') != STATE_FORMAT \
            or not isinstance(state.get('estimates'), dict) \
            or not isinstance(state.get('rounding'), dict):
        raise ValueError(f'restore_training_state: not a Mesa training state of format '
                         f'{STATE_FORMAT} (a dict with format, estimates and rounding); got '
                         f'{type(state).__name__}'
                         + (f' with keys {sorted(state)}' if isinstance(state, dict) else ''))
    for name, saved in state['estimates'].items():
        keys = set(saved) if isinstance(saved, dict) else set()
        if not isinstance(saved, dict) \
                or not set(ESTIMATES) <= keys <= {*ESTIMATES, *READINGS, REFINED} \
                or not all(isinstance(saved[k], torch.Tensor) for k in ESTIMATES) \
                or len({saved[k].shape for k in ESTIMATES}) != 1 or saved['lower'].dim() != 1:
            raise ValueError(f'restore_training_state: the estimates of {name!r} are not three '
                             f'1-D tensors {ESTIMATES} of one length (and {READINGS})')
        for key in READINGS:
            if key in saved and not (isinstance(saved[key], torch.Tensor)
                                     and saved[key].numel() in (1, 2)
                                     and _calls_valid(saved[key])):
                raise ValueError(f'restore_training_state: the {key!r} of {name!r} is not a '
                                 f'value and a count of calls')
        if REFINED in saved and not (isinstance(saved[REFINED], torch.Tensor)
                                     and saved[REFINED].dtype == torch.bool
                                     and saved[REFINED].numel() == 1):
            raise ValueError(f'restore_training_state: the {REFINED!r} of {name!r} is not one '
                             f'bool')
    check_rounding_state(state['rounding'])
    return state


def restore_training_state(model: nn.Module, state: dict[str, Any]) -> RestoreReport:
    """Put ``training_state``'s estimates into the model's quantizers of the same names (in
    place, on each quantizer's device) and restore the rounding streams.

    A malformed state raises a ValueError naming what is wrong, before anything is changed.
    """
    state = _check(state)
    saved = state['estimates']
    report = RestoreReport()
    owned = quantizers(model)
    for name, quantizer in owned.items():
        if name not in saved:
            report.fresh.append(name)
            continue
        load_estimates(quantizer, saved[name])
        report.restored += 1
    modules = dict(model.named_modules())
    for name in sorted(set(saved) - set(owned)):
        # a quantizer made at a module's first call (``MesaFunctional``'s call sites): the
        # module keeps its estimates until it makes it
        owner, found, key = f'.{name}'.rpartition(DEFERRED_SEPARATOR)
        module = modules.get(owner[1:]) if found else None
        if module is not None and hasattr(module, 'mesa_defer_estimates'):
            module.mesa_defer_estimates(key, saved[name])
            report.restored += 1
        else:
            report.unused.append(name)
    restore_rounding_state(state['rounding'])
    return report
