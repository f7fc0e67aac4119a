"""Every Mesa layer followed by an in-place op trains as torch's layer does.

Autograd refuses in-place ops on a custom Function's output that is a view (``F.linear`` of a 3-D
input returns one), and mmdet's FFN puts ``ReLU(inplace=True)`` right after a Linear; so every
Mesa Function's forward returns no view (``layers.base.returns_owned``). For each layer case and
each in-place successor: the forward is torch's bit for bit, the gradients are those of the same
Mesa layer followed by the out-of-place op (bit for bit: the in-place op changes nothing Mesa
saved) and torch's up to the layer's quantization. (Torch itself refuses some of these, where its
layer saves its output: Tanh, Sigmoid, Softmax, ReLU; Mesa saves codes of its own.)
"""
import copy
import importlib
import inspect
import pkgutil

import pytest
import torch
from conftest import cosine
from layer_cases import CASES, clones, pair, run, upstream_grad
from test_cnn_layers import CASES as CNN_CASES
from torch import nn

import mmseg_mesa
from mmseg_mesa import MesaConfig
from mmseg_mesa.layers import MesaReLU
from mmseg_mesa.quantizer import reset_rounding_generators

ALL_CASES = CASES + CNN_CASES


class Successor(nn.Module):
    """An op applied to a layer's output, in place or not."""

    def __init__(self, name, inplace):
        super().__init__()
        self.name, self.inplace = name, inplace
        self.relu = nn.ReLU(inplace=inplace)  # converted too, where the model is

    def forward(self, y):
        if self.name == 'relu_module':
            return self.relu(y)
        if self.name == 'relu_':
            return y.relu_() if self.inplace else y.relu()
        if self.name == 'add_':
            return y.add_(0.5) if self.inplace else y.add(0.5)
        if self.name == 'mul_':
            return y.mul_(1.5) if self.inplace else y.mul(1.5)
        return y.clamp_(-0.7, 0.9) if self.inplace else y.clamp(-0.7, 0.9)


SUCCESSORS = ['relu_module', 'relu_', 'add_', 'mul_', 'clamp_']


def gradients(layer, successor, xs):
    reset_rounding_generators()  # both Mesa runs draw the same rounding noise
    out = successor(run(layer, xs))
    out.backward(upstream_grad(out))
    return out, [x.grad for x in xs] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize('successor', SUCCESSORS)
@pytest.mark.parametrize('case', ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_layer_followed_by_an_inplace_op(case, successor):
    ref, ours = pair(case)
    ours_out_of_place = pair(case)[1]
    ours_out_of_place.load_state_dict(ours.state_dict())
    mesa_relu = (lambda m: MesaReLU.convert(m, MesaConfig())) if successor == 'relu_module' \
        else (lambda m: m)
    xs = case.inputs()
    # torch's layer with the out-of-place successor: the reference of forward and gradients
    # (torch itself refuses the in-place one after layers that save their output: Tanh, ...)
    y, expected = gradients(ref, Successor(successor, inplace=False), clones(xs))
    succ = Successor(successor, inplace=True)
    succ.relu = mesa_relu(succ.relu)
    y2, got = gradients(ours, succ, clones(xs))
    succ = Successor(successor, inplace=False)
    succ.relu = mesa_relu(succ.relu)
    _, out_of_place = gradients(ours_out_of_place, succ, clones(xs))
    assert torch.equal(y, y2)
    for e, g, o in zip(expected, got, out_of_place):
        assert (e is None) == (g is None)
        if g is None:
            continue
        assert torch.equal(g, o)
        if case.exact_grad:
            assert torch.equal(g, e)
        elif e.abs().max() > 0:
            assert cosine(e, g) >= 0.99


def test_every_mesa_function_returns_owned_outputs():
    """No autograd Function of the package is left without ``returns_owned``."""
    functions = []
    for info in pkgutil.walk_packages(mmseg_mesa.__path__, 'mmseg_mesa.'):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # optional integrations (mmcv, mmdet) where not installed
            continue
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, torch.autograd.Function) and obj.__module__ == info.name:
                functions.append(obj)
    assert len(functions) >= 25
    missing = [f.__qualname__ for f in functions
               if not getattr(f.forward, 'mesa_returns_owned', False)]
    assert not missing, missing


def test_mmdet_ffn_shape_linear_then_inplace_relu():
    """The pattern that stopped Mask2Former: Linear on tokens, then ReLU(inplace=True)."""
    from mmseg_mesa import convert_to_mesa
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 16))
    ours = copy.deepcopy(ref)
    convert_to_mesa(ours, config=MesaConfig())
    x = torch.randn(2, 10, 16)
    y, y2 = ref(x), ours(x.clone())
    assert torch.equal(y, y2)
    y2.sum().backward()
    y.sum().backward()
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert cosine(p.grad, q.grad) >= 0.999
