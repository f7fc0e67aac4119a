"""A convolution read only by a training-mode BatchNorm: its weight gradient's part along the
weights is set to what the BatchNorm knows exactly (``layers.scale_free``); and what a
convolution's output tells later layers (GELU keeps its derivative there)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import cosine
from torch import nn

from mmseg_mesa import convert_to_mesa
from mmseg_mesa.layers import scale_free
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.quantizer import reset_rounding_generators


class ConvNorm(nn.Module):
    """conv -> BatchNorm -> ReLU -> 1x1 conv; ``reader`` also reads the conv's output."""

    def __init__(self, channels=16, kernel=1, groups=16, reader=None):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=groups)
        self.bn = nn.BatchNorm2d(channels)
        self.head = nn.Conv2d(channels, 8, 1)
        self.reader = reader
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        y = self.conv(x)
        out = self.head(torch.relu(self.bn(y)))
        if self.reader == 'residual':
            out = out + y[:, :8]
        elif self.reader == 'in-place':
            raise AssertionError('set up in the test')
        return out


def gradients(model, x):
    """One step's parameter gradients, on a copy (running estimates as ``model`` has them)."""
    model = copy.deepcopy(model)
    reset_rounding_generators()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def pair(model_type=None, **kwargs):
    """A model (``ConvNorm`` unless given) and its converted copy."""
    torch.manual_seed(0)
    exact = (model_type or ConvNorm)(**kwargs)
    ours = copy.deepcopy(exact)
    convert_to_mesa(ours)
    return exact, ours


def without_link(monkeypatch):
    monkeypatch.setattr(scale_free, 'claim', lambda ctx, x, weight: setattr(ctx, 'scale_link',
                                                                           None))


def test_scale_branch_gradient_follows_its_batch_norm(monkeypatch):
    """A 1x1 depthwise conv (one weight per channel) before a BatchNorm: its exact gradient is
    only what the BatchNorm's epsilon leaves, which 8-bit codes of its input swamp; with the
    part along the weights set exactly, it is right."""
    exact, ours = pair()
    x = torch.randn(2, 16, 16, 16) * 3 + 1
    want = gradients(exact, x)['conv.weight']
    got = gradients(ours, x)['conv.weight']
    assert relative(got, want) < 0.01 and cosine(got, want) > 0.9999
    without_link(monkeypatch)
    plain = gradients(ours, x)['conv.weight']
    assert relative(plain, want) > 0.03  # what the link fixes


@pytest.mark.parametrize('kernel,groups', [(3, 1), (3, 16), (1, 1)])
def test_part_along_the_weights_is_exact(kernel, groups):
    """Any conv before a BatchNorm: per output channel, <dW_c, W_c> equals the exact one to
    float rounding (the rest of dW keeps its 8-bit error)."""
    exact, ours = pair(kernel=kernel, groups=groups)
    x = torch.randn(2, 16, 12, 12) * 2
    want = gradients(exact, x)['conv.weight']
    got = gradients(ours, x)['conv.weight']
    w = exact.conv.weight.detach().flatten(1)
    along_want = (want.flatten(1) * w).sum(1)
    along_got = (got.flatten(1) * w).sum(1)
    scale = want.flatten(1).norm(dim=1) * w.norm(dim=1)
    assert ((along_got - along_want).abs() / scale).max() < 1e-3
    assert relative(got, want) < 0.02


def test_a_second_reader_turns_the_correction_off(monkeypatch):
    """The conv's output also feeds a residual: its gradient is no longer the BatchNorm's alone,
    and the weight gradient is exactly what it is without the link."""
    exact, ours = pair(reader='residual')
    x = torch.randn(2, 16, 8, 8)
    got = gradients(ours, x)
    without_link(monkeypatch)
    plain = gradients(ours, x)
    assert torch.equal(got['conv.weight'], plain['conv.weight'])
    assert relative(got['conv.weight'], gradients(exact, x)['conv.weight']) < 0.05


