"""The measurement behind every memory figure: bytes saved for backward, exactly."""
import json
import os.path as osp
import sys

import pytest
import torch
from torch import nn

from mmseg_mesa import MesaConfig, MesaLinear, convert_to_mesa
from mmseg_mesa.memory import count_saved_tensors

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def test_known_sizes_are_counted_exactly():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(5, 32)
    with count_saved_tensors(model) as report:
        model(x)
    # Linear saves its input (weights are parameters, excluded); ReLU its output; the second
    # Linear saves ReLU's output, the same storage, counted once.
    assert report.total_bytes == 5 * 32 * 4 + 5 * 64 * 4
    assert report.by_type == {'Linear': 5 * 32 * 4, 'ReLU': 5 * 64 * 4}


def test_packed_activations_are_counted_as_stored():
    model = nn.Sequential(nn.Linear(32, 64))
    convert_to_mesa(model, config=MesaConfig(group_size=1))
    x = torch.randn(5, 32)
    with count_saved_tensors(model) as report:
        model(x)
    # uint8 codes, plus fp32 lower and scale per channel (32 groups)
    assert report.total_bytes == 5 * 32 + 2 * 32 * 4
    assert report.by_type == {'Linear': 5 * 32 + 2 * 32 * 4}  # counted as the type it replaced


def test_functional_saves_and_no_model():
    x = torch.randn(10, requires_grad=True)
    with count_saved_tensors() as report:
        (x.exp() * 2).sum()
    assert report.total_bytes == 10 * 4  # exp saves its result
    assert report.by_type == {'<functional>': 10 * 4}


def test_hooks_do_not_change_outputs():
    model = nn.Sequential(MesaLinear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    with count_saved_tensors(model):
        y = model(x)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 4)


def test_benchmark_memory_tool_on_the_demo_config(tmp_path):
    sys.path.insert(0, osp.join(ROOT, 'tools'))
    import benchmark_memory
    out, png = tmp_path / 'r.json', tmp_path / 'r.png'
    results = benchmark_memory.main([
        osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py'), '--modes', 'baseline',
        'mesa', 'mesa:mesa', 'mesa:max-saving', 'amp', 'mesa+amp', '--batch', '2',
        '--size', '32', '32', '--json', str(out), '--plot', str(png)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(results))
    assert set(saved) >= {'config', 'device', 'batch', 'size', 'modes'}
    modes = saved['modes']
    for entry in modes.values():
        assert set(entry) >= {'saved_bytes', 'peak_bytes', 'step_time_s', 'by_type'}
        assert sum(entry['by_type'].values()) == entry['saved_bytes']
    assert modes['mesa']['saved_bytes'] < 0.45 * modes['baseline']['saved_bytes']
    assert modes['mesa+amp']['saved_bytes'] < modes['amp']['saved_bytes']
    # the paper's preset keeps the full-resolution loss; max-saving is below the default
    assert modes['mesa']['saved_bytes'] < modes['mesa:mesa']['saved_bytes']
    assert modes['mesa:max-saving']['saved_bytes'] < 0.7 * modes['mesa']['saved_bytes']
    division = benchmark_memory.main([
        osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py'), '--modes', 'mesa',
        '--batch', '2', '--size', '32', '32', '--cfg-options', 'mesa.division=[conv2d,batchnorm]'])
    assert 'division' in division['mesa']
    assert division['modes']['mesa']['saved_bytes'] < modes['mesa']['saved_bytes']
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize('bad', ['mesa:tiny', 'amp:max-saving', 'mesa+amp+amp', 'mesa+fp8',
                                 'baseline+amp', 'mesa:'])
def test_benchmark_memory_rejects_bad_modes(bad, capsys):
    sys.path.insert(0, osp.join(ROOT, 'tools'))
    import benchmark_memory
    with pytest.raises(SystemExit):
        benchmark_memory.parse_args(['--modes', bad])
    assert 'invalid mode' in capsys.readouterr().err
