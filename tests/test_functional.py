"""MesaFunctional: a module's own functional matmuls, softmaxes, products and linears compressed."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import cosine
from torch import nn

from mmseg_mesa import MesaConfig, MesaModule
from mmseg_mesa.layers.intercept import MesaFunctional
from mmseg_mesa.memory import count_saved_tensors


class FunctionalAttention(nn.Module):
    """Attention as BEiT writes it: F.linear on a child's weight, ``@``, ``Tensor.softmax``,
    a layer-scale product with a Parameter and a gate product of two activations."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)
        self.gate = nn.Linear(dim, dim)
        self.gate_act = nn.Sigmoid()

    def forward(self, x):
        b, n, c = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q * 0.5) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, c)
        out = self.proj(out)  # a child: its F.linear is its own
        return x + self.gamma * out * self.gate_act(self.gate(x))


def converted(module, config=None):
    ours = copy.deepcopy(module)
    MesaFunctional.convert(ours, config or MesaConfig())
    return ours


def step(module, x, seed=0):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
    return y, x.grad


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_forward_is_bit_identical_and_gradients_close(dtype):
    ref = FunctionalAttention().to(dtype)
    ours = converted(ref)
    x = torch.randn(2, 16, 32).to(dtype)
    y_ref, gx_ref = step(ref, x)
    y, gx = step(ours, x)
    assert torch.equal(y, y_ref)
    floor = 0.999 if dtype == torch.float32 else 0.99
    assert cosine(gx, gx_ref) >= floor
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert cosine(p.grad, q.grad) >= floor, name


@pytest.mark.parametrize('maps', ['recompute', 'stored'])
def test_saves_packed_operands_and_leaves_children_alone(maps):
    ref = FunctionalAttention()
    ours = converted(ref, MesaConfig(attention_maps=maps))
    x = torch.randn(4, 49, 32, requires_grad=True)
    with count_saved_tensors(ref) as base:
        ref(x)
    with count_saved_tensors(ours) as mesa:
        ours(x)
    # the module's own saves become 8-bit codes (a quarter); by default the attention map is
    # not kept at all (replayed from q and k: 0.15 here), with stored maps it is packed
    # (0.28). Children are not converted in this test, so theirs are unchanged (nothing of
    # theirs is packed by the parent).
    bound = 0.17 if maps == 'recompute' else 0.42
    assert mesa.by_type['FunctionalAttention'] <= bound * base.by_type['FunctionalAttention']
    in_child, seen = [], []
    for child in (ours.proj, ours.gate, ours.gate_act):
        child.register_forward_pre_hook(lambda *_: in_child.append(1))
        child.register_forward_hook(lambda *_: in_child.pop() and None)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: seen.append(t.dtype) or t if in_child else t, lambda t: t):
        ours(x)
    assert seen and set(seen) == {torch.float32}  # what children save is theirs, unpacked
    # one call site each: F.linear, q @ k, softmax, attn @ v, gamma * out (only out is packed:
    # gamma is a Parameter), (gamma * out) * gate (both packed); q * 0.5 saves nothing. With
    # maps replayed the softmax keeps nothing and attn @ v only v.
    kinds = [key.split('_', 1)[1] for key in ours.mesa_sites]
    attention = (['matmul_a', 'matmul_b', 'matmul_b'] if maps == 'recompute' else
                 ['matmul_a', 'matmul_b', 'softmax_output', 'matmul_a', 'matmul_b'])
    assert kinds == ['linear_input', *attention, 'product_b', 'product_a', 'product_b']


def test_layer_types_switch_call_sites_off_and_eval_is_untouched():
    ref = FunctionalAttention()
    ours = converted(ref, MesaConfig(layers={'softmax'}))
    x = torch.randn(2, 16, 32, requires_grad=True)
    ours(x)
    assert [key.split('_', 1)[1] for key in ours.mesa_sites] == ['softmax_output']
    ours.eval()
    with torch.no_grad():
        assert torch.equal(ours(x), ref.eval()(x))


def test_deepcopy_keeps_child_tracking_on_the_copy():
    ours = converted(FunctionalAttention())
    twin = copy.deepcopy(ours)
    x = torch.randn(2, 16, 32, requires_grad=True)
    twin(x)
    assert twin.mesa_child_depth == 0 and ours.mesa_child_depth == 0
    assert len(twin.mesa_sites) == 7 and not hasattr(ours, 'mesa_sites')  # made at a first call
    assert isinstance(twin, MesaModule) and isinstance(twin, FunctionalAttention)


def test_autocast_forward_is_bit_identical():
    ref = FunctionalAttention()
    ours = converted(ref)
    x = torch.randn(2, 16, 32)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y_ref, gx_ref = step(ref, x)
        y, gx = step(ours, x)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    assert cosine(gx, gx_ref) >= 0.99


