"""The measurement behind every memory figure: bytes saved for backward, exactly.

The ``test_benchmark_memory*`` and ``test_budget_planner*`` tests need mmengine and mmseg
(``mmseg_mesa.bench``, ``tools/benchmark_memory.py``); the others only the core package."""
import argparse
import json
import os.path as osp

import pytest
import torch
from tool_runs import run_tool
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.layers import MesaConv2d, MesaLinear
from mmseg_mesa.memory import BatchPlan, count_saved_tensors, format_bytes, parse_bytes

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')


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


def test_a_freed_storage_does_not_hide_the_next_one_at_its_address():
    """Storages freed inside the block (a dropped graph, a recomputation in backward) give their
    address back to the allocator; each later storage saved there still counts."""
    leaf = torch.randn(1 << 18, requires_grad=True)
    addresses = set()
    with count_saved_tensors() as report:
        for _ in range(6):
            factor = torch.full_like(leaf, 2.0, requires_grad=False)
            addresses.add(factor.data_ptr())
            product = leaf * factor  # saves ``factor``; freed with ``product``'s graph
            del product, factor
    assert report.total_bytes == 6 * leaf.numel() * 4, (report.total_bytes, len(addresses))


def test_hooks_do_not_change_outputs():
    model = nn.Sequential(MesaLinear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    with count_saved_tensors(model):
        y = model(x)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 4)


@pytest.mark.slow
def test_benchmark_memory_tool_on_the_demo_config(tmp_path):
    out, png = tmp_path / 'r.json', tmp_path / 'r.png'
    result = run_tool('benchmark_memory', DEMO, '--modes', 'baseline', 'mesa', 'mesa:paper',
                      'amp', 'mesa+amp', '--batch', '2', '--size', '32', '32',
                      '--json', out, '--plot', png)
    assert result.returncode == 0, result.stderr[-4000:]
    assert 'Saved MiB by module type' in result.stdout  # the table
    saved = json.loads(out.read_text())
    assert set(saved) >= {'config', 'device', 'batch', 'size', 'modes'}
    modes = saved['modes']
    for entry in modes.values():
        assert set(entry) >= {'saved_bytes', 'peak_bytes', 'step_time_s', 'by_type',
                              'peak_by_category', 'peak_phase', 'peak_module', 'phase_peaks'}
        assert sum(entry['by_type'].values()) == entry['saved_bytes']
        # the step's peak, by category: weights, gradients and AdamW state are all in it
        assert sum(entry['peak_by_category'].values()) == entry['peak_bytes']
        assert entry['peak_bytes'] == max(entry['phase_peaks'].values())
        assert entry['peak_phase'] in ('forward', 'backward', 'optimizer')
        assert entry['peak_by_category']['Parameter'] > 0
        assert entry['peak_by_category']['Optstate'] >= entry['peak_by_category']['Parameter']
    assert modes['mesa']['saved_bytes'] < 0.45 * modes['baseline']['saved_bytes']
    assert modes['mesa+amp']['saved_bytes'] < modes['amp']['saved_bytes']
    # the paper's preset keeps the full-resolution loss
    assert modes['mesa']['saved_bytes'] < modes['mesa:paper']['saved_bytes']
    result = run_tool('benchmark_memory', DEMO, '--modes', 'mesa', '--batch', '2', '--size', '32',
                      '32', '--cfg-options', 'mesa.division=[conv2d,batchnorm]', '--json',
                      tmp_path / 'division.json')
    assert result.returncode == 0, result.stderr[-4000:]
    division = json.loads((tmp_path / 'division.json').read_text())
    assert 'division' in division['mesa']
    assert division['modes']['mesa']['saved_bytes'] < modes['mesa']['saved_bytes']
    assert png.stat().st_size > 10_000
    # sharper maps: attention keeps q, k and v refined to about 16 bits
    result = run_tool('benchmark_memory', DEMO, '--modes', 'mesa', '--batch', '2', '--size', '32',
                      '32', '--sharpen', '8', '--json', tmp_path / 'sharp.json')
    assert result.returncode == 0, result.stderr[-4000:]
    sharp = json.loads((tmp_path / 'sharp.json').read_text())
    assert sharp['sharpen'] == 8.0
    assert modes['mesa']['saved_bytes'] < sharp['modes']['mesa']['saved_bytes'] \
        < 0.45 * modes['baseline']['saved_bytes']
    # a checkpoint's weights on a batch of the training set
    from mmseg_mesa.bench.models import build_model, load_config
    from mmseg_mesa.demo import write_demo_dataset
    write_demo_dataset(str(tmp_path / 'data'), num_train=2, num_val=1)
    torch.save({'state_dict': build_model(load_config(DEMO), 'cpu').state_dict()},
               tmp_path / 'iter_1.pth')
    result = run_tool('benchmark_memory', DEMO, '--modes', 'mesa', '--batch', '2',
                      '--checkpoint', tmp_path / 'iter_1.pth', '--data-root', tmp_path / 'data',
                      '--json', tmp_path / 'trained.json')
    assert result.returncode == 0, result.stderr[-4000:]
    trained = json.loads((tmp_path / 'trained.json').read_text())
    assert trained['size'] == [64, 64] and trained['checkpoint'].endswith('iter_1.pth')
    assert 0 < trained['modes']['mesa']['saved_bytes']


