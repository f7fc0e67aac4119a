import dataclasses

import pytest

from mmseg_mesa import MesaConfig
from mmseg_mesa.layer_types import layer_types

LAYER_TYPES = layer_types()


def test_defaults_are_the_papers():
    cfg = MesaConfig()
    assert cfg.bits == 8 and cfg.ema_decay == 0.9 and cfg.stochastic_rounding
    # every type but drop path, whose 1-bit mask would stand for one number per sample
    assert cfg.layers == frozenset(LAYER_TYPES) - {'droppath'}
    assert 'droppath' in MesaConfig(layers=LAYER_TYPES).layers
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 4


@pytest.mark.parametrize('key, value, allowed', [
    ('bits', 3, '2, 4, 8, 16'),
    ('bits', 32, '2, 4, 8, 16'),
    ('bits', True, '2, 4, 8, 16'),
    ('layer_bits', {'gelu': 12}, '2, 4, 8, 16'),
    ('division_bits', 16, '2, 4, 8'),
    ('group_size', 0, 'integer >= 1'),
    ('ema_decay', 1.0, '[0, 1)'),
    ('ema_decay', -0.1, '[0, 1)'),
    ('backend', 'triton', 'auto, cuda, torch'),
    ('layers', ['linear', 'lstm'], 'linear'),
    ('layers', 'linear', 'a collection'),
    ('stochastic_rounding', 1, 'True or False'),
    ('nearest_rounding', ['batchnorm', 'lstm'], 'linear'),
    ('skip', (1,), 'fnmatch patterns'),
    ('attention_refine_error', -0.1, 'a number >= 0'),
    ('attention_refine_error', None, 'math.inf: never refine'),
    ('attention_refine_error', float('nan'), 'a number >= 0'),
    ('batchnorm_refine_below', -1, 'an integer >= 0'),
    ('batchnorm_refine_below', 1.5, 'an integer >= 0'),
    ('batchnorm_refine_below', True, '0: never refine'),
])
def test_bad_values_name_key_and_allowed(key, value, allowed):
    with pytest.raises(ValueError) as err:
        MesaConfig(**{key: value})
    assert key in str(err.value) and allowed in str(err.value)


def test_from_cfg_forms():
    assert MesaConfig.from_cfg(None) is None
    assert MesaConfig.from_cfg(False) is None
    assert MesaConfig.from_cfg(True) == MesaConfig()
    cfg = MesaConfig.from_cfg(dict(bits=4, layers=['linear', 'gelu'], skip=['decode_head.*']))
    assert cfg.bits == 4 and cfg.layers == {'linear', 'gelu'} and cfg.skip == ('decode_head.*',)
    assert MesaConfig.from_cfg(dict(attention_refine_error=0.2)).attention_refine_error == 0.2


def test_attention_quantizers_carry_the_refine_error():
    """The config's ``attention_refine_error`` reaches the specs of the quantizers a converted
    attention packs q, k and v with (``layers.attention_core.refine_limit``)."""
    import math

    from torch import nn

    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.layers.attention_core import refine_limit
    for limit in (0.05, 0.2, math.inf):
        model = nn.Sequential(nn.MultiheadAttention(8, 2))
        convert_to_mesa(model, config=MesaConfig(attention_refine_error=limit))
        assert refine_limit(model[0].quant_attn_q) == refine_limit(model[0].quant_attn_k) == limit


def test_norm_and_activation_codes_round_to_nearest_unless_told_otherwise():
    default = MesaConfig()
    nearest = {'batchnorm', 'gelu', 'activation'}
    assert default.nearest_rounding == nearest
    assert not any(default.for_layer(t).stochastic_rounding for t in nearest)
    assert all(default.for_layer(t).stochastic_rounding for t in LAYER_TYPES if t not in nearest)
    every = MesaConfig(nearest_rounding=())
    assert all(every.for_layer(t).stochastic_rounding for t in LAYER_TYPES)
    none = MesaConfig(stochastic_rounding=False)
    assert not any(none.for_layer(t).stochastic_rounding for t in LAYER_TYPES)
    # resolving twice (attention resolves its matmuls from its own config) changes nothing
    once = default.for_layer('batchnorm')
    assert once.for_layer('batchnorm') == once
    cfg = MesaConfig.from_cfg(dict(nearest_rounding=['gelu', 'batchnorm']))
    assert cfg.nearest_rounding == {'gelu', 'batchnorm'} and not cfg.for_layer('gelu') \
        .stochastic_rounding


def test_from_cfg_unknown_key_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        MesaConfig.from_cfg(dict(bit=8))
    message = str(err.value)
    assert "'bit'" in message and 'bits' in message and 'ema_decay' in message


def test_from_cfg_rejects_other_types():
    with pytest.raises(ValueError, match="unknown preset 'yes'"):
        MesaConfig.from_cfg('yes')
    with pytest.raises(ValueError, match='mesa must be'):
        MesaConfig.from_cfg(8)
