"""The generic path: modules no handler converts keep their own forward, with the functional
activations, norms, products and fused attention it calls routed through Mesa's Functions."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import cosine
from torch import nn

from mmseg_mesa import MesaConfig, MesaModule, convert_to_mesa
from mmseg_mesa.layers.intercept import MesaFunctional, own_type
from mmseg_mesa.memory import count_saved_tensors


class Calls(nn.Module):
    """A Linear, then ``op`` called functionally in the module's own forward."""

    def __init__(self, op, channels=32):
        super().__init__()
        self.fc = nn.Linear(channels, channels)
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = nn.Parameter(torch.randn(channels) * 0.1)
        self.op = op

    def forward(self, x):
        return self.op(self, self.fc(x))


def tokens(s, h):
    return h


def nchw(h):
    """(B, N, C) tokens as a (B, C, 4, N / 4) feature map."""
    b, n, c = h.shape
    return h.transpose(1, 2).reshape(b, c, 4, n // 4)


OPS = {
    'gelu': lambda s, h: F.gelu(h),
    'gelu-tanh': lambda s, h: F.gelu(h, approximate='tanh'),
    'silu': lambda s, h: F.silu(h),
    'mish': lambda s, h: F.mish(h),
    'tanh': lambda s, h: torch.tanh(h),
    'tensor-tanh': lambda s, h: h.tanh(),
    'relu': lambda s, h: F.relu(h),
    'hardswish': lambda s, h: F.hardswish(h),
    'layer_norm': lambda s, h: F.layer_norm(h, (32,), s.weight, s.bias, 1e-6),
    'group_norm': lambda s, h: F.group_norm(nchw(h), 4, s.weight, s.bias),
    'batch_norm': lambda s, h: F.batch_norm(nchw(h), None, None, s.weight, s.bias, True),
    'normalize': lambda s, h: F.normalize(h, dim=-1) * 3,
    'normalize-heads': lambda s, h: F.normalize(h.reshape(2, 16, 4, 8).transpose(1, 2), dim=-1),
    'tensor-norm': lambda s, h: h * h.norm(2, dim=-1, keepdim=True),
    'torch-norm': lambda s, h: h * torch.norm(h, p=2, dim=(1,), keepdim=True),
    'vector_norm': lambda s, h: torch.linalg.vector_norm(h, 2, dim=1),
    'addcmul': lambda s, h: torch.addcmul(s.bias, s.weight, h * h.mean(1, keepdim=True),
                                          value=0.5),
    'swiglu': lambda s, h: F.silu(h) * h.flip(-1),
    'layer-scale': lambda s, h: h * s.weight,
    'star-relu': lambda s, h: F.relu(h) ** 2 * 0.8 - 0.4,
    'pow': lambda s, h: torch.pow(h, 3),
    'layer-norm-by-hand': lambda s, h: (h - h.mean(-1, keepdim=True)) / torch.sqrt(
        (h - h.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1e-6),
    'div': lambda s, h: h.div(h.norm(2, -1, keepdim=True) + 1),
    'amax': lambda s, h: h.view(2, 4, 4, 32).amax(dim=1),
    'amax-ties': lambda s, h: torch.amax(F.relu(h), dim=(1, 2), keepdim=True) * h,
    # a graph conv's max over neighbours; torch keeps int64 indices
    'max-dim': lambda s, h: torch.max(h.view(2, 16, 4, 8) - h.view(2, 16, 4, 8)[..., :1], -1,
                                      keepdim=True)[0],
    'min-values': lambda s, h: h.min(dim=1).values,
    'sdpa': lambda s, h: F.scaled_dot_product_attention(
        *(h.reshape(2, 16, 4, 8).transpose(1, 2),) * 3),
}


def run(module, x, grad_seed=7):
    torch.manual_seed(0)
    xi = x.clone().requires_grad_()
    y = module(xi)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)))
    return y, [xi.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize('name', list(OPS))
def test_each_route_is_bit_identical_close_in_gradient_and_keeps_less(name):
    torch.manual_seed(0)
    reference = Calls(OPS[name])
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model)
    assert '' in report.generic
    x = torch.randn(2, 16, 32)
    y_ref, grads_ref = run(reference, x)
    y, grads = run(model, x)
    assert torch.equal(y, y_ref)
    largest = max(g.norm() for g in grads_ref if g is not None)
    for got, want in zip(grads, grads_ref):
        if want is not None and want.norm() >= 1e-3 * largest:  # not an analytic zero's noise
            assert cosine(got, want) >= 0.999
            assert (got - want).norm() <= 0.03 * want.norm()
    assert isinstance(model, MesaFunctional)  # it routed its call, so its first step kept it
    xs = x.clone().requires_grad_()
    with count_saved_tensors(reference) as base:
        reference(xs)
    with count_saved_tensors(model) as mesa:
        model(xs)
    assert mesa.by_type['Calls'] < 0.7 * base.by_type['Calls']


def test_batch_norm_route_updates_running_statistics_as_torch():
    class BatchNormAct(nn.BatchNorm2d):
        """timm's ``BatchNormAct2d`` in short: ``F.batch_norm`` in a forward of its own."""

        def forward(self, x):
            return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                       self.bias, self.training, self.momentum, self.eps))

    reference = BatchNormAct(8)
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model)
    assert '' in report.generic  # the BatchNorm handler would lose its forward
    x = torch.randn(4, 8, 6, 6)
    y_ref, _ = run(reference, x)
    y, _ = run(model, x)
    assert torch.equal(y, y_ref)
    assert torch.equal(model.running_mean, reference.running_mean)
    assert torch.equal(model.running_var, reference.running_var)
    assert [k.split('_', 1)[1] for k in model.mesa_sites] == ['batchnorm_input']


