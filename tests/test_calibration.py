"""The calibration (``mmseg_mesa.calibration``): it finds the layer whose 8-bit codes break the
gradient and refines that one, leaves a model that holds alone in two steps, changes nothing
else about the run, and its choice survives the training state."""
import copy

import pytest
import torch
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.calibration import calibrate, first_images, refined_layers, role
from mmseg_mesa.config import Calibration
from mmseg_mesa.quantizer import ActivationQuantizer, Packed, QuantSpec, Refined
from mmseg_mesa.rounding import reset_rounding_generators, rounding_state
from mmseg_mesa.training_state import restore_training_state, training_state


class Toy(nn.Module):
    """Four blocks of Linear + GELU, a BatchNorm and a head; ``spiky`` adds to the second block's
    input a small side branch (``side``, a Linear) over a fixed input whose channels hold one
    large outlier over small values (as ConViT's positional projection reads a fixed grid):
    8-bit codes round its values to a few steps, so its weight gradient goes wrong, and little
    else: its other values are small."""

    def __init__(self, spiky: bool) -> None:
        super().__init__()
        self.spiky = spiky
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                    for _ in range(4))
        self.side = nn.Linear(8, 16)
        fixed = torch.randn(64, 8, generator=torch.Generator().manual_seed(2)) * 0.05
        fixed[0] = 80.0
        self.register_buffer('fixed', fixed)
        # the spike's row is not used: the side's gradient rests on the small values alone
        self.register_buffer('used', (torch.arange(64) > 0).float()[:, None])
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 1 and self.spiky:
                x = x + self.side(self.fixed) * self.used
            x = block(x)
        return self.head(self.norm(x))


def converted(spiky: bool, **config) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    config.setdefault('batchnorm_refine_below', 0)  # the calibration alone chooses
    torch.manual_seed(0)
    model = Toy(spiky)
    reference = copy.deepcopy(model)
    convert_to_mesa(model, config=MesaConfig(**config), module_filter_fn=lambda m, n: True)
    model.train()
    return model, reference, torch.randn(64, 16, generator=torch.Generator().manual_seed(1))


def step_of(model: nn.Module, x: torch.Tensor):
    target = torch.arange(x.shape[0]) % 3
    return lambda: nn.functional.cross_entropy(model(x), target)


def gradient(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step_of(model, x)().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(),
                                                 dim=0))


def test_the_layer_that_breaks_the_gradient_is_found_and_refined():
    model, reference, x = converted(True)
    exact = gradient(reference, x)
    before = gradient(copy.deepcopy(model), x)
    spiky = 'side.weight'
    assert cosine(before[spiky], exact[spiky]) < 0.99  # 8-bit codes break it

    report = calibrate(model, step_of(model, x), Calibration())
    assert refined_layers(model) == ['side.quant_input']
    assert [c.name for c in report.refined] == ['side.quant_input']
    found = report.refined[0]
    assert found.parameter == spiky and found.parameter_error > 0.1
    assert found.extra_bytes == model.fixed.numel()  # one more byte per value
    assert report.before[1] < 0.99 and report.after[1] > 0.995
    assert report.passes > 3 and not report.exhausted
    after = gradient(model, x)
    assert cosine(after[spiky], exact[spiky]) > 0.999


def test_a_model_that_holds_costs_a_forward_and_two_steps_and_refines_nothing():
    model, _, x = converted(False)
    report = calibrate(model, step_of(model, x), Calibration())
    assert report.passes == 3 and report.refined == [] and refined_layers(model) == []
    assert report.candidates == 10  # the inputs of four Linears and GELUs, the norm and head
    assert report.before == report.after and report.before[0] < 0.01


def test_out_of_steps_it_refines_the_groups_it_has_not_split():
    model, _, x = converted(True)
    report = calibrate(model, step_of(model, x), Calibration(passes=3))
    assert report.exhausted
    assert 'side.quant_input' in refined_layers(model)
    assert len(refined_layers(model)) > 1