class ListOfLayers(nn.Module):
    """Children in a ModuleList, called one by one from the module's forward (K-Net's
    mask_fcs): a ModuleList is never called itself, so its items are the children that run."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.named = nn.ModuleDict({'out': nn.Linear(8, 8)})

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.named['out'](x) * x


def test_calls_made_by_children_in_containers_are_theirs():
    ours = converted(ListOfLayers())
    ours(torch.randn(3, 8, requires_grad=True))
    # only the module's own product: the Linears' F.linear calls are their own
    assert [key.split('_', 1)[1] for key in ours.mesa_sites] == ['product_a', 'product_b']


class Deformable(nn.Module):
    """Sampling a feature map at offsets a layer predicts, then weighting the samples, as
    deformable attention does (mmcv's pure-PyTorch path)."""

    def __init__(self, channels=16, points=4):
        super().__init__()
        self.points = points
        self.offsets = nn.Conv2d(channels, 2 * points, 1)

    def forward(self, x, align_corners=False, padding_mode='zeros'):
        b, _, h, w = x.shape
        grid = torch.tanh(self.offsets(x)).permute(0, 2, 3, 1).reshape(b, h, w * self.points, 2)
        sampled = F.grid_sample(x, grid, mode='bilinear', padding_mode=padding_mode,
                                align_corners=align_corners)
        return sampled * sampled.mean(1, keepdim=True).sigmoid()


@pytest.mark.parametrize('align_corners, padding_mode', [(False, 'zeros'), (True, 'border')])
def test_grid_sample_packs_the_sampled_map_and_keeps_the_grid(align_corners, padding_mode):
    ref = Deformable()
    ours = converted(ref)
    x = torch.randn(2, 16, 12, 10)

    def run(module):
        torch.manual_seed(0)
        xi = x.clone().requires_grad_()
        y = module(xi, align_corners, padding_mode)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
        return y, xi.grad

    y_ref, gx_ref = run(ref)
    y, gx = run(ours)
    assert torch.equal(y, y_ref)
    assert cosine(gx, gx_ref) >= 0.999
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert cosine(p.grad, q.grad) >= 0.999, name
    # the offsets' tanh (an activation), then the sampled map
    assert [key.split('_', 1)[1] for key in ours.mesa_sites][:2] == ['activation_input',
                                                                    'attention_input']
    xs = x.clone().requires_grad_()
    with count_saved_tensors(ref) as base:
        ref(xs, align_corners, padding_mode)
    with count_saved_tensors(ours) as mesa:
        ours(xs, align_corners, padding_mode)
    # the map, the samples and tanh's output as 8-bit codes; the grid stays in full
    assert mesa.by_type['Deformable'] <= 0.5 * base.by_type['Deformable']


def test_grid_sample_input_gradient_is_exact_where_only_the_input_needs_one():
    """The input's gradient reads only the grid: with a fixed grid nothing is packed and the
    gradient is torch's bit for bit."""
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer('grid', torch.rand(2, 5, 7, 2) * 2 - 1)

        def forward(self, x):
            return F.grid_sample(x, self.grid, align_corners=False)

    ref = Fixed()
    ours = converted(ref)
    x = torch.randn(2, 3, 6, 8)
    y_ref, gx_ref = step(ref, x)
    y, gx = step(ours, x)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    with count_saved_tensors(ours) as mesa:
        ours(x.clone().requires_grad_())
    assert mesa.total_bytes <= ref.grid.numel() * 4  # at most the grid: not the input


def test_own_adaptive_pooling_keeps_nothing_and_is_exact():
    """DMNet's filter generator pools its input with F.adaptive_avg_pool2d: only the shape is
    needed for backward, so the converted module keeps nothing of it."""
    class Pools(nn.Module):
        def forward(self, x):
            return F.adaptive_avg_pool2d(x, 3).sum() + (x * 2).sum()

    ref = Pools()
    ours = converted(ref)
    x = torch.randn(2, 4, 11, 9)
    grads = []
    for module in (ref, ours):
        xi = x.clone().requires_grad_()
        with count_saved_tensors(module) as saved:
            y = module(xi)
        y.backward()
        grads.append((y, xi.grad, saved.total_bytes))
    (y0, g0, b0), (y1, g1, b1) = grads
    assert torch.equal(y0, y1) and torch.equal(g0, g1)
    assert b0 >= x.numel() * 4 and b1 == 0


def test_own_sigmoid_gate_saves_its_output_packed():
    """PIDNet's fusions gate two branches with ``torch.sigmoid`` of a third: the gate's output
    (what its backward reads) is packed per channel, the forward bit-identical."""
    class Gate(nn.Module):
        def forward(self, p, i, d):
            sigma = torch.sigmoid(d)
            return sigma * p + (1 - sigma) * i + d.sigmoid()

    ref = Gate()
    ours = converted(ref)
    gen = torch.Generator().manual_seed(0)
    p, i, d = (torch.randn(2, 8, 16, 16, generator=gen) for _ in range(3))
    results = []
    for module in (ref, ours):
        leaves = [t.clone().requires_grad_() for t in (p, i, d)]
        with count_saved_tensors(module) as saved:
            y = module(*leaves)
        y.backward(torch.ones_like(y))
        results.append((y, [t.grad for t in leaves], saved.total_bytes))
    (y0, g0, b0), (y1, g1, b1) = results
    assert torch.equal(y0, y1)
    assert all(cosine(a, b) >= 0.999 for a, b in zip(g1, g0))
    assert [key.split('_', 1)[1] for key in ours.mesa_sites][:1] == ['activation_output']
    # six byte-per-value copies (two sigmoid outputs, four product operands) where the
    # baseline keeps five fp32 tensors (one sigmoid output serves both): 6/20, plus ranges
    assert b1 <= 0.32 * b0