@pytest.mark.parametrize('bad', ['mesa:tiny', 'amp:paper', 'mesa+amp+amp', 'mesa+fp8',
                                 'baseline+amp', 'mesa:'])
def test_benchmark_memory_rejects_bad_modes(bad):
    from mmseg_mesa.bench.memory import parse_mode
    with pytest.raises(argparse.ArgumentTypeError, match='invalid mode'):
        parse_mode(bad)


def test_benchmark_memory_names_the_renamed_preset():
    from mmseg_mesa.bench.memory import parse_mode
    with pytest.raises(argparse.ArgumentTypeError, match="preset 'mesa' was renamed to 'paper'"):
        parse_mode('mesa:mesa')
    with pytest.raises(argparse.ArgumentTypeError, match="preset 'max-saving' was removed"):
        parse_mode('mesa:max-saving')


@pytest.mark.slow
@pytest.mark.parametrize('argv, message', [
    (['--modes', 'mesa:mesa'], "preset 'mesa' was renamed to 'paper'"),
    (['--budget', '4GB'], 'is not a size'),
    (['--check'], 'give --budget SIZE'),
    (['--search'], 'give --budget SIZE'),
    (['--check-batch', '8'], 'give --budget SIZE'),
    (['--budget', '4', '--search', '--device', 'cpu'], 'needs --device cuda'),
    (['--max-batch', '4'], 'unrecognized arguments: --max-batch'),
    (['--budget', '4', '--data-root', 'data'], 'give one of them'),
])
def test_benchmark_memory_command_line_refuses(argv, message):
    result = run_tool('benchmark_memory', *argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def test_sizes_read_and_print_in_binary_units():
    assert parse_bytes('4') == parse_bytes('4GiB') == parse_bytes('4 gib') == 4 * 2 ** 30
    assert parse_bytes('512MiB') == 2 ** 29
    assert parse_bytes('1.5', default_unit='MiB') == 3 * 2 ** 19
    for bad in ('4GB', '4 MB', 'GiB', '-1', 'four'):
        with pytest.raises(ValueError, match='not a size'):
            parse_bytes(bad)
    with pytest.raises(ValueError, match='must be positive'):
        parse_bytes('0')
    assert format_bytes(2 ** 30) == '1 GiB' and format_bytes(3 * 2 ** 19) == '1.5 MiB'
    assert format_bytes(100) == '100 B'


def test_batch_plan_takes_the_largest_phase_at_each_batch():
    # forward grows fastest; the optimizer step holds the peak of small batches
    low, high = dict(forward=300, backward=350, optimizer=500), dict(forward=500, backward=450,
                                                                     optimizer=500)
    plan = BatchPlan.fit(2, low, 4, high)
    assert plan.fits['forward'] == (100.0, 100.0) and plan.fits['optimizer'] == (500.0, 0.0)
    assert plan.per_image_bytes == 100.0 and plan.fixed_bytes == 500.0
    assert plan.predict(2) == 500.0 and plan.predict(10) == 1100.0
    assert plan.largest_batch(1100) == 10 and plan.largest_batch(1099) == 9
    assert plan.largest_batch(499) == 0  # the fixed part alone does not fit
    summary = plan.summary(1100)
    assert summary['max_batch'] == 10 and summary['predicted_bytes'] == 1100.0
    assert plan.summary(499)['predicted_bytes'] is None
    with pytest.raises(ValueError, match='did not grow'):
        BatchPlan.fit(2, low, 4, low)


def test_batch_plan_follows_a_site_that_overtakes_the_phase_peak():
    """A module call whose peak grows faster than the phase's at the measured batches sets the
    prediction once its line is above; sites that do not grow or were seen once are left out."""
    low, high = dict(forward=300, backward=350, optimizer=500), dict(forward=500, backward=450,
                                                                     optimizer=500)
    plan = BatchPlan.fit(2, low, 4, high,
                         {'forward:m.bn#0': 250, 'forward:m.relu#0': 290, 'backward:m#0': 10},
                         {'forward:m.bn#0': 480, 'forward:m.relu#0': 280})
    assert plan.site_fits == {'forward:m.bn#0': (20.0, 115.0)}
    assert plan.per_image_bytes == 100.0 and plan.fixed_bytes == 500.0  # the phases' lines
    assert plan.steepest_per_image_bytes == 115.0
    assert plan.predict(4) == 500.0 and plan.place(4) == 'forward'
    assert plan.predict(10) == 1170.0 and plan.place(10) == 'forward:m.bn#0'
    assert plan.largest_batch(1100) == 9  # the phases alone would allow 10
    assert plan.place(2) == 'optimizer'


class _Transient(nn.Module):
    """Holds ``extra(x)`` bytes beside its input for a moment, as an op's scratch does."""

    def __init__(self, extra):
        super().__init__()
        self.extra, self.scale = extra, nn.Parameter(torch.ones(()))

    def forward(self, x):
        scratch = torch.empty(self.extra(x) // 4)
        del scratch
        return x * self.scale


def test_site_peaks_predict_a_peak_that_moves_with_the_batch():
    """A fixed scratch holds the peak at batches 2 and 4, one that grows with the batch at 8:
    the phases' lines miss batch 8's peak, the site lines predict it."""
    from mmseg_mesa.memory import track_step_peak
    image = 256 * 1024
    model = nn.Sequential(_Transient(lambda x: 20 * image),
                          _Transient(lambda x: 3 * x.numel() * 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def peak(batch):
        x = torch.ones(batch, image // 4)
        return track_step_peak(model, optimizer, lambda: model(x).sum(), x)

    low, high, check = peak(2), peak(4), peak(8)
    assert check.module == '1' and low.module == '0'  # where each step's peak was
    assert {k for k in low.site_peaks if k.startswith('forward:')} == {
        'forward:Sequential#0', 'forward:Sequential.0#0', 'forward:Sequential.1#0'}
    assert max(low.site_peaks.values()) <= low.peak_bytes
    phases = BatchPlan.fit(2, low.phase_peaks, 4, high.phase_peaks)
    sites = BatchPlan.fit(2, low.phase_peaks, 4, high.phase_peaks, low.site_peaks,
                          high.site_peaks)
    assert phases.predict(8) < 0.9 * check.peak_bytes
    assert abs(sites.predict(8) / check.peak_bytes - 1) < 0.01
    assert sites.place(8) == 'forward:Sequential.1#0'


def test_conv_backward_never_holds_the_decoded_input_and_its_gradient_at_once():
    from torch.distributed._tools.mem_tracker import MemTracker
    torch.manual_seed(0)
    layer = MesaConv2d(64, 8, 3, padding=1, mesa_config=MesaConfig(group_size=1))
    x = torch.randn(4, 64, 48, 48, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    tracker = MemTracker()
    tracker.track_external(layer, x, y, g)
    with tracker:
        before = tracker.get_tracker_snapshot()[x.device]['Total']
        y.backward(g)
    extra = tracker.get_tracker_snapshot('peak')[x.device]['Total'] - before
    size = x.numel() * 4
    # the fp32 decoded input is freed before grad_x (as large) exists: about one copy, not two
    assert size <= extra < 1.5 * size, extra / size


def test_step_peak_by_category_and_place():
    from mmseg_mesa.memory import track_step_peak
    model = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 64)

    def loss():
        return model(x).square().mean()

    loss().backward()  # the warm-up step creates AdamW's state
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peak = track_step_peak(model, optimizer, loss, x)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peak.by_category['Parameter'] == params
    assert peak.by_category['Optstate'] >= 2 * params  # exp_avg and exp_avg_sq
    assert sum(peak.by_category.values()) == peak.peak_bytes
    assert peak.peak_bytes == max(peak.phase_peaks.values())
    # the activations of 256 x 1024 (GELU's input and output) are alive at the end of forward
    assert peak.phase_peaks['forward'] >= 2 * 256 * 1024 * 4 + 3 * params
    assert peak.phase in ('backward', 'optimizer') and peak.module in ('', '0', '1', '2')


@pytest.mark.slow
def test_budget_planner_predicts_the_measured_peak(tmp_path):
    from mmseg_mesa.bench.memory import format_plans, plan_batches, plot_fits
    from mmseg_mesa.bench.models import build_model, load_config
    cfg = load_config(DEMO)
    budget = parse_bytes('51.2MiB')
    mesa_config = MesaConfig.from_cfg(cfg.get('mesa', True)) or MesaConfig()
    plans = plan_batches(build_model(cfg, 'cpu'), cfg, ['mesa'], mesa_config, 2, (32, 32), 'cpu',
                         [budget, 2 * budget], check=True, search=False, check_batch=3)
    plan = plans['mesa']
    assert [f['budget_bytes'] for f in plan['fits']] == [budget, 2 * budget]
    assert plan['fits'][0]['max_batch'] == plan['max_batch'] < plan['fits'][1]['max_batch']
    assert [c['batch'] for c in plan['checks']] == [plan['max_batch'], 3]
    assert all(abs(c['error']) < 0.10 for c in plan['checks']), plan['checks']
    table = format_plans(plans, (32, 32))
    assert '51.2 MiB' in table and '102.4 MiB' in table and 'checked' in table
    png = tmp_path / 'fits.png'
    curve = dict(plan['predicted_curve'])
    assert curve[plan['max_batch']] == plan['predicted_bytes'] and 0 in curve
    plot_fits([('demo', dict(plans=plans))], str(png))
    assert png.stat().st_size > 10_000
    assert plan['batches'] == [2, 4]
    assert plan['max_batch'] > 4  # a real extrapolation, beyond the two measured batches
    assert abs(plan['error']) < 0.10, plan
    assert plan['predicted_bytes'] <= 51.2 * 2 ** 20 and plan['budget_bytes'] == int(51.2 * 2 ** 20)
