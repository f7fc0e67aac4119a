"""Attention written op by op keeps no map: the softmax and ``attn @ v`` replay it from q, k."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmseg_mesa import MesaConfig
from mmseg_mesa.codes import Packed, Refined
from mmseg_mesa.layers import recomputed_map, softmax
from mmseg_mesa.layers.intercept import MesaFunctional
from mmseg_mesa.layers.recomputed_map import MesaLogitsFunction
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.saved import load


class OpByOpAttention(nn.Module):
    """LeViT's and SwinV2's form: scaled logits, a learned per-head bias, a window mask added
    through a view, softmax, ``attn @ v``; ``variant`` breaks the chain in one way."""

    def __init__(self, dim=32, heads=4, tokens=16, windows=2, variant=None):
        super().__init__()
        self.heads, self.windows, self.variant = heads, windows, variant
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens))
        self.register_buffer('mask', torch.randn(windows, tokens, tokens).clamp(max=0) * 50)
        self.scale = (dim // heads) ** -0.5

    def logits(self, x):
        """The scaled, biased logits (changed as ``variant`` says) and v."""
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = q @ k.transpose(-2, -1) * self.scale + self.bias
        if self.variant == 'in place':
            attn /= 2
        elif self.variant == 'per image':
            attn = attn + torch.ones(b, 1, 1, 1) * 0.5
        return attn, v

    def forward(self, x):
        b, n, c = x.shape
        attn, v = self.logits(x)
        attn = attn.view(b // self.windows, self.windows, self.heads, n, n)
        attn = (attn + self.mask.unsqueeze(1).unsqueeze(0)).view(b, self.heads, n, n)
        attn = attn.softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


def run(module, x, grad):
    x = x.detach().clone().requires_grad_()
    with count_saved_tensors(module) as saved:
        y = module(x)
    y.backward(grad)
    grads = torch.cat([x.grad.flatten(), *[p.grad.flatten() for p in module.parameters()]])
    return y, grads, saved.total_bytes


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def counting(monkeypatch):
    calls = []
    for name in ('MesaLogitsFunction', 'MesaMapSoftmaxFunction', 'MesaMapMatMulFunction'):
        function = getattr(recomputed_map if hasattr(recomputed_map, name) else softmax, name)
        monkeypatch.setattr(function, 'apply', staticmethod(
            (lambda apply, n: lambda *a: calls.append(n) or apply(*a))(function.apply, name)))
    return calls


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_maps_are_replayed_bit_identically_forward_and_closely_backward(monkeypatch, dtype):
    torch.manual_seed(0)
    ref = OpByOpAttention()
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    want, exact, base = run(ref, x, grad)
    stored = copy.deepcopy(ref)
    MesaFunctional.convert(stored, MesaConfig(attention_maps='stored'))
    ours = copy.deepcopy(ref)
    # 8-bit q and k (these random logits' 8-bit replay strays by more than the default limit)
    MesaFunctional.convert(ours, MesaConfig(attention_refine_error=math.inf))
    calls = counting(monkeypatch)
    if dtype == torch.bfloat16:
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert torch.equal(ours(x), ref(x))
        return
    got, grads, kept = run(ours, x, grad)
    assert calls == ['MesaLogitsFunction', 'MesaMapSoftmaxFunction', 'MesaMapMatMulFunction']
    assert torch.equal(got, want)
    _, stored_grads, stored_kept = run(stored, x, grad)
    # q, k and v at 8 bits and no map: less kept than with the map packed (the child Linear's
    # input, unconverted here, is in both). The error is of the same order (0.015 against 0.008
    # on these flat random maps; on LeViT's trained-like peaked ones it is the smaller one)
    assert kept < 0.85 * stored_kept < 0.4 * base
    assert relative(grads, exact) < 0.03 and relative(stored_grads, exact) < 0.03


@pytest.mark.parametrize('variant', ['in place', 'per image'])
def test_a_chain_the_recipe_cannot_follow_keeps_the_map(monkeypatch, variant):
    """Logits modified in place, or an operand with one value per image: the softmax packs its
    output as before, and gradients stay right."""
    torch.manual_seed(0)
    ref = OpByOpAttention(variant=variant)
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig())
    calls = counting(monkeypatch)
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    got, grads, _ = run(ours, x, grad)
    want, exact, _ = run(ref, x, grad)
    assert 'MesaMapSoftmaxFunction' not in calls and 'MesaMapMatMulFunction' not in calls
    assert any(key.endswith('softmax_output') for key in ours.mesa_sites)
    assert torch.equal(got, want) and relative(grads, exact) < 0.02


def test_logits_gradients_are_the_matmuls_of_the_decoded_operands():
    """``MesaLogitsFunction``: torch's product forward; backward is exactly the product's
    gradients at the q and k its node keeps (one group per head and channel)."""
    from mmseg_mesa.layers.base import make_quantizer
    torch.manual_seed(0)
    q = torch.randn(2, 3, 10, 8, requires_grad=True)
    k = torch.randn(2, 3, 8, 12, requires_grad=True)
    quantizers = [make_quantizer(MesaConfig(), -1, 1) for _ in range(2)]
    y = MesaLogitsFunction.apply(q, k, *quantizers)
    assert torch.equal(y, q @ k)
    kept_q, kept_k = MesaLogitsFunction.operands(y.grad_fn)
    assert kept_q.shape == q.shape and kept_k.shape == (2, 3, 12, 8)
    assert relative(kept_q, q.detach()) < 0.01
    torch.testing.assert_close(MesaLogitsFunction.logits(y.grad_fn), kept_q @ kept_k.transpose(
        -2, -1))
    grad = torch.randn_like(y)
    got_q, got_k = torch.autograd.grad(y, (q, k), grad)
    torch.testing.assert_close(got_q, grad @ kept_k)
    torch.testing.assert_close(got_k, kept_q.transpose(-2, -1) @ grad)


class SingleHeadBlock(nn.Module):
    """OCR's and DANet's self-attention block: 3-d ``(B, N, C) @ (B, C, M)`` products."""

    def __init__(self, channels=8):
        super().__init__()
        self.channels = channels
        self.key = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        query = x.flatten(2).transpose(1, 2)
        key = self.key(x).flatten(2)
        sim = torch.matmul(query, key)
        sim = (self.channels ** -.5) * sim
        sim = F.softmax(sim, dim=-1)
        return torch.matmul(sim, query).transpose(1, 2).reshape(b, c, h, w)


def test_single_head_products_replay_from_their_own_codes(monkeypatch):
    """A 3-d product keeps its operands' codes as before (``MesaMatMulFunction``); its map is
    replayed from them."""
    torch.manual_seed(0)
    ref = SingleHeadBlock()
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig())
    calls = counting(monkeypatch)
    x, grad = torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6)
    got, grads, _ = run(ours, x, grad)
    want, exact, _ = run(ref, x, grad)
    assert calls == ['MesaMapSoftmaxFunction', 'MesaMapMatMulFunction']
    assert torch.equal(got, want) and relative(grads, exact) < 0.02


def test_stored_maps_preset_keeps_the_maps(monkeypatch):
    torch.manual_seed(0)
    ours = OpByOpAttention()
    MesaFunctional.convert(ours, MesaConfig(attention_maps='stored'))
    calls = counting(monkeypatch)
    run(ours, torch.randn(4, 16, 32), torch.randn(4, 16, 32))
    assert not calls


class SoftmaxChildAttention(OpByOpAttention):
    """SwinV2's form: the softmax an ``nn.Softmax`` child (converted on its own)."""

    def __init__(self, variant=None):
        super().__init__(variant=variant)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        b, n, c = x.shape
        attn, v = self.logits(x)
        attn = self.softmax(attn)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