def test_an_in_place_change_before_the_norm_turns_it_off(monkeypatch):
    """``y.mul_(2)`` between conv and BatchNorm: the BatchNorm reads another tensor than the
    conv made, and claims nothing."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(8, 8, 1, groups=8), nn.BatchNorm2d(8)
    model = nn.ModuleDict(dict(conv=conv, bn=bn))
    convert_to_mesa(model)
    claimed = []
    real_claim = scale_free.claim

    def spy(ctx, x, weight):
        real_claim(ctx, x, weight)
        claimed.append(ctx.scale_link is not None)

    monkeypatch.setattr(scale_free, 'claim', spy)
    x = torch.randn(2, 8, 6, 6)
    model['bn'](model['conv'](x))
    model['bn'](model['conv'](x).mul_(2))
    assert claimed == [True, False]


class Expansion(nn.Module):
    """MobileNet's expansion: 1x1 conv -> BatchNorm -> ReLU -> 3x3 depthwise conv -> BatchNorm;
    ``reader`` also reads the ReLU's output, ``dw_bias`` gives the depthwise conv a bias."""

    def __init__(self, channels=16, inplace=True, reader=False, dw_bias=False, functional=False):
        super().__init__()
        self.expand = nn.Conv2d(8, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.act = nn.ReLU(inplace=inplace)
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=dw_bias)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Conv2d(channels, 8, 1)
        self.reader, self.functional = reader, functional

    def forward(self, x):
        y = self.bn1(self.expand(x))
        z = F.relu(y) if self.functional else self.act(y)
        out = self.head(torch.relu(self.bn2(self.dw(z))))
        return out + z[:, :8] if self.reader else out


def expansion_pair(**kwargs):
    return pair(Expansion, **kwargs)


def without_chain(monkeypatch):
    monkeypatch.setattr(scale_free, 'carry', lambda ctx, x: setattr(ctx, 'scale_carried', None))


@pytest.mark.parametrize('inplace', [True, False])
def test_batch_norm_before_relu_and_depthwise_conv_follows_the_next_batch_norm(
        monkeypatch, inplace):
    """BatchNorm -> ReLU -> depthwise conv -> BatchNorm: scaling the first BatchNorm's (gamma,
    beta) in a channel only scales what the second normalizes, so with beta = 0 (at init) its
    exact weight gradient is only what the second's epsilon leaves, which 8-bit codes swamp;
    the chain sets that part exactly."""
    exact, ours = expansion_pair(inplace=inplace)
    x = torch.randn(2, 8, 12, 12)
    want, got = gradients(exact, x), gradients(ours, x)
    assert relative(got['bn1.weight'], want['bn1.weight']) < 0.01
    assert relative(got['bn1.bias'], want['bn1.bias']) < 0.02
    for name in want:
        assert relative(got[name], want[name]) < 0.02, name
    without_chain(monkeypatch)
    plain = gradients(ours, x)
    assert relative(plain['bn1.weight'], want['bn1.weight']) > 0.5  # what the chain fixes


def test_the_chain_holds_part_along_gamma_and_beta_exactly():
    """With beta != 0 the part along (gamma, beta) per channel is set; the rest keeps its
    8-bit error."""
    exact, ours = expansion_pair()
    with torch.no_grad():
        exact.bn1.bias.uniform_(-0.5, 0.5)
        ours.bn1.bias.copy_(exact.bn1.bias)
    x = torch.randn(2, 8, 12, 12)
    want, got = gradients(exact, x), gradients(ours, x)
    g, b = exact.bn1.weight.detach(), exact.bn1.bias.detach()
    along_want = want['bn1.weight'] * g + want['bn1.bias'] * b
    along_got = got['bn1.weight'] * g + got['bn1.bias'] * b
    scale = (want['bn1.weight'] ** 2 + want['bn1.bias'] ** 2).sqrt() * (g * g + b * b).sqrt()
    assert ((along_got - along_want).abs() / scale).max() < 1e-3


@pytest.mark.parametrize('kwargs', [dict(reader=True), dict(dw_bias=True)])
def test_a_second_reader_or_a_biased_depthwise_conv_breaks_the_chain(monkeypatch, kwargs):
    """The ReLU's output also feeds a residual, or the depthwise conv adds a bias (it no longer
    scales with its input): the first BatchNorm's gradients are as without the chain."""
    exact, ours = expansion_pair(**kwargs)
    x = torch.randn(2, 8, 8, 8)
    got = gradients(ours, x)
    without_chain(monkeypatch)
    plain = gradients(ours, x)
    assert torch.equal(got['bn1.weight'], plain['bn1.weight'])
    assert torch.equal(got['bn1.bias'], plain['bn1.bias'])


def test_an_in_place_change_after_the_relu_breaks_the_chain(monkeypatch):
    """``z.add_(0.1)`` between the in-place ReLU and the depthwise conv: the conv reads another
    tensor than the ReLU returned and carries nothing."""
    class Shifted(Expansion):
        def forward(self, x):
            z = self.act(self.bn1(self.expand(x)))
            z.add_(0.1)
            return self.head(torch.relu(self.bn2(self.dw(z))))

    exact, ours = pair(Shifted)
    x = torch.randn(2, 8, 8, 8)
    got = gradients(ours, x)
    without_chain(monkeypatch)
    plain = gradients(ours, x)
    assert torch.equal(got['bn1.weight'], plain['bn1.weight'])


