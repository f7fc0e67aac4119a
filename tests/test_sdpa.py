"""Torch's fused attention (``F.scaled_dot_product_attention``) through ``MesaSDPAFunction``."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import cosine
from torch import nn

from mmseg_mesa import MesaConfig
from mmseg_mesa.layers import attention_core
from mmseg_mesa.layers.attention_core import MesaAttentionFunction, pack_heads, unpack_heads
from mmseg_mesa.layers.intercept import MesaFunctional
from mmseg_mesa.layers.sdpa import MesaSDPAFunction, SDPACall, left_to_torch
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.quantizer import ActivationQuantizer, QuantSpec


def quantizers() -> tuple[ActivationQuantizer, ...]:
    """Nearest rounding and the batch's own range: two packs of one tensor decode alike."""
    return tuple(ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=1,
                                               stochastic=False, ema_decay=0.0))
                 for _ in range(3))


def operands(batch=2, heads=2, queries=9, keys=13, dim=16, kv_heads=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    shapes = ((batch, heads, queries, dim), (batch, kv_heads, keys, dim),
              (batch, kv_heads, keys, dim))
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def make_mask(kind, batch, heads, queries, keys):
    gen = torch.Generator().manual_seed(3)
    if kind == 'bool':  # broadcast over batch and heads, every row keeps a key
        mask = torch.rand(queries, keys, generator=gen) < 0.7
        mask[:, 0] = True
        return mask
    if kind == 'float':  # a different bias per image, broadcast over heads
        return torch.randn(batch, 1, queries, keys, generator=gen)
    if kind == 'two-valued':  # additive 0 / -inf over keys, per head (padding)
        hidden = torch.rand(1, heads, 1, keys, generator=gen) < 0.3
        hidden[..., 0] = False
        return torch.zeros(hidden.shape).masked_fill(hidden, float('-inf'))
    if kind == 'expanded':  # a bias per key, expanded (backward keeps one row of it)
        return torch.randn(1, 1, 1, keys, generator=gen).expand(batch, heads, queries, keys)
    return None


def call_kwargs(variant, q, k):
    batch, heads, queries, _ = q.shape
    keys = k.shape[-2]
    if variant == 'causal':
        return {'is_causal': True}
    if variant == 'scale':
        return {'scale': 0.3}
    return {'attn_mask': make_mask(variant, batch, heads, queries, keys)}


def ours(q, k, v, quants=None, **kwargs):
    return MesaSDPAFunction.apply(q, k, v, kwargs.get('attn_mask'), kwargs.get('is_causal', False),
                                  kwargs.get('scale'), kwargs.get('enable_gqa', False),
                                  quants or quantizers())


VARIANTS = ['none', 'bool', 'float', 'two-valued', 'expanded', 'causal', 'scale']


@pytest.mark.parametrize('autocast', [False, True])
@pytest.mark.parametrize('dim', [16, 32, 64])
@pytest.mark.parametrize('variant', VARIANTS)
def test_forward_is_torch_sdpa_to_the_bit(variant, dim, autocast):
    q, k, v = operands(dim=dim)
    kwargs = call_kwargs(variant, q, k)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
        out = ours(q, k, v, **kwargs)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


def exact_at_decoded(q, k, v, grad, quants, **kwargs):
    """Torch's gradients of SDPA at the operands the Function decodes in backward."""
    decoded = [unpack_heads(pack_heads(x, quant), x.shape[1]).requires_grad_()
               for x, quant in zip((q, k, v), quants)]
    out = F.scaled_dot_product_attention(*decoded, **kwargs)
    return torch.autograd.grad(out, decoded, grad)


@pytest.mark.parametrize('block_bytes', [None, 1000])
@pytest.mark.parametrize('variant', [*VARIANTS, 'gqa', 'empty-rows'])
def test_backward_is_the_exact_gradient_at_the_decoded_operands(variant, block_bytes,
                                                                monkeypatch):
    """The recomputed maps make backward torch's gradient of SDPA at the 8-bit q, k and v: for
    every mask kind, causal attention, grouped keys and values (enable_gqa), and rows a mask
    hides entirely (a zero map, zero gradients, as torch gives them); whole maps, or blocks of
    five rows (4 heads x 11 keys in fp32 are 176 bytes a row)."""
    if block_bytes is not None:
        monkeypatch.setattr(attention_core, 'MAP_BLOCK_BYTES', block_bytes)
    q, k, v = operands(heads=4, kv_heads=2 if variant == 'gqa' else None, keys=11)
    kwargs = {'enable_gqa': True} if variant == 'gqa' else call_kwargs(variant, q, k)
    if variant == 'empty-rows':
        mask = torch.rand(1, 1, 9, 11) < 0.5
        mask[0, 0, 4] = False
        kwargs = {'attn_mask': mask}
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad(ours(q, k, v, **kwargs), (q, k, v), grad)
    expected = exact_at_decoded(q, k, v, grad, quantizers(), **kwargs)
    for mine, theirs in zip(grads, expected):
        assert torch.isfinite(mine).all()
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5)
    if variant == 'empty-rows':
        assert not grads[0][:, :, 4].any()