@pytest.mark.parametrize('variant', [None, 'in place'])
def test_a_softmax_child_replays_or_packs_the_map_once(monkeypatch, variant):
    """A converted ``nn.Softmax`` child replays the map of logits its parent computed; where it
    must pack the map (logits changed in place), ``attn @ v`` reuses its codes."""
    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.reuse import count_reuse
    torch.manual_seed(0)
    ref = SoftmaxChildAttention(variant)
    ours = copy.deepcopy(ref)
    convert_to_mesa(ours, config=MesaConfig())
    calls = counting(monkeypatch)
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    with count_reuse(ours) as reuse:
        got, grads, _ = run(ours, x, grad)
    want, exact, _ = run(ref, x, grad)
    if variant is None:
        assert calls == ['MesaLogitsFunction', 'MesaMapSoftmaxFunction', 'MesaMapMatMulFunction']
    else:  # attn @ v is a MesaMatMulFunction that took the softmax's codes
        print("REL8", relative(grads, exact))
        assert calls == ['MesaLogitsFunction']
        assert sum(reuse.hits.values()) == 1, reuse.summary()
    assert torch.equal(got, want) and relative(grads, exact) < 0.02


def test_logits_need_several_keys():
    """GCNet's context pooling, ``(B, 1, C, N) @ (B, 1, N, 1)``, stays a plain product."""
    from mmseg_mesa.layers.recomputed_map import logits_operands
    a, b = torch.randn(2, 1, 8, 16), torch.randn(2, 1, 16, 1)
    assert not logits_operands(a, b)
    assert logits_operands(torch.randn(2, 3, 16, 8), torch.randn(2, 3, 8, 16))


