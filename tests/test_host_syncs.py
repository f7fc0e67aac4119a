"""A Mesa training step never makes the host wait for the device.

Syncing ops (``.item()``, ``bool(t)``, ``nonzero``, ``unique``, indexing with a bool mask) are
counted where torch dispatches them (``bench.dispatch``), on CPU with the CPU taking the
branches a device takes (``host.device_path``). Decisions that need a measured value take it
from a ``host.LateReading``: a call late, but for the first.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from mmseg_models import DEIT_S, SWIN_T, batch, build_model

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.bench.dispatch import added_syncs, count_step, step_counts
from mmseg_mesa.host import MEASURE_EVERY, LateReading, device_path, reads_wait
from mmseg_mesa.layers.attention_core import CompactMask, MesaAttentionFunction
from mmseg_mesa.quantizer import (
    ActivationQuantizer,
    Packed,
    QuantSpec,
    Refined,
    reset_rounding_generators,
)
from mmseg_mesa.saved import load

SEGFORMER_B0 = 'segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py'


def measured(value: float, dtype: torch.dtype = torch.float32):
    """A measure that returns ``value`` and records that it ran."""
    def measure() -> torch.Tensor:
        measure.ran = True
        return torch.tensor(value, dtype=dtype)
    measure.ran = False
    return measure


def test_a_late_reading_gives_the_previous_value_but_at_the_first_call():
    reading = LateReading()
    assert reading.update(measured(0.5)) == 0.5  # nothing received yet: its own
    for _ in range(MEASURE_EVERY - 1):  # not due: nothing measured, the first value kept
        measure = measured(0.7)
        assert reading.update(measure) == 0.5
        assert not measure.ran
    measure = measured(0.9)
    assert reading.update(measure) == 0.5  # due: measured, received at the next call
    assert measure.ran
    assert reading.update(measured(0.1)) == pytest.approx(0.9)
    assert reading.state() == (pytest.approx(0.9), MEASURE_EVERY + 2)  # checkpoints: the newest
    for copied in (copy.deepcopy(reading), pickle.loads(pickle.dumps(reading))):
        assert (copied.value, copied.calls) == (pytest.approx(0.9), MEASURE_EVERY + 2)
    reading.restore(0.1)  # calls 0: the next call is due
    assert reading.update(measured(2.0)) == pytest.approx(0.1)
    for dtype in (torch.bfloat16, torch.float16):  # under autocast
        reading.restore(2.0)
        assert reading.update(measured(3.0, dtype)) == 2.0
        assert reading.state() == (3.0, 1)


def test_a_reading_measures_every_few_calls():
    """Which calls of a reading measure: the first and every ``MEASURE_EVERY``-th after, the same
    after a restore of the state."""
    def ran(reading: LateReading, calls: int) -> list[int]:
        out = []
        for call in range(calls):
            measure = measured(float(call))
            reading.update(measure)
            if measure.ran:
                out.append(call)
        return out

    reading = LateReading()
    assert ran(reading, 3 * MEASURE_EVERY + 1) == [0, MEASURE_EVERY, 2 * MEASURE_EVERY,
                                                   3 * MEASURE_EVERY]
    resumed = LateReading()
    resumed.restore(*reading.state())
    assert ran(resumed, MEASURE_EVERY) == ran(reading, MEASURE_EVERY) == [MEASURE_EVERY - 1]


def test_reads_wait_on_a_device_or_on_its_path():
    x = torch.zeros(())
    assert not reads_wait(x)
    with device_path():
        assert reads_wait(x)
    assert not reads_wait(x)


def quantizers() -> tuple[ActivationQuantizer, ...]:
    limit = MesaConfig().attention_refine_error
    return tuple(ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=1,
                                               refine_error=limit)) for _ in range(3))


def test_attention_refines_from_the_last_measured_replay_error():
    """Logits that grow sharp after the first call (scale 0.1, then 1: 8 bits replay them 0.3
    off) refine from the call after the next measure: the host has that call's error only
    then."""
    quants = quantizers()
    kinds = []
    for scale in (0.1,) + (1.0,) * (MEASURE_EVERY + 1):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 64, 16, generator=gen) * scale for _ in range(3))
        out = MesaAttentionFunction.apply(q.requires_grad_(), k, v, None, None, None, None, 0.0,
                                          False, quants)
        kinds.append(type(load(out.grad_fn)[0]))
    assert kinds == [Packed] * (MEASURE_EVERY + 1) + [Refined]
    assert quants[0].replay_error.value > MesaConfig().attention_refine_error


def test_masks_stay_exact_without_reading_the_device():
    two = torch.where(torch.rand(4, 1, 9, 9) < 0.5, -100.0, 0.0)
    with device_path():
        kept = CompactMask.of(two)
    assert kept.bits is None and kept.restore() is two  # the mask itself
    hidden = torch.rand(2, 1, 9, 9) < 0.3
    with device_path(), _no_syncs():
        compact = CompactMask.two_valued(hidden, 0.0, float('-inf'))
        restored = compact.restore()
    assert compact.bits is not None
    assert torch.equal(restored, torch.where(hidden, float('-inf'), 0.0))


class _no_syncs:
    """Asserts that the block dispatches no syncing op."""

    def __enter__(self):
        from mmseg_mesa.bench.dispatch import CountDispatch
        self.mode = CountDispatch().__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        assert not self.mode.count.syncs, self.mode.count.syncs


@pytest.mark.parametrize('kind', ['bool', 'float'])
def test_multihead_attention_with_a_mask_on_the_device_path(kind):
    """A boolean mask is kept as bits without reading it; a float one in full: the gradients
    are those of the CPU's branch, which reads the mask to keep bits."""
    torch.manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.MultiheadAttention(32, 4, batch_first=True))
    convert_to_mesa(holder, config=MesaConfig())
    assert type(holder[0]).__name__ == 'MesaMultiheadAttention'
    x = torch.randn(2, 10, 32)
    hidden = torch.rand(2 * 4, 10, 10) < 0.3
    hidden[..., 0] = False  # no row hidden entirely
    mask = hidden if kind == 'bool' else torch.where(hidden, -100.0, 0.0)
    holder[0](x, x, x, attn_mask=mask)[0].sum().backward()  # a first call reads its own error

    def grads(on_device: bool) -> list[torch.Tensor]:
        model = copy.deepcopy(holder[0])  # the same estimates and readings
        reset_rounding_generators()
        with device_path() if on_device else _nothing():
            out, _ = model(x, x, x, attn_mask=mask)
            out.square().sum().backward()
        return [p.grad for p in model.parameters()]

    expected = grads(False)
    with _no_syncs():
        got = grads(True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize('name', [SWIN_T, DEIT_S, SEGFORMER_B0], ids=['swin-t', 'deit-s',
                                                                      'segformer-b0'])
def test_a_training_step_adds_no_host_sync(name):
    options = {'model.backbone.img_size': (64, 64)} if name == DEIT_S else None
    base = build_model(name, options=options)
    data = batch(64, 2)
    mesa = copy.deepcopy(base)
    convert_to_mesa(mesa, config=MesaConfig())
    counts = {mode: step_counts(model, data) for mode, model in
              (('baseline', base), ('mesa', mesa))}
    assert not counts['mesa'].mesa_syncs()
    assert added_syncs(counts['mesa'], counts['baseline']) == {}
    assert counts['mesa'].kernel_ops > counts['baseline'].kernel_ops  # it counted something


def test_the_syncs_a_step_makes_are_counted():
    """The counter sees what would wait: it is no proof of absence otherwise."""
    x = torch.randn(5)
    count = count_step(lambda: (x.max().item(), bool(x.sum() > 0), x[x > 0], x.nonzero()))
    assert set(count.sync_names()) == {'_local_scalar_dense', 'index', 'nonzero'}
    assert count.sync_ops == 4 and count.kernel_ops > 0


class OpByOpAttention(torch.nn.Module):
    """Attention written op by op (``layers.recomputed_map``): logits times a learned per-head
    temperature (XCiT's, EdgeNeXt's) or times a large number (T2T-ViT's sharp maps, which torch
    keeps: ``recomputed_map.exact_map``)."""

    def __init__(self, temperature: bool):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.temperature = torch.nn.Parameter(torch.rand(4, 1, 1) + 0.5) if temperature else None

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, -1).permute(2, 0, 3, 1, 4)
        attn = q @ k.transpose(-2, -1)
        attn = attn * self.temperature if self.temperature is not None else attn * 40.0
        return (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c)


@pytest.mark.parametrize('temperature', [True, False], ids=['temperature', 'sharp'])
def test_attention_written_op_by_op_reads_nothing_back(temperature):
    from mmseg_mesa.layers.intercept import MesaFunctional
    torch.manual_seed(0)
    ref = OpByOpAttention(temperature)
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig())
    x = torch.randn(2, 16, 32)
    ours(x).sum().backward()  # first calls read their own values
    ours.zero_grad()
    with device_path(), _no_syncs():
        out = ours(x)
        out.square().sum().backward()
    expected = ref(x)
    assert torch.equal(out, expected)
    expected.square().sum().backward()
    if not temperature:  # torch keeps the sharp map: the same gradients
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(),
                                                               ref.parameters()))
