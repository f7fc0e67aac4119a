"""16-bit codes (``bits=16``, ``layer_bits={'batchnorm': 16}``): 8-bit codes and a second 8-bit
pass over what they miss, wherever a layer packs, shares or rebuilds codes."""
import copy
import os.path as osp

import pytest
import torch
from conftest import drawn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.bench.fidelity import losses_and_gradients, relative_error
from mmseg_mesa.bench.models import build_model, load_config, make_batch
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.quantizer import (
    ActivationQuantizer,
    Packed,
    QuantSpec,
    Refined,
    pack,
    refine,
    unpack,
)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs/demo/swin-mini_upernet_demo.py')


@pytest.mark.parametrize('stochastic', [True, False])
def test_a_16_bit_spec_refines_the_8_bit_codes_it_would_have_made(stochastic):
    """The 8-bit codes and running estimates are those of an 8-bit spec (the second pass draws
    nothing from the rounding stream), and every value lies within 1/255 of a coarse step, by
    every packing path: ``pack``, ``pack_standardized`` and the module-level ``pack``."""
    from mmseg_mesa.quantizer import reset_rounding_generators
    gen = torch.Generator().manual_seed(0)
    x = drawn(torch.randn, 4, 6, 5, 7, generator=gen) * 3 + 1
    mean, rstd = x.mean((0, 2, 3)), x.var((0, 2, 3)).add(1e-5).rsqrt()
    lower, upper = x.amin((0, 2, 3)), x.amax((0, 2, 3))
    quantizers = {}
    for bits in (8, 16):
        reset_rounding_generators()
        spec = QuantSpec(bits=bits, group_dim=1, stochastic=stochastic)
        quantizers[bits] = q = ActivationQuantizer(spec)
        quantizers[bits, 'codes'] = (q.pack(x),
                                     ActivationQuantizer(spec).pack_standardized(x, mean, rstd),
                                     pack(x, spec, lower, upper - lower))
    norm = (x - mean.view(1, -1, 1, 1)) * rstd.view(1, -1, 1, 1)
    for eight, sixteen, want in zip(quantizers[8, 'codes'], quantizers[16, 'codes'],
                                    (x, norm, x)):
        assert isinstance(eight, Packed) and isinstance(sixteen, Refined)
        assert sixteen.bits == 16 and torch.equal(sixteen.coarse.data, eight.data)
        step = eight.scale.view(1, -1, 1, 1)
        assert ((unpack(eight, torch.float32) - want).abs() / step).max() > 0.45
        assert ((unpack(sixteen, torch.float32) - want).abs() / step).max() <= 1.01 / 255
    assert torch.equal(quantizers[8].lower, quantizers[16].lower)
    assert torch.equal(quantizers[8].span, quantizers[16].span)
    refined = quantizers[16, 'codes'][0]
    assert refine(refined, x) is refined  # attention refining a 16-bit layer's codes: as they are


def saved_and_gradients(model, batch):
    with count_saved_tensors(model) as report:
        model(*batch, mode='loss')
    return report.total_bytes, losses_and_gradients(model, batch)


@pytest.mark.parametrize('config', [MesaConfig(bits=16), MesaConfig(layer_bits={'batchnorm': 16})],
                         ids=['bits=16', 'batchnorm=16'])
def test_16_bit_codes_through_a_whole_model(config):
    """The demo's Swin-UPerNet (LayerNorm, GELU -> Linear sharing codes, attention, the fused
    FPN levels, BatchNorm, ReLU): forward bit-identical, a gradient much closer to torch's than
    8 bits give, and more bytes kept; BatchNorm alone at 16 bits keeps the rest at 8."""
    cfg = load_config(DEMO)
    reference = build_model(cfg, 'cpu')
    batch = make_batch(cfg, 2, (64, 64), 'cpu')
    exact_losses, exact = losses_and_gradients(reference, batch)
    results = {}
    for name, mesa in (('8', MesaConfig()), ('16', config)):
        model = copy.deepcopy(reference)
        convert_to_mesa(model, config=mesa)
        model.train()
        saved, (losses, grads) = saved_and_gradients(model, batch)
        assert all(torch.equal(losses[k], exact_losses[k]) for k in losses if 'loss' in k)
        results[name] = saved, relative_error(grads, exact)
    (saved8, error8), (saved16, error16) = results['8'], results['16']
    if config.bits == 16:
        assert error16 < error8 / 10 and 1.5 * saved8 < saved16
    else:
        assert error16 < error8 and saved8 < saved16 < 1.5 * saved8


def batchnorm_codes(count: int, **config) -> object:
    """What a converted training-mode BatchNorm keeps of a batch of ``count`` values per
    channel."""
    from mmseg_mesa.saved import load
    bn = torch.nn.BatchNorm2d(3)
    convert_to_mesa(bn, config=MesaConfig(**config))
    x = drawn(torch.randn, 1, 3, count, 1, generator=torch.Generator().manual_seed(0))
    return load(bn(x.requires_grad_()).grad_fn)[0]


@pytest.mark.parametrize('count, config, kind', [
    (255, {}, Refined), (256, {}, Packed), (2, {}, Refined),
    (255, {'batchnorm_refine_below': 0}, Packed),
    (256, {'batchnorm_refine_below': 1000}, Refined),
])
def test_batchnorm_refines_its_codes_over_few_values_per_channel(count, config, kind):
    """Batch statistics over fewer values per channel than ``batchnorm_refine_below`` (256 by
    default) keep refined codes of the normalized input; from there on 8-bit ones; 0 never."""
    codes = batchnorm_codes(count, **config)
    assert type(codes) is kind
    if kind is Refined:
        assert codes.coarse.bits == 8


def test_batchnorm_over_few_values_sends_back_a_sharper_input_gradient():
    """The refined codes reach backward: a BatchNorm over 64 values per channel (forward
    bit-identical either way) returns an input gradient far closer to torch's than its 8-bit
    codes give."""
    gen = torch.Generator().manual_seed(1)
    x = drawn(torch.randn, 2, 8, 4, 8, generator=gen) * 3 + 1
    grad = drawn(torch.randn, x.shape, generator=gen) + x  # correlated with x, as losses are
    reference = torch.nn.BatchNorm2d(8)
    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(grad)
    errors = {}
    for below in (0, 256):
        bn = torch.nn.BatchNorm2d(8)
        convert_to_mesa(bn, config=MesaConfig(batchnorm_refine_below=below))
        x_in = x.clone().requires_grad_()
        y = bn(x_in)
        assert torch.equal(y, y_ref)
        y.backward(grad)
        errors[below] = ((x_in.grad - x_ref.grad).norm() / x_ref.grad.norm()).item()
    assert errors[256] < errors[0] / 50, errors
