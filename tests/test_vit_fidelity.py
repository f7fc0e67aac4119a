"""One training step of mmseg's own models: Mesa's whole gradient against the exact one.

The figures of docs/benchmarks.md ("Gradient fidelity") come from tools/gradient_fidelity.py,
whose measurement (``mmseg_mesa.bench.fidelity``) these tests share. Plain ViTs are the hard
case: their class token and position embeddings start at zero (or std 0.02), so tokens of tiny
spread pass through every LayerNorm; a LayerNorm backward that recomputes the statistics from
quantized inputs made the ``pos_embed`` gradient's cosine 0.83 at 256x256.
"""
import copy

import pytest
from mmseg_models import DEIT_S, SWIN_T, VIT_B_MLN, batch, build_model

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.bench.fidelity import cosines, gradients, relative_error

pytestmark = pytest.mark.slow  # whole models, a training step each

# config -> (largest whole-gradient relative error, smallest pos_embed cosine)
LIMITS = {'default': (0.01, 0.999), 'layernorm-4bit': (0.10, 0.99)}
CONFIGS = {'default': MesaConfig(), 'layernorm-4bit': MesaConfig(layer_bits={'layernorm': 4})}
# Without init_weights() every token of an image is its patch embedding alone (zero position
# embeddings and class token): DeiT-S then measures 0.0093-0.0100 over four rounding draws at
# the default preset on this batch (0.0126 on tools/gradient_fidelity.py's, one draw), the
# summed 8-bit stochastic-rounding noise of its layers (no one layer type carries it;
# docs/benchmarks.md); with stored attention maps and the former rounding stream it measured
# 0.0115-0.0137, ViT-B 0.0097. The default's 0.01 holds at the configs' own crop instead
# (test_vit_without_init_holds_at_the_configs_crop).
NO_INIT_DEFAULT_ERROR = 0.0125
VITS = {'deit-s': DEIT_S, 'vit-b-mln': VIT_B_MLN}


def mesa_gradients(reference, config, data):
    model = copy.deepcopy(reference)
    convert_to_mesa(model, config=config)
    return gradients(model, data)


@pytest.fixture(scope='module', params=[(name, init) for name in VITS for init in (True, False)],
                ids=lambda p: f'{p[0]}-{"init" if p[1] else "no-init"}')
def vit(request):
    name, init = request.param
    reference = build_model(VITS[name], init_weights=init)
    data = batch(128, n=2)
    return reference, data, gradients(reference, data), init


@pytest.mark.parametrize('preset', list(LIMITS))
def test_vit_gradients_hold(vit, preset):
    reference, data, exact, init = vit
    got = mesa_gradients(reference, CONFIGS[preset], data)
    max_error, min_pos_embed = LIMITS[preset]
    if preset == 'default' and not init:
        max_error = NO_INIT_DEFAULT_ERROR
    per_param = cosines(got, exact)
    assert relative_error(got, exact) <= max_error
    assert per_param['backbone.pos_embed'] >= min_pos_embed
    assert min(per_param.values()) >= min_pos_embed - 0.01, min(per_param, key=per_param.get)


@pytest.mark.parametrize('preset', list(LIMITS))
def test_swin_t_gradients_hold(preset):
    reference = build_model(SWIN_T)
    data = batch(128, n=2)
    exact = gradients(reference, data)
    got = mesa_gradients(reference, CONFIGS[preset], data)
    assert relative_error(got, exact) <= LIMITS[preset][0]


@pytest.mark.parametrize('name', list(VITS))
def test_vit_without_init_holds_at_the_configs_crop(name):
    """Without init_weights() the 128x128 figure above is over 0.01; at the configs' own crop
    (512x512, what training uses) the default meets the default's limits: DeiT-S 0.0080, ViT-B
    0.0074 on this batch (DeiT-S 0.0076 on tools/gradient_fidelity.py's), pos_embed cosine
    0.9998 / 0.9997. The one-step error falls as the gradients sum over more tokens. About 30 s
    and 110 s on two cores."""
    reference = build_model(VITS[name], init_weights=False)
    data = batch(512, n=2)
    exact = gradients(reference, data)
    got = mesa_gradients(reference, MesaConfig(), data)
    per_param = cosines(got, exact)
    assert relative_error(got, exact) <= LIMITS['default'][0]
    assert per_param['backbone.pos_embed'] >= LIMITS['default'][1]
