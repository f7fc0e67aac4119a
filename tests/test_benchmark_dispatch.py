"""``tools/benchmark_dispatch.py``: kernel ops and host syncs per step across the sweeps' models
(it runs the tool, so it is not among the core tests run from an install)."""
import json

import pytest
from tool_runs import run_tool


@pytest.mark.slow
def test_a_family_and_a_backbone_and_an_unknown_name(tmp_path):
    out, table = tmp_path / 'dispatch.json', tmp_path / 'dispatch.md'
    result = run_tool('benchmark_dispatch', '--only', 'fcn', 'ResNet', '--size', '64', '--json',
                      out, '--markdown', table, OMP_NUM_THREADS='1')
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {row['model']: row for row in json.loads(out.read_text())['rows']}
    for row in rows.values():
        assert 'error' not in row, row
        base, mesa = row['baseline_kernel_ops'], row['kernel_ops']
        assert mesa > base > 0 and row['kernel_ratio'] == pytest.approx(mesa / base)
        assert row['added_syncs'] == {} and row['mesa_sync_sites'] == []
    lines = table.read_text().splitlines()
    assert len(lines) == 4 and lines[2].startswith('| fcn (64) |')
    refused = run_tool('benchmark_dispatch', '--only', 'no-such-model')
    assert refused.returncode == 2 and 'unknown models' in refused.stderr
