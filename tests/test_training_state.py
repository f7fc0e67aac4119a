"""A checkpoint keeps Mesa's running estimates and rounding-stream position, and a model that
restores them continues as the uninterrupted one (``mmseg_mesa.training_state``)."""
import copy
import io

import pytest
import torch
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.quantizer import reset_rounding_generators
from mmseg_mesa.rounding import restore_rounding_state, rounding_counter, rounding_state
from mmseg_mesa.training_state import quantizers, restore_training_state, training_state


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 6, 16, generator=gen) * (1 + step)


def step(model, optimizer, k):
    optimizer.zero_grad()
    model(batch(k)).pow(2).mean().backward()
    optimizer.step()


def round_trip(state):
    """Through a file as a checkpoint stores it, loaded the way torch >= 2.6 loads by default."""
    buf = io.BytesIO()
    torch.save({'mesa': state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)['mesa']


def continued_from(state, weights, config):
    """A fresh converted model with ``weights``, the state restored (or not), after step 2."""
    model = make_model()
    convert_to_mesa(model, config=config)
    model.load_state_dict(weights)
    report = restore_training_state(model, state) if state is not None else None
    return model, report


@pytest.mark.parametrize('config', [MesaConfig(), MesaConfig(stochastic_rounding=False)],
                         ids=['stochastic', 'nearest'])
def test_restored_model_continues_as_the_uninterrupted_one(config):
    model = make_model()
    convert_to_mesa(model, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(2):
        step(model, optimizer, k)
    state = round_trip(training_state(model))
    weights = copy.deepcopy(model.state_dict())
    assert set(weights) == set(make_model().state_dict())  # keys stay plain torch's
    saved = {name: q.lower.clone() for name, q in quantizers(model).items()}
    assert set(state['estimates']) == set(saved)
    # the last Linear saves the LayerNorm's codes: its own quantizer has nothing to keep; GELU's
    # input is tokens, whose input it keeps (its quantizer for feature maps' derivatives idles)
    assert [n for n, q in quantizers(model).items() if not q.seen.numel()] == \
        ['1.quant_derivative', '3.quant_input']
    step(model, optimizer, 2)
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = {name: (q.lower.clone(), q.span.clone()) for name, q in quantizers(model).items()}

    def resumed(restore):
        reset_rounding_generators()  # a new process: the stream would start over
        other, report = continued_from(state if restore else None, weights, config)
        if restore:
            assert report.restored == 5 and not report.fresh and not report.unused
            # the first resumed step starts from the saved ranges, not from its own batch
            for name, q in quantizers(other).items():
                assert torch.equal(q.lower, saved[name]) and q.seen.all()
                assert q.seen.numel() == (name != '3.quant_input') * q.lower.numel()
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        step(other, opt, 2)
        return other

    other = resumed(restore=True)
    for name, param in other.named_parameters():
        assert torch.equal(param, uninterrupted[name]), name
    for name, q in quantizers(other).items():  # the EMA went on from the saved estimates
        assert torch.equal(q.lower, after[name][0]) and torch.equal(q.span, after[name][1])
    # Without the state the step differs: the estimates restart from the batch (and the
    # stochastic rounding draws restart), which is what resuming used to do.
    fresh = resumed(restore=False)
    assert any(not torch.equal(p, uninterrupted[n]) for n, p in fresh.named_parameters())


def test_rounding_stream_position_is_in_the_state():
    model = make_model()
    convert_to_mesa(model, config=MesaConfig())
    model(batch(0)).sum().backward()
    state = training_state(model)
    torch_seed, _, offset = state['rounding']['cpu']
    assert torch_seed == torch.initial_seed() and offset > 0
    reset_rounding_generators()
    assert rounding_state() == {}
    restore_training_state(model, round_trip(state))
    assert rounding_state() == state['rounding']


def test_a_stream_not_begun_in_the_state_begins_again():
    """A state saved before any rounding restores no stream as begun: draws made since are
    forgotten, and the next call draws from offset 0, as the first after that state did."""
    state = rounding_state()
    assert state == {}
    first = rounding_counter('cpu', 100)
    assert first[1] == 0 and rounding_counter('cpu', 100)[1] > 0
    restore_rounding_state(state)
    assert rounding_state() == {} and rounding_counter('cpu', 100) == first


def test_state_of_another_model_restores_what_matches_and_says_what_not():
    model = make_model()
    convert_to_mesa(model, config=MesaConfig())
    model(batch(0)).sum().backward()
    state = training_state(model)
    state['estimates']['9.quant_input'] = state['estimates'].pop('0.quant_input')
    other = make_model()
    convert_to_mesa(other, config=MesaConfig())
    report = restore_training_state(other, state)
    assert report.restored == 4 and report.fresh == ['0.quant_input']
    assert report.unused == ['9.quant_input']
    assert 'start from their next batch' in report.format()
    assert quantizers(other)['0.quant_input'].seen.numel() == 0
    assert quantizers(other)['1.quant_input'].seen.all()


@pytest.mark.parametrize('mutate, message', [
    (lambda s: s.update(format=99), 'not a Mesa training state'),
    (lambda s: s.pop('rounding'), 'not a Mesa training state'),
    (lambda s: s['estimates']['0.quant_input'].pop('seen'), "estimates of '0.quant_input'"),
    (lambda s: s['estimates']['0.quant_input'].update(span=torch.zeros(3)),
     "estimates of '0.quant_input'"),
    (lambda s: s['rounding'].update(cpu=[1, 2]), 'rounding state'),
])
def test_malformed_state_is_refused_before_anything_changes(mutate, message):
    model = make_model()
    convert_to_mesa(model, config=MesaConfig())
    model(batch(0)).sum().backward()
    state = training_state(model)
    mutate(state)
    other = make_model()
    convert_to_mesa(other, config=MesaConfig())
    reset_rounding_generators()
    with pytest.raises(ValueError, match=message):
        restore_training_state(other, state)
    assert all(q.seen.numel() == 0 for q in quantizers(other).values())
    assert rounding_state() == {}


def test_hook_saves_the_state_beside_plain_keys_and_loads_checkpoints_without_it():
    """MesaHook's checkpoint hooks: the state goes under its own key, the state dict is the
    model's own; a checkpoint without the key (plain mmseg's) loads, estimates untouched."""
    pytest.importorskip('mmengine')
    import logging
    from types import SimpleNamespace

    from mmseg_mesa.integrations.hook import CHECKPOINT_KEY, MesaHook

    def runner_of(model):
        return SimpleNamespace(model=model, logger=logging.getLogger('mesa-test'),
                               cfg=SimpleNamespace(get=lambda key, default=None: None))

    model = make_model()
    hook = MesaHook(mesa=True)
    hook.before_run(runner_of(model))
    model(batch(0)).sum().backward()
    checkpoint = {'state_dict': model.state_dict()}
    hook.before_save_checkpoint(runner_of(model), checkpoint)
    assert set(checkpoint['state_dict']) == set(make_model().state_dict())
    assert set(checkpoint[CHECKPOINT_KEY]['estimates']) == set(quantizers(model))

    other = make_model()
    other_hook = MesaHook(mesa=True)
    other_hook.before_run(runner_of(other))
    other_hook.after_load_checkpoint(runner_of(other), {'state_dict': other.state_dict()})
    assert all(q.seen.numel() == 0 for q in quantizers(other).values())
    other_hook.after_load_checkpoint(runner_of(other), round_trip_checkpoint(checkpoint))
    for name, q in quantizers(other).items():
        assert torch.equal(q.lower, quantizers(model)[name].lower)


def round_trip_checkpoint(checkpoint):
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class OwnGelu(nn.Module):
    """A block whose own forward calls ``F.gelu`` and a product: the generic path makes its
    call sites' quantizers at its first training step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x)) * self.scale


def test_call_sites_made_at_the_first_step_resume_from_the_saved_estimates():
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(OwnGelu(), nn.Linear(32, 8))
        convert_to_mesa(model)
        return model

    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(2):
        step(model, optimizer, k)
    sites = [n for n in quantizers(model) if '.mesa_sites.' in n]
    assert sites  # the generic path's quantizers, made in the first step
    state = round_trip(training_state(model))
    weights = copy.deepcopy(model.state_dict())
    step(model, optimizer, 2)
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}

    reset_rounding_generators()
    other = build()
    other.load_state_dict(weights)
    report = restore_training_state(other, state)
    assert not report.unused and report.restored == len(state['estimates'])
    assert not any('.mesa_sites.' in n for n in quantizers(other))  # not made yet
    step(other, torch.optim.SGD(other.parameters(), lr=0.1), 2)
    for name, param in other.named_parameters():
        assert torch.equal(param, uninterrupted[name]), name


def test_attention_replay_errors_travel_with_the_state():
    """The replay error each attention quantizer received (``host.LateReading``) is part of the
    state: a resumed run refines its first call as the uninterrupted run would."""
    def attention_model():
        torch.manual_seed(0)
        model = nn.Sequential(nn.MultiheadAttention(16, 2, batch_first=True))
        convert_to_mesa(model, config=MesaConfig())
        return model

    model = attention_model()
    x = torch.randn(2, 8, 16)
    for _ in range(2):
        model[0](x, x, x)[0].sum().backward()
    readings = {name: q.replay_error.state() for name, q in quantizers(model).items()
                if q.replay_error.value is not None}
    assert all(calls == 2 for _, calls in readings.values())
    assert readings  # q's quantizer measured one
    state = round_trip(training_state(model))
    fresh = attention_model()
    restore_training_state(fresh, state)
    assert {name: q.replay_error.state() for name, q in quantizers(fresh).items()
            if name in readings} == readings
    name = next(iter(readings))
    for bad in (torch.zeros(3, dtype=torch.float64), torch.tensor([0.1, -1.0]),
                torch.tensor([0.1, 2.5])):
        state['estimates'][name]['replay_error'] = bad
        with pytest.raises(ValueError, match='not a value and a count of calls'):
            restore_training_state(fresh, state)
    state['estimates'][name]['replay_error'] = torch.tensor(0.25, dtype=torch.float64)
    restore_training_state(fresh, state)  # saved before calls were counted: due at once
    assert quantizers(fresh)[name].replay_error.state() == (0.25, 0)