def test_nothing_but_the_choice_changes():
    """Estimates, rounding streams, the random state, BatchNorm's statistics and gradients are
    what they were; the forward is bit-identical."""
    model, _, x = converted(True)
    step_of(model, x)().backward()  # a step taken: estimates, statistics and gradients exist
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = model(x).detach()
    state = training_state(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()

    calibrate(model, step_of(model, x), Calibration())
    assert refined_layers(model)
    after = training_state(model)
    assert after['rounding'] == state['rounding'] and rounding_state() == state['rounding']
    for name, entry in state['estimates'].items():
        for key in ('lower', 'span', 'seen'):
            assert torch.equal(after['estimates'][name][key], entry[key]), (name, key)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert torch.equal(model(x), out)


def test_every_step_draws_the_same_from_streams_not_begun():
    """At a run's first iteration nothing has been rounded yet: the calibration's steps each
    start from streams not begun, so equal choices give equal gradients (the 8-bit step twice
    over, as its reference refined), and the training step after it draws as without it."""
    model, _, x = converted(True)
    twin = copy.deepcopy(model)
    assert rounding_state() == {}
    report = calibrate(model, step_of(model, x), Calibration(passes=3))
    assert rounding_state() == {}
    assert report.exhausted and report.candidates == len(refined_layers(model))
    assert report.after[0] == 0.0  # every layer refined, as in the reference step
    chosen = set(refined_layers(model))
    for name, q in twin.named_modules():
        if isinstance(q, ActivationQuantizer):
            q.keep_refined = name in chosen
    got = gradient(model, x)
    reset_rounding_generators()
    want = gradient(twin, x)
    for name, g in want.items():
        assert torch.equal(got[name], g), name


def test_keep_refined_makes_every_pack_refined():
    x = torch.randn(4, 6, 5)
    q = ActivationQuantizer(QuantSpec(bits=8, group_dim=1))
    assert isinstance(q.pack(x), Packed)
    q.keep_refined = True
    assert isinstance(q.pack(x), Refined)
    mean, rstd = x.mean((0, 2)), x.var((0, 2)).add(1e-5).rsqrt()
    assert isinstance(q.pack_standardized(x, mean, rstd), Refined)


def test_the_training_state_keeps_the_choice():
    model, _, x = converted(True)
    calibrate(model, step_of(model, x), Calibration())
    state = training_state(model)
    chosen = refined_layers(model)
    assert [n for n, e in state['estimates'].items() if 'refined' in e] == chosen
    fresh, _, _ = converted(True)
    step_of(fresh, x)()
    restore_training_state(fresh, state)
    assert refined_layers(fresh) == chosen
    # a state without the key (saved before any calibration) keeps 8 bits
    for entry in state['estimates'].values():
        entry.pop('refined', None)
    restore_training_state(fresh, state)
    assert refined_layers(fresh) == []
    bad = training_state(model)
    next(iter(bad['estimates'].values()))['refined'] = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match='refined'):
        restore_training_state(fresh, bad)


def test_config():
    assert MesaConfig().calibrate == Calibration()  # on by default
    assert MesaConfig(calibrate=True).calibrate == Calibration()
    assert MesaConfig(calibrate=False).calibrate is None
    assert MesaConfig.from_cfg(dict(calibrate=False)).calibrate is None
    assert MesaConfig(calibrate=dict(cosine=0.999)).calibrate.cosine == 0.999
    with pytest.raises(ValueError, match='calibrate'):
        MesaConfig(calibrate=dict(bound=1))
    with pytest.raises(ValueError, match='calibrate.error'):
        Calibration(error=0)
    with pytest.raises(ValueError, match='calibrate.passes'):
        Calibration(passes=0)


def test_roles_and_first_images():
    assert role('backbone.blocks.10.attn.pos_proj.quant_input') == \
        'backbone.blocks.#.attn.pos_proj.quant_input'
    images = [torch.full((3,), float(i)) for i in range(4)]
    first = first_images(dict(inputs=images, data_samples=['a', 'b', 'c', 'd']), 2)
    assert first['data_samples'] == ['a', 'b'] and first['inputs'] == images[:2]
    assert torch.equal(first_images(torch.stack(images), 3), torch.stack(images[:3]))


class Twins(nn.Module):
    """One Linear read by two GELUs of one input: their codes round alike (GELU rounds to
    nearest), so their errors in the Linear's gradient add in line, not in quadrature as those
    of independent draws would."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.acts = nn.ModuleList(nn.GELU() for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        return self.head(self.acts[0](y) + self.acts[1](y))


def twins() -> nn.Module:
    torch.manual_seed(0)
    model = Twins()
    # the GELUs alone are converted: each half of the search is one of them
    convert_to_mesa(model, config=MesaConfig(batchnorm_refine_below=0, skip=('first', 'head')),
                    module_filter_fn=lambda m, n: True)
    return model.train()


def test_a_union_that_errs_in_line_is_measured_not_predicted():
    """Halves whose squared errors sum within the bound, whose union exceeds it: the union is
    measured and both are refined."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    model = twins()
    whole = calibrate(model, step_of(model, x), Calibration(error=1.0, cosine=0.01)).before[0]
    bound = 0.85 * whole  # above the halves' sum in quadrature, whole / sqrt(2)
    model = twins()
    report = calibrate(model, step_of(model, x), Calibration(error=bound, cosine=0.01))
    assert report.candidates == 2
    assert refined_layers(model) == ['acts.0.quant_input', 'acts.1.quant_input']
    assert report.before[0] > bound >= report.after[0]
    alone = [c.error for c in report.refined]  # each measured alone: about half the whole
    assert all(e * e * 2 < bound * bound for e in alone)


def test_refined_codes_of_a_constant_group_are_exact():
    """A group of one value (MaskFormer's first decoder self-attention reads one) is exact at
    8 bits; its refined codes, the calibration's reference, must be too (the fine codes' grid
    has an exact 0: they decoded 1/255 off it before)."""
    from mmseg_mesa.quantizer import unpack
    x = torch.full((10, 2, 4), 0.3)
    x[..., 1] = torch.randn(10, 2, generator=torch.Generator().manual_seed(0))
    quantizer = ActivationQuantizer(QuantSpec()).train()
    assert torch.equal(unpack(quantizer.pack(x))[..., 0], x[..., 0])
    refined = unpack(quantizer.pack(x, refined=True))
    assert torch.equal(refined[..., 0], x[..., 0])
    torch.testing.assert_close(refined, x, rtol=0, atol=1e-4)