def test_logits_a_replay_would_miss_by_much_keep_their_map(monkeypatch):
    """Logits scaled up so far that their 8-bit replay strays by more than
    ``MAX_REPLAY_ERROR``, which torch cannot recompute exactly from q and k (a learned bias is
    added: its gradient would be lost), keep an 8-bit map instead, refined q and k or not."""
    torch.manual_seed(0)
    ref = OpByOpAttention()
    ref.scale = 40.0
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig())
    calls = counting(monkeypatch)
    errors = []
    replays = recomputed_map.replays
    # a module's own softmax call and an nn.Softmax child both decide in ``softmax.map_softmax``
    monkeypatch.setattr(softmax, 'replays', lambda r: errors.append(r.error) or replays(r))
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    got, grads, _ = run(ours, x, grad)
    want, exact, _ = run(ref, x, grad)
    assert errors and min(errors) > recomputed_map.MAX_REPLAY_ERROR
    assert calls == ['MesaLogitsFunction'] and torch.equal(got, want)
    assert any(key.endswith('softmax_output') for key in ours.mesa_sites)


def test_logits_an_8_bit_replay_would_move_replay_from_refined_q_k_and_v(monkeypatch):
    """Logits whose 8-bit replay strays by more than ``attention_refine_error`` (measured on the
    product) but not so far that the map is sharp keep q, k and v refined to about 16 bits, and
    replay the map from them: the gradient is closer to torch's than with 8-bit ones."""
    torch.manual_seed(0)
    ref = OpByOpAttention()
    ref.bias.data.mul_(0.1)  # a small position bias and a two-valued window mask (Swin's):
    ref.mask.copy_(torch.where(ref.mask < -20, -100.0, 0.0))  # their codes add little
    x, grad = torch.randn(4, 16, 32) * 3, torch.randn(4, 16, 32)
    _, exact, _ = run(ref, x, grad)
    errors, recipes = [], []
    replays = recomputed_map.replays
    monkeypatch.setattr(softmax, 'replays', lambda r: recipes.append(r) or replays(r))
    for threshold in (math.inf, MesaConfig().attention_refine_error):
        ours = copy.deepcopy(ref)
        MesaFunctional.convert(ours, MesaConfig(attention_refine_error=threshold))
        y = copy.deepcopy(ours)(x.requires_grad_())  # the same first step, its graph to look at
        nodes = {getattr(n, '_forward_cls', None): n for n in graph_nodes(y)}
        kept = [type(codes) for cls in (MesaLogitsFunction, recomputed_map.MesaMapMatMulFunction)
                for codes in load(nodes[cls]) if codes is not None]
        assert kept == [Refined if threshold < math.inf else Packed] * 3
        got, grads, _ = run(ours, x, grad)
        errors.append(relative(grads, exact))
    assert all(replays(r) for r in recipes) and recipes[-1].refined
    assert errors[1] < errors[0] / 10  # 0.0005 against 0.021


class SharpAttention(nn.Module):
    """T2T-ViT's form in mmpretrain 1.2.0: logits multiplied by a large number (its Python
    attention divides by the scale it is given, ``head_dims ** -0.5``), softmax, ``attn @ v``."""

    def __init__(self, dim=32, heads=4, factor=40.0, dropout=0.0):
        super().__init__()
        self.heads, self.factor, self.dropout = heads, factor, dropout
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * self.factor).softmax(dim=-1)
        attn = F.dropout(attn, self.dropout, self.training)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