def relative_error(ours, reference):
    return ((ours.double() - reference.double()).norm() / reference.double().norm()).item()


@pytest.mark.parametrize('variant', ['none', 'float', 'scale'])
def test_gradients_are_as_close_as_mesa_attention_on_the_same_input(variant):
    """Against torch's own gradients: as close as ``MesaAttentionFunction`` (the same 8-bit q, k
    and v, the same recomputation) on the same input; what 8-bit operands allow."""
    q, k, v = operands(heads=3, queries=24, keys=24, dim=32)
    kwargs = call_kwargs(variant, q, k)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    reference = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v),
                                    grad)
    mine = torch.autograd.grad(ours(q, k, v, **kwargs), (q, k, v), grad)
    scale = kwargs.get('scale', 1 / math.sqrt(q.shape[-1]))
    yardstick = torch.autograd.grad(MesaAttentionFunction.apply(
        q, k, v, None, None, kwargs.get('attn_mask'), scale, 0.0, False, quantizers()),
        (q, k, v), grad)
    for name, a, b, c in zip('qkv', mine, reference, yardstick):
        assert cosine(a, b) >= 0.999, name
        error, bound = relative_error(a, b), relative_error(c, b)
        assert error <= 0.03, (name, error)
        assert error <= 1.05 * bound + 1e-6, (name, error, bound)


@pytest.mark.parametrize('autocast', [False, True])
@pytest.mark.parametrize('variant', ['none', 'bool', 'causal'])
def test_saves_a_fraction_of_what_torch_saves(variant, autocast):
    """8-bit q, k and v, a 1-bit mask, nothing for causal masking: about a fifth of torch's
    fp32 q, k, v, output and log-sum-exp; under bf16 autocast (torch keeps its bf16 casts) about
    two fifths."""
    q, k, v = operands(heads=4, queries=32, keys=32, dim=32)
    kwargs = call_kwargs(variant, q, k)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        with count_saved_tensors() as theirs:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
        with count_saved_tensors() as mine:
            ours(q, k, v, **kwargs)
    ratio = mine.total_bytes / theirs.total_bytes
    assert ratio <= (0.42 if autocast else 0.23), ratio


class FusedAttention(nn.Module):
    """Attention as timm writes it: a qkv Linear, ``F.scaled_dot_product_attention``, a
    projection."""

    def __init__(self, dim=32, heads=4, dropout=0.0, bias=None):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.bias = bias

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


