"""``tools/benchmark_backbones.py`` (``mmseg_mesa.bench.sweep``, ``mmseg_mesa.bench.backbones``):
one backbone's row end to end, the table's shape, and the heads fitted to a backbone's maps."""
import json

import pytest
from tool_runs import run_tool

from mmseg_mesa.bench import sweep


def test_every_row_has_the_headers_cells():
    ok = dict(outcome='ok', forward_identical=True, saved_ratio=0.2, left_share=0.01,
              left_top=[dict(name='a', type='Conv2d', share=0.01)], relative_error=0.01,
              minibatch_noise=0.5, worst_cosine=0.999, kernel_ratio=1.6,
              added_syncs={'nonzero': 2})
    cells = sweep.header(['backbone', 'arch'], ['extra']).splitlines()[0].count('|')
    assert sweep.format_row(['x', 'y'], ok, ['e']).count('|') == cells
    assert sweep.format_row(['x', 'y'], dict(outcome='build: KeyError'), ['e']).count('|') == cells


def test_heads_read_the_maps_the_backbone_returns():
    """A ViT's four same-resolution maps go through MultiLevelNeck; a CNN's last four maps of
    five feed UPerHead directly, its auxiliary head the stride-16 one."""
    pytest.importorskip('mmpretrain')
    from mmseg_mesa.bench.backbones import upernet_config
    vit = upernet_config(dict(type='mmpretrain.VisionTransformer', arch='deit-tiny',
                              img_size=224, out_indices=(2, 5, 8, 11), out_type='featmap'), 64)
    assert vit.model.backbone.img_size == 64
    assert vit.model.neck.type == 'MultiLevelNeck' and vit.model.neck.in_channels == [192] * 4
    assert vit.model.decode_head.in_channels == [192] * 4
    assert vit.model.decode_head.in_index == [0, 1, 2, 3]
    cnn = upernet_config(dict(type='mmpretrain.ResNet', depth=18, out_indices=(0, 1, 2, 3)), 64)
    assert 'neck' not in cnn.model
    assert cnn.model.decode_head.in_channels == [64, 128, 256, 512]
    assert (cnn.model.auxiliary_head.in_channels, cnn.model.auxiliary_head.in_index) == (256, 2)


@pytest.mark.slow
def test_one_backbone_end_to_end(tmp_path):
    """The sweep's path for one backbone (its own ``--one`` process) and one skipped backbone:
    the measured row is sane and the table holds both."""
    out, table = tmp_path / 'backbones.json', tmp_path / 'backbones.md'
    result = run_tool('benchmark_backbones', '--backbones', 'ConvNeXt', 'LeNet5', '--size', '64',
                      '--json', out, '--markdown', table, OMP_NUM_THREADS='1')
    assert result.returncode == 0, result.stderr[-4000:]
    assert 'neither measured nor skipped' not in result.stdout  # mmpretrain's list is covered
    rows = {row['backbone']: row for row in json.loads(out.read_text())['rows']}
    assert rows['LeNet5']['outcome'].startswith('skipped: ')
    row = rows['ConvNeXt']
    assert row['outcome'] == 'ok', row
    assert row['forward_identical']
    assert 0 < row['saved_ratio'] < 1
    assert 0 <= row['left_share'] < row['saved_ratio']
    assert row['relative_error'] < row['minibatch_noise']
    assert 0.9 < row['worst_cosine'] <= 1 + 1e-6
    assert isinstance(row['left_to_torch'], list)
    assert row['kernel_ratio'] > 1 and row['added_syncs'] == {} and row['mesa_sync_sites'] == []
    lines = table.read_text().splitlines()
    assert len(lines) == 4 and lines[2].startswith('| ConvNeXt (64) |')