def test_functional_relu_carries_the_chain(monkeypatch):
    """``F.relu`` in a module's own forward (the generic path) passes the chain on too."""
    exact, ours = expansion_pair(functional=True)
    x = torch.randn(2, 8, 12, 12)
    want, got = gradients(exact, x), gradients(ours, x)
    assert relative(got['bn1.weight'], want['bn1.weight']) < 0.01


def test_autocast_bf16_keeps_the_correction():
    exact, ours = pair()
    x = torch.randn(2, 16, 16, 16) * 3 + 1
    want = gradients(exact, x)['conv.weight']
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = gradients(ours, x)['conv.weight']
    assert got.dtype == torch.float32
    assert cosine(got, want) > 0.999


def test_autocast_bf16_keeps_the_chain():
    exact, ours = expansion_pair()
    x = torch.randn(2, 8, 12, 12)
    want = gradients(exact, x)['bn1.weight']
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = gradients(ours, x)['bn1.weight']
    assert got.dtype == torch.float32
    assert relative(got, want) < 0.05  # without the chain: > 0.5


class Copy(nn.Module):
    """A map no convolution made (its values are)."""

    def forward(self, x):
        return x.clone()


def input_gradient(model, x, g):
    x = x.clone().requires_grad_()
    reset_rounding_generators()
    model(x).backward(g)
    return x.grad


@pytest.mark.parametrize('norm', ['none', 'batch', 'group'])
def test_gelu_on_a_feature_map_keeps_its_derivative(norm):
    """conv (-> BatchNorm / GroupNorm) -> GELU: forward bit-identical, and the gradient through
    the GELU, which keeps its derivative's codes, is much closer to torch's than where it keeps
    its input's (the same map copied first); one byte per element either way."""

    class ConvGELU(nn.Module):
        def __init__(self, copied):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)
            self.norm = dict(batch=lambda: nn.BatchNorm2d(8), group=lambda: nn.GroupNorm(2, 8),
                             none=nn.Identity)[norm]()
            self.copy = Copy() if copied else nn.Identity()
            self.act = nn.GELU()

        def forward(self, x):
            return self.act(self.copy(self.norm(self.conv(x))))

    torch.manual_seed(0)
    exact = ConvGELU(False)
    with torch.no_grad():  # a feature map spanning about +-10
        exact.conv.weight.mul_(8)
        if norm != 'none':
            exact.norm.weight.fill_(4)
    x, g = torch.randn(4, 8, 16, 16), torch.randn(4, 8, 16, 16)
    want = input_gradient(exact, x, g)
    errors, saved = {}, {}
    for copied in (False, True):
        ours = ConvGELU(copied)
        ours.load_state_dict(exact.state_dict())
        convert_to_mesa(ours)
        assert torch.equal(ours(x), exact(x))
        errors[copied] = relative(input_gradient(ours, x, g), want)
        with count_saved_tensors(ours) as report:
            ours(x.clone().requires_grad_())
        saved[copied] = report.total_bytes
    assert errors[False] < errors[True] / 2, errors
    assert errors[False] < 0.01
    assert saved[False] <= 1.01 * saved[True]  # one byte per element either way


def test_a_nearly_silenced_channel_keeps_its_gradients():
    """A scale branch whose weight is near zero in some channels (MobileOne's, after training a
    while): their variance is far below BatchNorm's eps, where ``1 - eps / (var + eps)`` in fp32
    is rounding; their codes keep their own spread, so the BatchNorm's weight gradient and the
    conv's (which such channels dominate) stay right."""
    exact, ours = pair()
    with torch.no_grad():
        for model in (exact, ours):
            model.conv.weight[:4] = torch.tensor([2e-7, -1e-4, 3e-4, 1e-6]).view(4, 1, 1, 1)
    x = torch.randn(2, 16, 16, 16)
    want, got = gradients(exact, x), gradients(ours, x)
    assert cosine(got['bn.weight'][:4], want['bn.weight'][:4]) > 0.999
    assert relative(got['conv.weight'], want['conv.weight']) < 0.02


def test_functional_gelu_on_a_feature_map_offers_its_codes_to_the_conv_after_it():
    """``F.gelu`` in a module's own forward (timm's conv MLPs): its input's codes, grouped by
    channel, are what the next conv saves, so the map is kept once."""
    from mmseg_mesa.reuse import count_reuse

    class ConvMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Conv2d(8, 32, 1), nn.Conv2d(32, 8, 1)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    torch.manual_seed(0)
    exact = ConvMlp()
    ours = copy.deepcopy(exact)
    convert_to_mesa(ours)
    x = torch.randn(2, 8, 12, 12, requires_grad=True)  # inside a network, as its blocks are
    assert torch.equal(ours(x), exact(x))
    with count_reuse(ours) as counts:
        ours(x)
    assert counts.hits['Conv2d'] == 1
