"""What Mesa leaves uncompressed, and who holds it (``mmseg_mesa.bench.coverage``, the measure of
tools/coverage.py); MobileNetV2's acceptance."""
import copy
import json
import os.path as osp

import pytest
import torch
from mmseg_models import batch, build_model, total_loss
from tool_runs import run_tool
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.bench import coverage
from mmseg_mesa.bench.models import load_config

MOBILENET_V2 = 'mobilenet_v2/mobilenet-v2-d8_deeplabv3plus_4xb4-160k_ade20k-512x512.py'


class Exp(nn.Module):
    def forward(self, x):
        return x.exp()  # saves its output, in full precision


def test_split_attributes_exactly_what_non_mesa_ops_save():
    model = nn.Sequential(nn.Linear(32, 64), Exp(), nn.Linear(64, 8))
    convert_to_mesa(model)
    x = torch.randn(5, 32, requires_grad=True)
    result = coverage.split_saved(model, lambda: [model(x)])
    # Mesa's Linears save uint8 codes plus fp32 lower/scale per channel; exp keeps its output
    mesa_bytes = 5 * 32 + 2 * 32 * 4 + 5 * 64 + 2 * 64 * 4
    assert result['left_by_module'] == {'1': 5 * 64 * 4}
    assert result['left_bytes'] == 5 * 64 * 4
    assert result['saved_bytes'] == mesa_bytes + 5 * 64 * 4
    # of Mesa's bytes, the per-channel lower / scale vectors are floating point
    assert result['mesa_float_by_module'] == {'0': 2 * 32 * 4, '2': 2 * 64 * 4}


def test_functional_ops_outside_modules_count_as_left():
    model = nn.Sequential(nn.Linear(8, 8))
    convert_to_mesa(model)
    y = torch.randn(3, 8, requires_grad=True)
    result = coverage.split_saved(model, lambda: [torch.sigmoid(model(y))])
    assert result['left_by_module'] == {'<functional>': 3 * 8 * 4}


@pytest.fixture(scope='module')
def mobilenet_v2(tmp_path_factory):
    """MobileNetV2 DeepLabV3+ (ReLU6 everywhere), before (without the issue-13 layer types, through
    the library) and after (through ``tools/coverage.py``, with its JSON and printed report)."""
    config = osp.join(osp.dirname(__import__('mmseg').__file__), '.mim', 'configs', MOBILENET_V2)
    old_layers = ['linear', 'conv2d', 'gelu', 'softmax', 'layernorm', 'matmul', 'batchnorm',
                  'relu', 'dropout', 'droppath', 'attention', 'loss']
    cfg = load_config(config, {'mesa.layers': old_layers})
    before = dict(config=config, **coverage.coverage(cfg, (64, 64), 2))
    out = tmp_path_factory.mktemp('coverage') / 'after.json'
    result = run_tool('coverage', config, '--size', '64', '64', '--batch', '2', '--top', '5',
                      '--json', out)
    assert result.returncode == 0, result.stderr[-4000:]
    after = json.loads(out.read_text())
    assert coverage.format_result(after, top=5) in result.stdout
    return after, before


@pytest.mark.slow
def test_mobilenet_v2_leaves_little_uncompressed(mobilenet_v2):
    after, before = mobilenet_v2
    for result in (after, before):
        assert result['baseline_bytes'] > 0
        assert sum(r['bytes'] for r in result['left_by_module']) == result['left_bytes']
        assert sum(r['bytes'] for r in result['left_by_type']) == result['left_bytes']
        assert 0 <= result['left_share'] < result['saved_ratio'] < 1
        assert result['left_share'] + result['mesa_float_share'] <= result['saved_ratio']
    # without the new layers ReLU6 holds most of what is left; with them it is gone
    assert before['left_by_type'][0]['type'] == 'ReLU6'
    assert before['left_share'] > 0.1
    assert after['left_share'] <= 0.03
    assert 'ReLU6' not in {r['type'] for r in after['left_by_type']}
    assert after['saved_ratio'] < before['saved_ratio']
    text = coverage.format_result(after, top=5)
    assert 'left uncompressed: ' in text and 'Dropout2d' in text  # what is left, by name
    # the reuse of one layer's codes by the next, per layer type: nothing packed twice here
    assert 'Conv2d: ' in after['reuse'] and 'packed again (' not in after['reuse']
    assert after['reuse'].splitlines()[0] in text


def test_mobilenet_v2_converted_losses_exact_gradients_close():
    """MobileNetV2 DeepLabV3+ (random init, 64x64, batch 2, default
    preset): the same losses bit for bit, whole-gradient relative error <= 0.02."""
    reference = build_model(MOBILENET_V2)
    reference.train()
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model, config=MesaConfig())
    assert report.converted_by_type()['ReLU6'] == 34
    inputs, samples = batch(64)
    losses = []
    for net in (reference, model):
        torch.manual_seed(1)
        result = net(inputs, samples, mode='loss')
        losses.append({k: v for k, v in result.items() if 'loss' in k})
        total_loss(result).backward()
    assert all(torch.equal(losses[0][k], losses[1][k]) for k in losses[0])
    exact = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = dict(model.named_parameters())
    error = sum((got[n].grad - g).double().pow(2).sum() for n, g in exact.items())
    norm = sum(g.double().pow(2).sum() for g in exact.values())
    assert (error / norm).sqrt() <= 0.02
