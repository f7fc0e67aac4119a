"""What the host may read of a device's values without waiting for the device.

On a GPU the host queues kernels ahead of the device; reading a value the device computes
(``.item()``, ``bool(t)``) makes it wait until the queue has drained. Mesa's layers make no such
read on a device: a decision that needs a measured value takes it from a ``LateReading``, which
the host receives without waiting, a call late. On CPU a read costs nothing, and a layer may
branch on one where that saves work (``reads_wait`` says where not); ``device_path()`` makes the
CPU take the device's branches, so that tests can count what a device step would read.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_DEVICE_PATH = [0]


def reads_wait(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host would wait for a device (always inside
    ``device_path``)."""
    return not t.is_cpu or _DEVICE_PATH[0] > 0


@contextlib.contextmanager
def device_path() -> Iterator[None]:
    """Inside, the CPU takes the branches a device takes (``reads_wait`` is true)."""
    _DEVICE_PATH[0] += 1
    try:
        yield
    finally:
        _DEVICE_PATH[0] -= 1


# A ``LateReading`` measures at its first call and at every ``MEASURE_EVERY``-th call after;
# between, the layer decides from the value it has. The measure (a few sampled rows decoded and
# multiplied: DeiT-S's attention spent 7 of its kernel ops per call on it) then costs an eighth
# of it per step, and what it tracks moves with the running estimates, whose EMA (decay 0.9)
# forgets over about ten steps: a decision at most eight steps old.
MEASURE_EVERY = 8
_EVERY_CALL = [0]


@contextlib.contextmanager
def measuring_every_call() -> Iterator[None]:
    """Inside, every ``LateReading`` call measures (what a step costs where all are due:
    benchmarks count it to average a step over ``MEASURE_EVERY``)."""
    _EVERY_CALL[0] += 1
    try:
        yield
    finally:
        _EVERY_CALL[0] -= 1


class LateReading:
    """The newest value of a scalar that a layer measures on its device, as the host has it
    without waiting.

    ``update(measure)`` calls ``measure`` at the first call and every ``MEASURE_EVERY``-th after,
    queues a copy of the 0-d tensor it returns for the host (into pinned memory behind the work
    that computes it, on a GPU), and returns the newest value that had arrived before: on a GPU
    long done by then. Only the first call, with nothing received yet, reads its own value (one
    wait for the whole run). Every device takes this path, the CPU too, so that a decision made
    from the value is the same on all of them. ``state()`` (the value and the calls made) is
    part of a run's training state (``training_state``), so that a resumed run measures and
    decides as the uninterrupted one would.
    """

    __slots__ = ('value', 'calls', '_pending')

    def __init__(self) -> None:
        self.value: float | None = None
        self.calls = 0
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def update(self, measure: Callable[[], torch.Tensor]) -> float:
        """``measure()`` queued where this call is due to measure; the newest value received
        before it."""
        self._receive()
        due = self.calls % MEASURE_EVERY == 0 or self.value is None or _EVERY_CALL[0] > 0
        self.calls += 1
        if not due:
            return self.value
        x = measure().detach()
        if self.value is None:
            self.value = float(x)  # the first call: nothing received yet
        if x.is_cuda:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)
        else:  # a result no one else holds: read at the next call
            self._pending = (x, None)
        return self.value

    def _receive(self) -> None:
        """Take the queued value where it has arrived (``Event.query`` does not wait)."""
        if self._pending is None:
            return
        host, event = self._pending
        if event is None or event.query():
            self.value = float(host.tolist())  # host memory: no dispatch, no wait
            self._pending = None

    def state(self) -> tuple[float | None, int]:
        """The value a resumed run starts from, the newest received or queued (the queued one
        read now, which waits only for it: this is checkpointing, not a step), and the calls
        made."""
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].synchronize()
        self._receive()
        return self.value, self.calls

    def restore(self, value: float | None, calls: int = 0) -> None:
        self.value = value
        self.calls = calls
        self._pending = None

    def __getstate__(self) -> tuple[float | None, int]:
        # copies (deepcopy, pickle) take what has been received: an event does not copy (a
        # tuple: a state of None would skip __setstate__)
        self._receive()
        return self.value, self.calls

    def __setstate__(self, state: tuple) -> None:
        self.restore(*state)