def graph_nodes(y):
    """The nodes of ``y``'s graph."""
    found, seen, todo = [], set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def mesa_logits_nodes(y):
    """The ``MesaLogitsFunction`` nodes in ``y``'s graph."""
    return [n for n in graph_nodes(y) if getattr(n, '_forward_cls', None) is MesaLogitsFunction]


@pytest.mark.parametrize('factor, dropout', [(40.0, 0.0), (40.0, 0.2), (1.0, 0.0)])
def test_logits_too_large_for_8_bit_leave_the_attention_to_torch(monkeypatch, factor, dropout):
    """Logits whose 8-bit replay would stray (sharp maps, where neither 8-bit maps nor 8-bit
    q, k, v keep the gradient) are recomputed by torch from the live q and k: the attention's
    graph is torch's (through dropout on the map too), its gradient exact, and the report names
    why; ordinary logits replay."""
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    torch.manual_seed(0)
    ref = SharpAttention(factor=factor, dropout=dropout)
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig())
    calls = counting(monkeypatch)
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    torch.manual_seed(1)
    y = ours(x.requires_grad_())
    torch.manual_seed(1)
    assert torch.equal(y, ref(x))
    if factor == 1.0:
        assert calls == ['MesaLogitsFunction', 'MesaMapSoftmaxFunction', 'MesaMapMatMulFunction']
        assert len(mesa_logits_nodes(y)) == 1 and not ours.mesa_left_to_torch
        return
    assert calls == ['MesaLogitsFunction']  # made, then left out of the graph with its codes
    assert mesa_logits_nodes(y) == [] and ours.mesa_left_to_torch == {SHARP_MAP: 1}
    torch.manual_seed(2)
    got, grads, _ = run(ours, x, grad)
    torch.manual_seed(2)
    want, exact, _ = run(ref, x, grad)
    assert torch.equal(got, want) and relative(grads, exact) < 1e-6


@pytest.mark.parametrize('refined_by', ['choice', 'bits=16'])
def test_refined_codes_still_leave_sharp_attention_to_torch(refined_by):
    """How sharp a map is is measured on the 8-bit codes, whatever a quantizer keeps: with
    every quantizer keeping refined codes (``keep_refined``, the calibration's choice, or a
    16-bit spec) the attention is left to torch as at 8 bits, not replayed from refined q and k
    (whose map's gradient strays where the logits are too large: T2T-ViT's), and the gradient
    is exact."""
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    from mmseg_mesa.quantizer import ActivationQuantizer
    torch.manual_seed(0)
    ref = SharpAttention()
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig(bits=16 if refined_by == 'bits=16' else 8))
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    ours(x.requires_grad_())  # makes the call sites' quantizers
    quantizers = [m for m in ours.modules() if isinstance(m, ActivationQuantizer)]
    assert quantizers
    for q in quantizers:
        q.keep_refined = refined_by == 'choice'
        q.replay_error.restore(None)  # measured again at the next call
        q.map_error.restore(None)
    ours.mesa_left_to_torch.clear()
    got, grads, _ = run(ours, x, grad)
    want, exact, _ = run(ref, x, grad)
    assert ours.mesa_left_to_torch == {SHARP_MAP: 1}
    assert torch.equal(got, want) and relative(grads, exact) < 1e-6


