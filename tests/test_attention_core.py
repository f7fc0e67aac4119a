"""Attention that keeps no map: the Function against torch, and the modules that use it."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import cosine
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.layers import attention_core
from mmseg_mesa.layers.attention_core import (
    CompactMask,
    MesaAttentionFunction,
    add_mask,
    pack_heads,
    refine_heads,
    relative_bias,
    unpack_heads,
    unpack_qkv,
)
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.quantizer import ActivationQuantizer, Packed, QuantSpec, Refined
from mmseg_mesa.saved import load


def quantizers(stochastic: bool = False, refine_error: float = math.inf
               ) -> tuple[ActivationQuantizer, ...]:
    return tuple(ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=1,
                                               stochastic=stochastic, ema_decay=0.9,
                                               refine_error=refine_error))
                 for _ in range(3))


def torch_attention(q, k, v, table, index, mask, score_scale, dropout_p):
    scores = q @ k.transpose(-2, -1)
    if score_scale is not None:
        scores = scores * score_scale
    if table is not None:
        scores = scores + relative_bias(table, index, q.shape[-2], k.shape[-2]).unsqueeze(0)
    if mask is not None:
        scores = add_mask(scores, mask)
    attn = F.softmax(scores, -1)
    if dropout_p:
        attn = F.dropout(attn, dropout_p, True)
    return attn @ v, attn


# (relative bias table, mask groups, score scale, dropout, need the map)
VARIANTS = [(True, 3, None, 0.0, False), (False, 2, 0.3, 0.0, False),
            (True, 0, None, 0.25, True), (False, 0, None, 0.0, True)]


def _operands(batch=6, heads=3, tokens=20, keys=20, dim=8, table_rows=30):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=gen).requires_grad_()
               for n in (tokens, keys, keys))
    table = torch.randn(table_rows, heads, generator=gen).requires_grad_()
    index = torch.randint(0, table_rows, (tokens, keys), generator=gen)
    return q, k, v, table, index


def codes(x, quant, refined):
    """What the Function keeps of an operand: its ``pack_heads`` codes, refined or not."""
    packed = pack_heads(x, quant)
    return refine_heads(packed, x) if refined else packed


@pytest.mark.parametrize('refined', [False, True])
@pytest.mark.parametrize('variant', VARIANTS)
@pytest.mark.parametrize('chunk', [None, 4096, 9600])
def test_backward_is_the_exact_gradient_at_the_decoded_operands(variant, chunk, refined,
                                                                 monkeypatch):
    """The recomputed maps make backward the exact gradient of attention evaluated at the 8-bit
    q, k and v (or the refined ones), whether backward works through whole images or through
    blocks of rows."""
    use_table, groups, score_scale, dropout_p, need_map = variant
    # these logits' 8-bit replay strays by 0.1-0.4: refined at any threshold below that
    limit = 0.0 if refined else math.inf
    if chunk is not None:  # 3 heads x 20 x 20 fp32 is 4800 bytes: blocks of rows, or of
        # two whole images
        monkeypatch.setattr(attention_core, 'MAP_BLOCK_BYTES', chunk)
    q, k, v, table, index = _operands()
    if not use_table:
        table = index = None
    mask = None
    if groups:
        mask = (torch.rand(groups, 1, 20, 20) < 0.3).float() * -100.0
    quants = quantizers(refine_error=limit)
    torch.manual_seed(5)
    result = MesaAttentionFunction.apply(q, k, v, table, index, mask, score_scale, dropout_p,
                                         need_map, quants)
    out = result[0] if need_map else result
    torch.manual_seed(5)
    expected, _ = torch_attention(q, k, v, table, index, mask, score_scale, dropout_p)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    params = [q, k, v] + ([table] if use_table else [])
    loss = (out * grad).sum()
    if need_map:
        loss = loss + result[1].sum(-2).square().sum() * 0  # the map's gradient path runs
    grads = torch.autograd.grad(loss, params)
    decoded = [unpack_heads(codes(x, quant, refined), 3).detach().requires_grad_()
               for x, quant in zip((q, k, v), quantizers())]
    torch.manual_seed(5)
    exact_out, _ = torch_attention(*decoded, table, index, mask, score_scale, dropout_p)
    exact = torch.autograd.grad((exact_out * grad).sum(), decoded + params[3:])
    for ours, theirs in zip(grads, exact):
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_qkv_codes_give_the_exact_gradient_at_the_decoded_projection():
    """Swin's and BEiT's path: q, k and v are views of one (B, N, 3 * H * d) projection, q then
    scaled; backward keeps that projection's codes and is the exact gradient of attention at
    the decoded projection. A projection of another shape is refused."""
    batch, tokens, heads, dim, scale = 4, 10, 2, 8, 0.35
    gen = torch.Generator().manual_seed(3)
    projected = torch.randn(batch, tokens, 3 * heads * dim, generator=gen).requires_grad_()
    table = torch.randn(12, heads, generator=gen).requires_grad_()
    index = torch.randint(0, 12, (tokens, tokens), generator=gen)

    def split(x):
        q, k, v = x.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4)
        return q * scale, k, v

    quant = ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=1, stochastic=False))
    out = MesaAttentionFunction.apply(*split(projected), table, index, None, None, 0.0, False,
                                      (quant,), projected, scale)
    expected, _ = torch_attention(*split(projected), table, index, None, None, 0.0)
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape, generator=gen)
    ours = torch.autograd.grad((out * grad).sum(), [projected, table])
    fresh = ActivationQuantizer(QuantSpec(bits=8, group_dim=-1, group_size=1, stochastic=False))
    decoded = [x.detach().requires_grad_()
               for x in unpack_qkv(fresh.pack(projected.detach()), heads, scale)]
    exact_out, _ = torch_attention(*decoded, table, index, None, None, 0.0)
    exact = torch.autograd.grad((exact_out * grad).sum(), decoded + [table])
    exact_projected = torch.stack([exact[0] * scale, exact[1], exact[2]]).permute(
        1, 3, 0, 2, 4).reshape(projected.shape)
    assert torch.allclose(ours[0], exact_projected, rtol=1e-4, atol=1e-5)
    assert torch.allclose(ours[1], exact[3], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match='not the projection of q'):
        MesaAttentionFunction.apply(*split(projected), table, index, None, None, 0.0, False,
                                    (quant,), projected[:, :, :-1], scale)


def test_a_loss_on_the_returned_map_reaches_q_and_k():
    q, k, v, _, _ = _operands()
    out, attn = MesaAttentionFunction.apply(q, k, v, None, None, None, None, 0.0, True,
                                            quantizers())
    grad_q, grad_k = torch.autograd.grad(attn.square().sum(), [q, k])
    exact = [x.detach().requires_grad_() for x in (q, k, v)]
    _, exact_attn = torch_attention(*exact, None, None, None, None, 0.0)
    exact_q, exact_k = torch.autograd.grad(exact_attn.square().sum(), exact[:2])
    assert cosine(grad_q, exact_q) > 0.99 and cosine(grad_k, exact_k) > 0.99


def test_compact_mask_is_exact():
    two = torch.where(torch.rand(4, 1, 9, 9) < 0.5, -100.0, 0.0)
    padding = torch.where(torch.rand(2, 1, 1, 9) < 0.5, float('-inf'), 0.0)
    many = torch.randn(2, 1, 9, 9)
    for mask in (two, padding, torch.zeros(1, 1, 9, 9)):
        compact = CompactMask.of(mask)
        assert compact.bits is not None and torch.equal(compact.restore(), mask)
    compact = CompactMask.of(many)
    assert compact.bits is None and compact.restore() is many


@pytest.mark.parametrize('scale', [0.1, 1.0])
def test_no_map_is_saved(scale):
    """What the Function keeps grows with the tokens, not with their square: q, k and v at one
    byte each where their replay holds (small logits), two where they are refined."""
    batch, heads, tokens, dim = 2, 4, 256, 16
    q, k, v = (torch.randn(batch, heads, tokens, dim) * scale for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = torch.where(torch.rand(1, 1, tokens, tokens) < 0.1, -100.0, 0.0)
    with count_saved_tensors() as report:
        out = MesaAttentionFunction.apply(q, k, v, None, None, mask, None, 0.1, False,
                                          quantizers(True, MesaConfig().attention_refine_error))
    one_map = batch * heads * tokens * tokens  # the uint8 codes Mesa keeps of the map
    kept = [type(item) for item in load(out.grad_fn)[:3]]
    assert kept == [Packed] * 3 if scale < 1 else kept == [Refined] * 3
    operands = 3 * batch * heads * tokens * dim * (1 if scale < 1 else 2)
    # the operands, their ranges, the mask and the dropout keep mask at one bit per element
    assert report.total_bytes < operands + one_map / 8 + tokens * tokens / 8 + 4096
    out.sum().backward()


def _beit(**kwargs):
    from mmseg.models.backbones.beit import BEiTAttention
    module = BEiTAttention(32, 4, (5, 5), **kwargs)
    with torch.no_grad():
        module.relative_position_bias_table.normal_()
        if module.bias == 'qv_bias':
            module.q_bias.normal_()
            module.v_bias.normal_()
    return module, (torch.randn(2, 26, 32),)


def _swin(shift):
    from mmseg.models.backbones.swin import ShiftWindowMSA
    module = ShiftWindowMSA(32, 4, 7, shift_size=shift, attn_drop_rate=0.1)
    with torch.no_grad():
        module.w_msa.relative_position_bias_table.normal_()
    return module, (torch.randn(2, 14 * 14, 32), (14, 14))


def _twins():
    from mmseg.models.backbones.twins import LocallyGroupedSelfAttention
    return (LocallyGroupedSelfAttention(32, 4, window_size=4, attn_drop_rate=0.1),
            (torch.randn(2, 9 * 10, 32), (9, 10)))


def _mha(batch_first):
    from mmcv.cnn.bricks.transformer import MultiheadAttention
    module = MultiheadAttention(32, 4, attn_drop=0.1, batch_first=batch_first)
    x = torch.randn(2, 17, 32) if batch_first else torch.randn(17, 2, 32)
    return module, (x,)


MODULES = {
    'beit_qv_bias': lambda: _beit(attn_drop_rate=0.1),
    'beit_qkv_bias': lambda: _beit(bias=True),
    'swin_window': lambda: _swin(0),
    'swin_shifted': lambda: _swin(3),
    'twins_padded': _twins,
    'mmcv_mha': lambda: _mha(False),
    'mmcv_mha_batch_first': lambda: _mha(True),
}


def _converted_step(make, attention_maps):
    module, inputs = make()
    module.train()
    inputs = [x.requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]
    converted = nn.Sequential(copy.deepcopy(module))
    report = convert_to_mesa(converted, config=MesaConfig(attention_maps=attention_maps))
    runs = []
    for model in (module, converted[0]):
        torch.manual_seed(3)
        with count_saved_tensors(model) as saved:
            out = model(*inputs)
        grads = torch.autograd.grad(out.square().sum(), [inputs[0], *model.parameters()],
                                    allow_unused=True)
        runs.append((out, grads, saved.total_bytes))
    return report, converted[0], runs


@pytest.mark.parametrize('name', MODULES)
def test_mmseg_attention_keeps_no_map_and_its_forward(name):
    report, converted, ((ref, ref_grads, _), (out, grads, saved)) = _converted_step(
        MODULES[name], 'recompute')
    from mmseg_mesa.layers.intercept import MesaFunctional
    assert torch.equal(ref, out)
    assert not isinstance(converted, MesaFunctional)
    pairs = [(a, b) for a, b in zip(ref_grads, grads) if a is not None and a.abs().max() > 0]
    assert pairs and all(cosine(a, b) > 0.99 for a, b in pairs)
    _, _, runs = _converted_step(MODULES[name], 'stored')
    assert saved < runs[1][2]


@pytest.mark.parametrize('name', ['beit_qv_bias', 'twins_padded'])
def test_stored_maps_or_an_own_forward_fall_back_to_the_functional_conversion(name):
    from mmseg_mesa.layers.intercept import MesaFunctional
    _, converted, ((ref, _, _), (out, _, _)) = _converted_step(MODULES[name], 'stored')
    assert isinstance(converted, MesaFunctional) and torch.equal(ref, out)

    module, inputs = MODULES[name]()
    own = type('OwnForward', (type(module),), {'forward': lambda self, *a: super(
        type(self), self).forward(*a)})
    module.__class__ = own
    holder = nn.Sequential(module)
    report = convert_to_mesa(holder, config=MesaConfig())
    assert isinstance(holder[0], MesaFunctional)
    assert 'has its own forward' in report.notes['0'] and 'attention maps' in report.format()


def test_attention_maps_is_validated():
    with pytest.raises(ValueError, match='attention_maps'):
        MesaConfig(attention_maps='none')
    assert MesaConfig.preset('paper').attention_maps == 'stored'


@pytest.mark.parametrize('attention_maps', ['recompute', 'stored'])
def test_saved_bytes_report_counts_the_maps(attention_maps):
    """``softmax_bytes``: torch's maps in the unconverted model, Mesa's 8-bit ones when stored,
    none when recomputed."""
    module, inputs = _mha(False)
    module.train()
    converted = nn.Sequential(copy.deepcopy(module))
    convert_to_mesa(converted, config=MesaConfig(attention_maps=attention_maps))
    one_map = 2 * 4 * 17 * 17
    x = inputs[0].requires_grad_()
    with count_saved_tensors(module) as plain:
        module(x)
    with count_saved_tensors(converted) as mesa:
        converted(x)
    assert plain.softmax_bytes >= one_map * 4
    if attention_maps == 'stored':
        assert one_map <= mesa.softmax_bytes < one_map * 2
    else:
        assert mesa.softmax_bytes == 0


@pytest.mark.parametrize('scale', [0.3, 3.0])
def test_logits_an_8_bit_replay_would_move_keep_refined_operands(scale, monkeypatch):
    """q, k and v are refined to about 16 bits where a replay from 8-bit ones would move the
    logits by more than ``attention_refine_error`` (larger logits, as training makes them): the
    gradient is then close to torch's, where 8-bit operands miss it; small logits keep 8 bits."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 64, 16, generator=gen) for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q * scale, k * scale, v))
    grad = torch.randn(2, 3, 64, 16, generator=gen)
    exact = torch.autograd.grad(
        ((F.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v) * grad).sum(), (q, k, v))

    def error(threshold):
        out = MesaAttentionFunction.apply(q, k, v, None, None, None, 0.25, 0.0, False,
                                          quantizers(True, threshold))
        kept = {type(item) for item in load(out.grad_fn)[:3]}
        got = torch.autograd.grad((out * grad).sum(), (q, k, v))
        got, want = (torch.cat([g.flatten() for g in grads]) for grads in (got, exact))
        return ((got - want).norm() / want.norm()).item(), kept

    default = MesaConfig().attention_refine_error
    eight_bit, kept = error(math.inf)
    assert kept == {Packed}
    ours, kept = error(default)
    if scale < 1:  # replays within 0.005: 8 bits as they are
        assert kept == {Packed} and ours == pytest.approx(eight_bit, rel=0.2)
    else:  # 8 bits replay 0.34-0.38 off: gradient error 0.06
        assert kept == {Refined} and eight_bit > 0.03 and ours < 0.001


def test_an_infinite_refine_error_measures_no_replay(monkeypatch):
    """``attention_refine_error=math.inf`` never refines, so converted attention and SDPA decode
    nothing and read nothing back from the device for it in forward; a finite limit measures."""
    from mmseg_mesa.layers.sdpa import MesaSDPAFunction
    measured = []
    heads_error = attention_core.heads_error
    monkeypatch.setattr(attention_core, 'heads_error',
                        lambda *a: measured.append(1) or heads_error(*a))
    q, k, v = (torch.randn(2, 3, 16, 8).requires_grad_() for _ in range(3))
    for limit in (math.inf, 0.05):
        MesaAttentionFunction.apply(q, k, v, None, None, None, 0.3, 0.0, False,
                                    quantizers(False, limit)).sum().backward()
        MesaSDPAFunction.apply(q, k, v, None, False, None, False,
                               quantizers(False, limit)).sum().backward()
        assert len(measured) == (0 if limit == math.inf else 2)
