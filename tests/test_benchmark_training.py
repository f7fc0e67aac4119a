"""The multi-seed training benchmark: its statistics, and a quick run of the tool end to end."""
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest

from mmseg_mesa.demo.runs import progress_line
from mmseg_mesa.demo.seeds import compare, mean_curve, summarize

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))


def test_paired_gap_and_its_interval():
    base = [80.0, 82.0, 84.0]
    mode = [79.5, 81.0, 83.9]  # differences -0.5, -1.0, -0.1
    result = compare(mode, base)
    diffs = np.array(mode) - np.array(base)
    assert result['gap'] == pytest.approx(diffs.mean())
    half = 4.302652729911275 * diffs.std(ddof=1) / np.sqrt(3)  # t(0.975, 2)
    assert result['ci95'] == pytest.approx([diffs.mean() - half, diffs.mean() + half])
    assert result['baseline_std'] == pytest.approx(2.0)
    assert 'within the baseline\'s seed spread (std 2.00)' in result['verdict']


@pytest.mark.parametrize('mode, words', [
    ([78.0, 78.6, 79.1], 'lower than the baseline beyond the seed noise'),
    ([80.0, 79.0, 85.0], 'but not significant'),
])
def test_verdict_says_what_the_numbers_support(mode, words):
    base = [80.0, 80.5, 81.0]
    assert words in compare(mode, base)['verdict']


def test_one_seed_has_no_interval():
    result = compare([80.0], [81.0])
    assert result['ci95'] is None and 'one seed' in result['verdict']


def test_summary_pairs_seeds_and_averages_curves():
    def run(mode, seed, miou, losses):
        return dict(mode=mode, seed=seed, miou=miou, final_loss=losses[-1],
                    loss_curve=dict(iter=[10, 20, 30][:len(losses)], loss=losses))

    runs = [run('baseline', 0, 80.0, [1.0, 0.5, 0.3]), run('default', 0, 79.0, [1.1, 0.6, 0.2]),
            run('baseline', 1, 82.0, [0.8, 0.4, 0.1]), run('default', 1, 82.0, [0.9, 0.5])]
    summary = summarize(runs)
    assert summary['modes']['baseline']['miou'] == [80.0, 82.0]
    assert summary['comparisons']['default']['miou']['gap'] == pytest.approx(-0.5)
    curve = summary['modes']['default']['loss_curve']
    assert curve['iter'] == [10, 20]  # the iterations both runs logged
    assert curve['mean'] == pytest.approx([1.0, 0.55])
    assert curve['std'] == pytest.approx([np.std([1.1, 0.9], ddof=1), np.std([0.6, 0.5], ddof=1)])
    with pytest.raises(ValueError, match='same'):
        summarize(runs + [run('paper', 0, 80.0, [1.0])])
    assert mean_curve([dict(iter=[1], loss=[2.0])])['std'] == [0.0]


def test_progress_line_reads_mmengine_log_lines():
    line = ('12/03 19:40:11 - mmengine - INFO - Iter(train) [ 200/1000]  base_lr: 1.9e-03 '
            'lr: 1.9e-03  eta: 0:02:10  time: 0.1616  data_time: 0.0101  memory: 0  '
            'loss: 0.35123  decode.loss_ce: 0.35123  decode.acc_seg: 88.6')
    assert progress_line(line) == 'iter  200/1000  eta 0:02:10  loss 0.3512'
    assert progress_line('12/03 - mmengine - INFO - Checkpoints will be saved to x') is None


@pytest.mark.slow
def test_quick_run_writes_json_plot_and_conclusion(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    result = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'benchmark_training.py'), '--quick',
         '--seeds', '2', '--work-dir', str(tmp_path / 'work'),
         '--data-root', str(tmp_path / 'data')],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert '[default s1] iter' in out and 'eta' in out  # one progress line per log line
    with open(tmp_path / 'work' / 'training.json') as f:
        record = json.load(f)
    assert sorted((r['mode'], r['seed']) for r in record['runs']) == [
        ('baseline', 0), ('baseline', 1), ('default', 0), ('default', 1)]
    base = record['modes']['baseline']
    assert base['miou_mean'] == pytest.approx(np.mean(base['miou']))
    gap = record['comparisons']['default']['miou']
    assert len(gap['ci95']) == 2 and gap['ci95'][0] <= gap['gap'] <= gap['ci95'][1]
    assert record['conclusion'][0].startswith('default: mIoU ')
    assert record['conclusion'][0] in out
    assert record['commit'] and record['cpu'] and record['date']
    assert (tmp_path / 'work' / 'training.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.slow
def test_bad_modes_fail_with_a_clear_message(tmp_path):
    result = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'benchmark_training.py'), '--modes',
         'default', '--work-dir', str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and '--modes needs baseline' in result.stderr