def test_sharp_logits_under_autocast_are_rebuilt_bit_for_bit():
    """Under bf16 autocast torch's recomputed product is the forward's, bit for bit."""
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    torch.manual_seed(0)
    ref = SharpAttention()
    ours = copy.deepcopy(ref)
    MesaFunctional.convert(ours, MesaConfig())
    x = torch.randn(4, 16, 32, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y, want = ours(x), ref(x)
    assert torch.equal(y, want) and ours.mesa_left_to_torch == {SHARP_MAP: 1}
    assert mesa_logits_nodes(y) == []


def test_a_weak_operand_is_its_view_while_unchanged():
    """``k.transpose(-2, -1)`` is gone by the softmax; the same view of k is rebuilt from its
    base, with its gradient reaching k, and nothing once k changed in place."""
    from mmseg_mesa.layers.recomputed_map import WeakOperand
    base = torch.randn(2, 3, 5, 4, requires_grad=True)
    k = base * 1  # a tensor of the graph, as a linear's output is
    operand = WeakOperand.of(k[:, 1:].transpose(-2, -1))
    got = operand.get()
    assert got is not None and torch.equal(got, k[:, 1:].transpose(-2, -1))
    got.sum().backward()
    assert torch.equal(base.grad, torch.ones(2, 3, 5, 4).index_fill_(1, torch.tensor([0]), 0))
    with torch.no_grad():
        k.mul_(2)
    assert operand.get() is None
    plain = torch.randn(3, 4)
    operand = WeakOperand.of(plain)
    assert operand.get() is plain
    plain += 1
    assert operand.get() is None
    operand = WeakOperand.of(torch.randn(3, 4))
    assert operand.get() is None  # gone, and no base to rebuild it from


@pytest.mark.parametrize('by_handler', [False, True])
def test_the_report_names_attention_left_to_torch(monkeypatch, by_handler):
    """The conversion report counts sharp attention left to torch, in a module of the generic
    path and in one a handler converts to ``MesaFunctional``."""
    from mmseg_mesa import convert_to_mesa, registry
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    if by_handler:
        monkeypatch.setattr(registry, '_HANDLERS', dict(registry._HANDLERS))
        registry.register_handler(SharpAttention, 'attention', registry.swap_to(MesaFunctional))
    model = nn.Sequential(SharpAttention())
    report = convert_to_mesa(model)
    assert ('0' in report.converted) == by_handler == ('0' not in report.generic)
    model(torch.randn(2, 16, 32, requires_grad=True))
    assert report.left_to_torch() == {('SharpAttention', SHARP_MAP): 1}
    assert f'SharpAttention: {SHARP_MAP}' in report.format()


class SharpChildAttention(SharpAttention):
    """``SharpAttention`` with its softmax an ``nn.Softmax`` child (SwinV2's, timm's form)."""

    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = self.softmax(q @ k.transpose(-2, -1) * self.factor)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


def test_a_softmax_child_of_sharp_logits_leaves_the_attention_to_torch():
    """An ``nn.Softmax`` child meets the same sharp logits: torch's attention, exact gradients,
    and the report names the child."""
    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    torch.manual_seed(0)
    ref = SharpChildAttention()
    ours = copy.deepcopy(ref)
    report = convert_to_mesa(ours, config=MesaConfig(skip=('qkv',)))  # exact q, k, v
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    got, grads, _ = run(ours, x, grad)
    want, exact, _ = run(ref, x, grad)
    assert torch.equal(got, want) and relative(grads, exact) < 1e-6
    assert mesa_logits_nodes(ours(x.requires_grad_())) == []
    assert report.left_to_torch() == {('Softmax', SHARP_MAP): 2}


class SharpDropoutChildAttention(SharpAttention):
    """``SharpAttention`` with dropout on its map an ``nn.Dropout`` child (timm's and
    mmpretrain's form), which the conversion makes a ``MesaDropout``."""

    def __init__(self):
        super().__init__()
        self.attn_drop = nn.Dropout(0.2)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = self.attn_drop((q @ k.transpose(-2, -1) * self.factor).softmax(dim=-1))
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


def test_a_dropout_child_on_a_sharp_map_leaves_attn_v_to_torch():
    """The dropped sharp map an ``nn.Dropout`` child returns is still one torch keeps: ``attn @
    v`` is torch's and the gradients exact (packing the dropped map would lose them)."""
    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.layers.dropout import MesaDropout
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    torch.manual_seed(0)
    ref = SharpDropoutChildAttention()
    ours = copy.deepcopy(ref)
    report = convert_to_mesa(ours, config=MesaConfig(skip=('qkv',)))  # exact q, k, v
    assert isinstance(ours.attn_drop, MesaDropout)
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    torch.manual_seed(2)
    got, grads, _ = run(ours, x, grad)
    torch.manual_seed(2)
    want, exact, _ = run(ref, x, grad)
    assert torch.equal(got, want) and relative(grads, exact) < 1e-6
    assert report.left_to_torch() == {('SharpDropoutChildAttention', SHARP_MAP): 1}
