"""Codes one layer offers the next (mmseg_mesa.reuse): reused where they are what the next
layer would store, packed again with the reason where not, and counted either way."""
import copy

import pytest
import torch
from mmseg_models import DEIT_S, SWIN_T, batch, build_model
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.memory import count_saved_tensors
from mmseg_mesa.reuse import count_reuse


def norm_then_linear(config):
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4))
    convert_to_mesa(model, config=config)
    return model.train()


def test_matching_codes_are_reused_and_others_packed_again_with_the_reason():
    x = torch.randn(4, 10, 16, requires_grad=True)
    default = norm_then_linear(MesaConfig())
    with count_reuse(default) as counts, count_saved_tensors(default) as shared:
        default(x)
    assert counts.hits['Linear'] == 2 and not counts.misses  # after the norm, after the GELU
    four_bit_norm = norm_then_linear(MesaConfig(layer_bits={'layernorm': 4}))
    with count_reuse(four_bit_norm) as counts, count_saved_tensors(four_bit_norm) as own:
        four_bit_norm(x)
    assert counts.hits['Linear'] == 1
    assert counts.misses == {('Linear', '4-bit codes, 8-bit wanted'): 1}
    assert own.total_bytes > shared.total_bytes  # the second copy costs bytes
    assert 'Linear: 1 reused, 1 packed again (1 x 4-bit codes, 8-bit wanted)' in \
        counts.summary()


def test_a_versioned_hand_off_holds_until_an_in_place_write():
    """``HandOff(versioned=True)``: the entry while the tensor is unchanged, then None and
    ``stale``; an unversioned one keeps its entry whatever happens to the tensor."""
    from mmseg_mesa.handoff import HandOff
    versioned, plain = HandOff('v', 'test', versioned=True), HandOff('p', 'test')
    t, other = torch.zeros(3), torch.zeros(3)
    versioned.offer(t, 'codes')
    plain.offer(t, 'label')
    assert versioned.get(t) == 'codes' and not versioned.stale(t)
    assert versioned.get(other) is None and not versioned.stale(other)
    t.add_(1)
    assert versioned.get(t) is None and versioned.stale(t)
    assert plain.get(t) == 'label' and not plain.stale(t)
    versioned.offer(t, 'new codes')
    assert versioned.get(t) == 'new codes' and not versioned.stale(t)


def test_an_in_place_change_is_a_miss():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(self.norm(x).mul_(2.0))

    model = Scaled()
    convert_to_mesa(model)
    with count_reuse(model.train()) as counts:
        model(torch.randn(3, 16, requires_grad=True))
    assert counts.misses == {('Linear', 'modified in place since'): 1}


def test_a_norm_output_decodes_through_its_affine_and_guards_its_parameters():
    """A LayerNorm's output is its normalized input's codes with the affine folded into their
    own (``codes.Affine``): the Linear decodes it to the output's codes' values, and an in-place
    update of the norm's weight before backward raises as torch's own saved weight would."""
    from mmseg_mesa.codes import Affine
    from mmseg_mesa.quantizer import unpack
    from mmseg_mesa.reuse import attached_codes
    torch.manual_seed(0)
    model = norm_then_linear(MesaConfig(stochastic_rounding=False))
    norm = model[0]
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(4, 10, 16, requires_grad=True)
    y = norm(x)
    codes = attached_codes(y, model[1].quant_input.spec)
    assert isinstance(codes, Affine) and codes.weight is norm.weight
    source = unpack(codes.source, torch.float32) * norm.weight + norm.bias
    assert torch.allclose(unpack(codes), source, rtol=0, atol=1e-5)
    # one step of the codes' (absolute) scale times |weight| from the exact output
    step = (codes.source.scale * norm.weight.abs()).max()
    assert (unpack(codes) - y).abs().max() <= 0.5 * step + 1e-5
    model(x).sum().backward()  # unchanged: fine
    out = model(x).sum()
    with torch.no_grad():
        norm.weight.mul_(2)
    with pytest.raises(RuntimeError, match='modified by an inplace operation'):
        out.backward()


@pytest.mark.parametrize('name, options', [
    (SWIN_T, None), (DEIT_S, {'model.backbone.img_size': (64, 64)})])
def test_transformer_upernets_reuse_every_code_the_design_expects(name, options):
    """Default preset: every norm / GELU output a Linear saves is the norm's or GELU's codes,
    and no offered code is packed again."""
    reference = build_model(name, options=options)
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    blocks = sum(len(stage.blocks) for stage in model.backbone.stages) if name == SWIN_T \
        else len(model.backbone.layers)
    assert blocks == 12
    with count_reuse(model.train()) as counts:
        model(*batch(64, n=2), mode='loss')
    assert not counts.misses, counts.summary()
    # norm2 -> fc1 and GELU -> fc2 in every block (Swin's qkv reads shifted windows of norm1's
    # output, a copy; ViT's ln1 feeds nn.MultiheadAttention's own projection)
    assert counts.hits['Linear'] >= 2 * blocks, counts.summary()
