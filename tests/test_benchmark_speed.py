"""``tools/benchmark_speed.py``: interleaved step times and the ratio to the baseline (needs the
tools directory, so it is not among the core tests run from an install)."""
import json
import os.path as osp
import statistics
import sys

import pytest

sys.path.insert(0, osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'tools'))
import benchmark_speed  # noqa: E402


def test_ratio_is_the_median_of_each_rounds_ratio(tmp_path, capsys):
    """Each round times every mode once; the ratio is the median over rounds of a mode's time
    over the baseline's in the same round, so a machine that slows down for a few rounds
    moves it less than it moves the two medians."""
    out = tmp_path / 'speed.json'
    results = benchmark_speed.main(['--batch', '2', '--size', '32', '32', '--iters', '3',
                                    '--warmup', '1', '--json', str(out)])
    assert json.loads(out.read_text()) == results
    modes = results['modes']
    assert list(modes) == ['baseline', 'mesa']
    base, mesa = modes['baseline'], modes['mesa']
    assert len(base['times_s']) == len(mesa['times_s']) == 3
    assert base['ratio'] == 1.0 and base['ratio_of_medians'] == 1.0
    paired = statistics.median(m / b for m, b in zip(mesa['times_s'], base['times_s']))
    assert mesa['ratio'] == pytest.approx(paired)
    assert mesa['ratio_of_medians'] == pytest.approx(
        statistics.median(mesa['times_s']) / statistics.median(base['times_s']))
    assert f'{mesa["ratio"]:.2f}x' in capsys.readouterr().out