def step(module, x, seed=0):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    with count_saved_tensors(module) as saved:
        y = module(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
    return y, x.grad, saved


def converted(module, config=None):
    mine = copy.deepcopy(module)
    MesaFunctional.convert(mine, config or MesaConfig())
    return mine


def test_converted_module_is_exact_and_keeps_8_bit_operands():
    ref = FusedAttention()
    mine = converted(ref)
    x = torch.randn(2, 49, 32)
    y_ref, gx_ref, saved_ref = step(ref, x)
    y, gx, saved = step(mine, x)
    assert torch.equal(y, y_ref)
    assert cosine(gx, gx_ref) >= 0.999
    for (name, p), p_ref in zip(mine.named_parameters(), ref.parameters()):
        assert cosine(p.grad, p_ref.grad) >= 0.999, name
    assert [key.split('_', 1)[1] for key in mine.mesa_sites] == \
        ['attention_q', 'attention_k', 'attention_v']
    # The module's own share: 8-bit q, k and v against torch's q, k, v, output and log-sum-exp
    # (0.20). The output is then kept by the projection instead, so the whole module keeps
    # 0.55 of what it kept.
    own, own_ref = saved.by_module[''], saved_ref.by_module['']
    assert own <= 0.22 * own_ref, (own, own_ref)
    assert saved.total_bytes <= 0.6 * saved_ref.total_bytes
    assert not mine.mesa_left_to_torch


def test_attention_switched_off_is_left_to_torch():
    mine = converted(FusedAttention(), MesaConfig(layers={'linear'}))
    mine(torch.randn(2, 9, 32, requires_grad=True))
    assert not getattr(mine, 'mesa_sites', None) and not mine.mesa_left_to_torch


class ExpandedBias(FusedAttention):
    """A learned bias handed to SDPA as an expanded view (stride 0 over the batch)."""

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.expand(b, -1, -1, -1))
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize('case', ['dropout', 'learned-bias'])
def test_dropout_and_expanded_learned_masks_are_left_to_torch(case):
    """Calls the Function cannot take run torch's own node: the output and gradients are
    torch's, and the module counts why."""
    if case == 'learned-bias':
        ref = ExpandedBias(bias=nn.Parameter(torch.randn(1, 4, 9, 9)))
    else:
        ref = FusedAttention(dropout=0.25)
    mine = converted(ref)
    x = torch.randn(2, 9, 32)
    y_ref, gx_ref, saved_ref = step(ref, x)
    y, gx, saved = step(mine, x)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert saved.by_module[''] == saved_ref.by_module['']
    assert not getattr(mine, 'mesa_sites', None)
    (reason, count), = mine.mesa_left_to_torch.items()
    assert count == 1 and reason.startswith('dropout_p' if case == 'dropout' else 'attn_mask')
    if case == 'learned-bias':
        assert torch.equal(mine.bias.grad, ref.bias.grad)