def test_weight_standardized_with_batch_norm_is_left_to_torch():
    """timm's ``StdConv2d`` standardizes its weight with ``F.batch_norm``: no activation, and
    the weight's gradient would take the codes' error whole."""

    class StdConv(nn.Conv2d):
        def forward(self, x):
            w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                             training=True, momentum=0.0, eps=1e-6).reshape_as(self.weight)
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    reference = StdConv(4, 8, 3, padding=1)
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    x = torch.randn(2, 4, 8, 8)
    y_ref, grads_ref = run(reference, x)
    y, grads = run(model, x)
    assert torch.equal(y, y_ref)
    assert [k.split('_', 1)[1] for k in model.mesa_sites] == ['conv2d_input']
    assert cosine(grads[1], grads_ref[1]) >= 0.999


class Glue(nn.Module):
    """Only calls its children and adds: nothing of its own to route."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.fc(x))


def test_a_module_routing_nothing_goes_back_to_its_class_after_its_first_step():
    model = nn.Sequential(Glue(), Calls(OPS['gelu'], 8))
    report = convert_to_mesa(model)
    assert set(report.generic) == {'0', '1'}
    glue = model[0]
    assert own_type(glue) is Glue and isinstance(glue, MesaModule)
    model.eval()
    model(torch.randn(2, 8))  # not a training step: nothing probed
    assert isinstance(glue, MesaModule)
    model.train()
    x = torch.randn(2, 8, requires_grad=True)
    y = model(x)
    assert type(glue) is Glue and not hasattr(glue, 'mesa_sites')
    assert not glue.fc._forward_pre_hooks and not glue.fc._forward_hooks  # its hooks are gone
    assert isinstance(model[1], MesaFunctional)  # routed its gelu: it stays
    # the released module computes as before
    assert torch.equal(model(x), y)
    assert 'routing after a training step' in report.format()


def test_a_module_whose_input_needs_no_gradient_routes_what_its_children_made():
    """The first block after the image: its input needs no gradient, but its own calls read
    what its children computed from their trainable weights, so they are routed."""
    class Stem(nn.Module):  # no parameters of its own
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return F.gelu(self.fc(x))

    torch.manual_seed(0)
    reference = Stem()
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    x = torch.randn(2, 16, 32)  # no gradient
    y_ref = reference(x)
    y = model(x)
    assert torch.equal(y, y_ref)
    assert isinstance(model, MesaFunctional)  # its first step routed the gelu
    with count_saved_tensors(reference) as base:
        reference(x)
    with count_saved_tensors(model) as mesa:
        model(x)
    assert mesa.by_type['Stem'] < 0.7 * base.by_type['Stem']


def test_calls_with_no_route_are_reported_by_op_name():
    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x) + torch.cumsum(x, 1)  # exp keeps its output; cumsum nothing

    model = nn.Sequential(nn.Linear(64, 64), Exp())
    report = convert_to_mesa(model)
    model(torch.randn(2, 128, 64))
    assert report.left_to_torch() == {('Exp', 'exp: no Mesa route'): 1}
    assert 'Exp: exp: no Mesa route' in report.format()


def test_generic_path_switched_off_leaves_modules_with_the_reason():
    model = nn.Sequential(Calls(OPS['gelu']))
    config = MesaConfig(layers=MesaConfig().layers - {'generic'})
    report = convert_to_mesa(model, config=config)
    assert not report.generic and type(model[0]) is Calls


def test_skip_patterns_and_filters_apply_to_the_generic_path():
    model = nn.Sequential(Calls(OPS['gelu']), Calls(OPS['silu']))
    report = convert_to_mesa(model, config=MesaConfig(skip=('0',)),
                             module_filter_fn=lambda m, name: name != '1')
    assert not report.generic
    assert report.converted.keys() == {'0.fc', '1.fc'}


def test_a_forward_running_every_child_meets_no_mesa_child():
    """timm's ``RegStage`` runs ``for block in self.children()``: the generic path adds no child
    to a module that routes nothing."""

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.GELU()

        def forward(self, x):
            for block in self.children():
                x = block(x)
            return x

    reference = Stage()
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model)
    assert '' in report.generic
    x = torch.randn(2, 8, requires_grad=True)
    assert torch.equal(model(x), reference(x))
    assert type(model) is Stage



@pytest.mark.parametrize('candidates,dtype', [(9, torch.uint8), (300, torch.int16)])
def test_max_over_a_dim_keeps_its_indices_narrow_and_its_gradient_exact(candidates, dtype):
    from mmseg_mesa.layers.elementwise import MesaMaxDimFunction
    from mmseg_mesa.layers.pooling import index_dtype
    assert index_dtype(candidates) == dtype
    x = torch.randn(3, 5, candidates, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with count_saved_tensors() as saved:
        values, indices = MesaMaxDimFunction.apply(x, -1, False, lambda t: torch.max(t, -1))
    assert saved.total_bytes == 15 * dtype.itemsize
    want = torch.max(xr, -1)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
    g = torch.randn(3, 5)
    values.backward(g)
    want.values.backward(g)
    assert torch.equal(x.grad, xr.grad)
