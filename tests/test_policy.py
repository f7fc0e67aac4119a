"""Presets and per-layer policies: which layer gets which compressor and bit width."""
import pytest
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.config import PRESETS
from mmseg_mesa.division import DivisionCompressor
from mmseg_mesa.layer_types import division_layer_types, layer_types
from mmseg_mesa.quantizer import ActivationQuantizer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.gelu = nn.GELU()
        self.softmax = nn.Softmax(-1)
        self.head = nn.Conv2d(8, 2, 1)


def quantizer(model, name):
    return model.get_submodule(name).get_submodule(
        'quant_output' if name == 'softmax' else 'quant_input')


def test_every_preset_is_a_valid_config():
    assert set(PRESETS) == {'paper', 'default', 'stored-maps'}
    assert MesaConfig().attention_maps == 'recompute'
    assert MesaConfig.preset('stored-maps') == MesaConfig(attention_maps='stored')
    assert MesaConfig.preset('default') == MesaConfig() == MesaConfig.from_cfg(True)
    assert MesaConfig.preset('paper').layers == MesaConfig().layers - {'loss'}
    assert MesaConfig.preset('paper').bits == 8
    assert MesaConfig.preset('paper', ema_decay=0.5).ema_decay == 0.5


def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="unknown preset 'tiny'.*stored-maps"):
        MesaConfig.preset('tiny')


@pytest.mark.parametrize('value', ['max-saving', dict(preset='max-saving', bits=8)])
def test_removed_preset_says_why_and_what_gives_the_same(value):
    with pytest.raises(ValueError, match="preset 'max-saving' was removed: it saved no memory"
                       ".*layer_bits=dict.layernorm=4.*presets: paper, default, stored-maps"):
        MesaConfig.from_cfg(value)


@pytest.mark.parametrize('value', ['mesa', dict(preset='mesa', bits=4)])
def test_renamed_preset_names_its_new_name(value):
    # the paper's preset is not what `mesa = True` gives, so it is not called 'mesa'
    with pytest.raises(ValueError, match="preset 'mesa' was renamed to 'paper'"):
        MesaConfig.from_cfg(value)
    with pytest.raises(ValueError, match="renamed to 'paper'"):
        MesaConfig.preset('mesa')


def test_layer_bits_per_layer_type():
    model = Block()
    convert_to_mesa(model, config=MesaConfig(layer_bits={'layernorm': 4}))
    # 4-bit codes for LayerNorm's normalized input only; 8 bits elsewhere (BatchNorm too)
    for name in ('stem', 'head', 'bn', 'fc', 'gelu', 'norm', 'softmax'):
        assert isinstance(quantizer(model, name), ActivationQuantizer), name
        assert quantizer(model, name).spec.bits == (4 if name == 'norm' else 8), name


def test_division_by_layer_type():
    model = Block()
    convert_to_mesa(model, config=MesaConfig(division={'conv2d', 'batchnorm'},
                                             layer_bits={'linear': 4}))
    for name in ('stem', 'head', 'bn'):
        assert isinstance(quantizer(model, name), DivisionCompressor), name
        assert quantizer(model, name).spec.bits == 2 and quantizer(model, name).spec.block == 8
    assert isinstance(quantizer(model, 'fc'), ActivationQuantizer)
    assert quantizer(model, 'fc').spec.bits == 4 and quantizer(model, 'gelu').spec.bits == 8


def test_layer_bits_and_name_patterns():
    model = Block()
    config = MesaConfig(bits=8, layer_bits={'linear': 2, 'gelu': 4}, division_modules=('head',),
                        division_bits=4, division_block=4)
    convert_to_mesa(model, config=config)
    assert quantizer(model, 'fc').spec.bits == 2
    assert quantizer(model, 'gelu').spec.bits == 4
    assert quantizer(model, 'norm').spec.bits == 8
    assert isinstance(quantizer(model, 'stem'), ActivationQuantizer)
    head = quantizer(model, 'head')
    assert isinstance(head, DivisionCompressor) and head.spec.bits == 4 and head.spec.block == 4


def test_global_division_covers_feature_maps_only():
    config = MesaConfig(compressor='division')
    for layer_type in layer_types():
        expected = 'division' if layer_type in division_layer_types() else 'mesa'
        assert config.for_layer(layer_type).compressor == expected
    with pytest.raises(ValueError, match="unknown layer type 'lstm'"):
        config.for_layer('lstm')


@pytest.mark.parametrize('key, value, allowed', [
    ('layer_bits', {'linear': 3}, 'bit widths 2, 4, 8'),
    ('layer_bits', {'lstm': 4}, 'linear'),
    ('layer_bits', 4, 'a mapping'),
    ('compressor', 'actnn', 'mesa, division'),
    ('division', ['softmax'], 'linear, conv2d'),
    ('division_block', 1, 'integer >= 2'),
    ('division_bits', 1, '2, 4, 8'),
    ('division_modules', [3], 'fnmatch'),
])
def test_bad_policy_values_name_key_and_allowed(key, value, allowed):
    with pytest.raises(ValueError) as err:
        MesaConfig(**{key: value})
    assert key in str(err.value) and allowed in str(err.value)


def test_from_cfg_presets():
    assert MesaConfig.from_cfg('stored-maps') == MesaConfig.preset('stored-maps')
    cfg = MesaConfig.from_cfg(dict(preset='paper', bits=4, division_modules=['decode_head.*']))
    assert cfg.bits == 4 and 'loss' not in cfg.layers and cfg.division_modules == ('decode_head.*',)
    cfg = MesaConfig.from_cfg(dict(layer_bits=dict(gelu=4)))
    assert cfg.layer_bits == (('gelu', 4),)


def test_attention_bits_reach_its_inner_matmuls_unless_they_have_their_own():
    model = nn.Sequential(nn.MultiheadAttention(16, 2))
    convert_to_mesa(model, config=MesaConfig(layer_bits={'attention': 4, 'softmax': 8}))
    attention = model[0]
    assert attention.quant_q.spec.bits == 4
    assert attention.mesa_qk.quant_a.spec.bits == 4 and attention.mesa_av.quant_b.spec.bits == 4
    assert attention.mesa_softmax.quant_output.spec.bits == 8