@pytest.mark.parametrize('shape', [(4, 9, 11), (1, 4, 9, 11), (2, 1, 9, 1)])
@pytest.mark.parametrize('block_bytes', [None, 1000])
def test_a_learned_bias_gets_the_exact_gradient_at_the_decoded_operands(shape, block_bytes,
                                                                        monkeypatch):
    """A mask that needs a gradient (timm's TinyViT / MaxViT position bias): its gradient is
    torch's at the 8-bit q, k and v, summed over its broadcast dimensions, by blocks too."""
    if block_bytes is not None:
        monkeypatch.setattr(attention_core, 'MAP_BLOCK_BYTES', block_bytes)
    q, k, v = operands(heads=4, keys=11)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(5)).requires_grad_()
    assert left_to_torch(SDPACall.bind((q, k, v, bias), {})) is None
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    out = ours(q, k, v, attn_mask=bias)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    mine = torch.autograd.grad(out, (q, k, v, bias), grad)
    decoded = [unpack_heads(pack_heads(x, quant), x.shape[1]).requires_grad_()
               for x, quant in zip((q, k, v), quantizers())]
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(*decoded, attn_mask=bias),
                                 (*decoded, bias), grad)
    for a, b in zip(mine, theirs):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_several_head_dimensions_are_taken_as_one():
    """Hiera's mask-unit attention calls SDPA on (B, heads, windows, N, d): the forward is
    torch's, the gradients torch's at the decoded operands."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 9, 8, generator=gen).requires_grad_() for _ in range(3))
    assert left_to_torch(SDPACall.bind((q, k, v), {})) is None
    out = ours(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    grad = torch.randn(out.shape, generator=gen)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    decoded = [unpack_heads(pack_heads(x.flatten(1, 2), quant), 6).reshape(x.shape)
               .requires_grad_() for x, quant in zip((q, k, v), quantizers())]
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(*decoded), decoded, grad)
    for a, b in zip(mine, theirs):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    mask = torch.ones(9, 9, dtype=torch.bool)
    assert 'several head dimensions' in left_to_torch(SDPACall.bind((q, k, v, mask), {}))


def test_left_to_torch_reasons():
    q, k, v = operands()
    assert left_to_torch(SDPACall.bind((q, k, v), {})) is None
    assert left_to_torch(SDPACall.bind((q, k, v, None, 0.1), {})).startswith('dropout_p')
    assert 'not (B, H, N, d)' in left_to_torch(SDPACall.bind((q[0], k[0], v[0]), {}))
    assert SDPACall.bind((q, k, v), {'unknown': 1}) is None



class LearnedQueries(nn.Module):
    """Cross-attention from learned queries (a Parameter, passed as it is) to the tokens."""

    def __init__(self, dim=32, heads=4, queries=5):
        super().__init__()
        self.heads = heads
        self.queries = nn.Parameter(torch.randn(1, heads, queries, dim // heads))
        self.kv = nn.Linear(dim, dim * 2)

    def forward(self, x):
        b, n, c = x.shape
        k, v = self.kv(x).reshape(b, n, 2, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(self.queries, k, v)


def test_a_parameter_operand_is_kept_as_it_is():
    """A Parameter operand is kept (not packed: it is kept anyway), the activations packed."""
    ref = LearnedQueries()
    mine = converted(ref)
    x = torch.randn(1, 12, 32)
    y_ref, gx_ref, _ = step(ref, x)
    y, gx, _ = step(mine, x)
    assert torch.equal(y, y_ref)
    assert cosine(gx, gx_ref) >= 0.999
    assert cosine(mine.queries.grad, ref.queries.grad) >= 0.999
    assert [key.split('_', 1)[1] for key in mine.mesa_sites] == ['attention_k', 'attention_v']
    q, k, v = operands(batch=1)
    quants = quantizers()
    grad = torch.randn(q.shape)
    grads = torch.autograd.grad(ours(q, k, v, (None, *quants[1:])), (q, k, v), grad)
    decoded = [q, *(unpack_heads(pack_heads(x, quant), 2).requires_grad_()
                    for x, quant in zip((k, v), quants[1:]))]
    expected = torch.autograd.grad(F.scaled_dot_product_attention(*decoded), decoded, grad)
    for mine_grad, theirs in zip(grads, expected):
        assert torch.allclose(mine_grad, theirs, rtol=1e-4, atol=1e-5)


def test_mmpretrain_attention_routes_its_sdpa():
    """mmpretrain's ``MultiheadAttention`` (its ViTs) converts with its own forward: the output
    is torch's bit for bit and its SDPA keeps 8-bit q, k and v."""
    pytest.importorskip('mmpretrain')
    from mmpretrain.models.utils.attention import MultiheadAttention

    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.memory import count_saved_tensors
    torch.manual_seed(0)
    reference = MultiheadAttention(embed_dims=64, num_heads=4).train()
    attention = copy.deepcopy(reference)
    report = convert_to_mesa(nn.ModuleList([attention]), config=MesaConfig())
    assert report.converted['0'][0] == 'MultiheadAttention'
    x = torch.randn(2, 49, 64, requires_grad=True)
    saved = []
    for module in (attention, reference):
        with count_saved_tensors(module) as counted:
            out = module(x)
        saved.append((out, counted.by_type.get('MultiheadAttention', 0)))
    (got, mesa_bytes), (want, torch_bytes) = saved
    assert torch.equal(got, want)
    assert 0 < mesa_bytes <= 0.3 * torch_bytes, (mesa_bytes, torch_bytes)
