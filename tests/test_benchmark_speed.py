"""``tools/benchmark_speed.py``: interleaved step times and the ratio to the baseline (it runs the
tool, so it is not among the core tests run from an install)."""
import json
import statistics

import pytest
from tool_runs import run_tool

from mmseg_mesa.bench.speed import step_times


@pytest.mark.slow
def test_ratio_is_the_median_of_each_rounds_ratio(tmp_path):
    """Each round times every mode once; the ratio is the median over rounds of a mode's time
    over the baseline's in the same round, so a machine that slows down for a few rounds
    moves it less than it moves the two medians."""
    out = tmp_path / 'speed.json'
    result = run_tool('benchmark_speed', '--batch', '2', '--size', '32', '32', '--iters', '3',
                      '--warmup', '1', '--count', '--json', out)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())
    modes = results['modes']
    assert list(modes) == ['baseline', 'mesa']
    base, mesa = modes['baseline'], modes['mesa']
    assert len(base['times_s']) == len(mesa['times_s']) == 3
    assert base['ratio'] == 1.0 and base['ratio_of_medians'] == 1.0
    paired = statistics.median(m / b for m, b in zip(mesa['times_s'], base['times_s']))
    assert mesa['ratio'] == pytest.approx(paired)
    assert mesa['ratio_of_medians'] == pytest.approx(
        statistics.median(mesa['times_s']) / statistics.median(base['times_s']))
    assert f'{mesa["ratio"]:.2f}x' in result.stdout
    counts = results['counts']  # --count: what a GPU would launch and wait for
    assert counts['mesa']['kernel_ops'] > counts['baseline']['kernel_ops'] > 0
    assert counts['mesa']['kernel_ratio'] == pytest.approx(
        counts['mesa']['kernel_ops'] / counts['baseline']['kernel_ops'])
    assert counts['mesa']['added_syncs'] == {} and not counts['mesa']['mesa_sync_sites']
    assert 'syncs, 0 added' in result.stdout


def test_a_slow_spell_moves_the_paired_ratio_less_than_the_medians():
    # rounds 3 and 4 ran on a machine twice as slow; each round, mesa took 1.1x the baseline
    times = {'baseline': [1.0, 1.0, 2.0, 2.0, 1.0], 'mesa': [1.1, 1.1, 2.2, 2.2, 1.1]}
    times['late'] = [1.1, 2.2, 2.2, 2.2, 1.1]  # its slow spell came a round early
    modes = step_times(times)
    assert modes['mesa']['ratio'] == pytest.approx(1.1)
    assert modes['baseline']['ratio'] == 1.0 and modes['baseline']['step_time_s'] == 1.0
    assert modes['late']['ratio'] == pytest.approx(1.1)
    assert modes['late']['ratio_of_medians'] == pytest.approx(2.2)
    assert step_times({'mesa': [1.0, 2.0]})['mesa']['ratio'] is None  # no baseline to pair
