"""The demo: its generated dataset (as mmseg reads it) and a quick end-to-end ``tools/demo.py``."""
import json
import os
import os.path as osp
import subprocess
import sys

import cv2
import numpy as np
import pytest

from mmseg_mesa.demo import CLASSES, MesaDemoDataset, write_demo_dataset

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
PREFIX = {
    'training': dict(img_path='images/training', seg_map_path='annotations/training'),
    'validation': dict(img_path='images/validation', seg_map_path='annotations/validation'),
}
K = len(CLASSES)


def stem(path: str) -> str:
    return osp.splitext(osp.basename(path))[0]


def files(root: str, split: str) -> dict[str, list[str]]:
    return {kind: sorted(os.listdir(osp.join(root, kind, split)))
            for kind in ('images', 'annotations')}


@pytest.fixture(scope='module')
def demo_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp('mesa_demo'))
    info = write_demo_dataset(root, num_train=8, num_val=3, size=48, seed=0)
    assert info['written'] and info['classes'] == CLASSES
    return root


def test_layout_is_ade20k(demo_root):
    for split, count in (('training', 8), ('validation', 3)):
        listed = files(demo_root, split)
        assert len(listed['images']) == count
        assert all(name.endswith('.jpg') for name in listed['images'])
        assert all(name.endswith('.png') for name in listed['annotations'])
        assert [stem(n) for n in listed['images']] == [stem(n) for n in listed['annotations']]


def test_ade20k_dataset_finds_exactly_the_written_pairs(demo_root):
    from mmseg.datasets import ADE20KDataset

    for split, count in (('training', 8), ('validation', 3)):
        dataset = ADE20KDataset(data_root=demo_root, data_prefix=PREFIX[split], pipeline=[],
                                lazy_init=False)
        assert len(dataset) == count
        infos = [dataset.get_data_info(i) for i in range(count)]
        written = [stem(n) for n in files(demo_root, split)['images']]
        assert sorted(stem(i['img_path']) for i in infos) == written
        assert all(stem(i['img_path']) == stem(i['seg_map_path']) for i in infos)
        assert all(osp.isfile(i['img_path']) and osp.isfile(i['seg_map_path']) for i in infos)


def test_labels_follow_the_ade_convention(demo_root):
    present = set()
    for name in files(demo_root, 'training')['annotations']:
        label = cv2.imread(osp.join(demo_root, 'annotations', 'training', name),
                           cv2.IMREAD_UNCHANGED)
        assert label.dtype == np.uint8 and label.shape == (48, 48)
        values = set(np.unique(label).tolist())
        assert values <= set(range(K + 1))
        assert 1 in values  # the ground is in every scene
        present |= values
    # 0 ("other": small clutter blobs) occurs, and shapes of most classes do.
    assert 0 in present
    assert len(present - {0, 1}) >= K - 2


def test_mesa_demo_dataset_loads_it(demo_root):
    from mmengine.registry import DefaultScope
    from mmseg.registry import DATASETS

    # mmseg's LoadAnnotations (not mmcv's), which takes reduce_zero_label from the dataset.
    with DefaultScope.overwrite_default_scope('mmseg'):
        dataset = DATASETS.build(dict(
            type='MesaDemoDataset', data_root=demo_root, data_prefix=PREFIX['training'],
            pipeline=[dict(type='LoadAnnotations')]))
    assert isinstance(dataset, MesaDemoDataset)
    assert len(dataset) == 8
    assert dataset.metainfo['classes'] == CLASSES and len(dataset.metainfo['palette']) == K
    assert dataset.metainfo['reduce_zero_label'] is True
    values = set()
    for i in range(len(dataset)):
        values |= set(np.unique(dataset[i]['gt_seg_map']).tolist())
    assert values <= set(range(K)) | {255} and 255 in values and 0 in values


def test_deterministic_and_idempotent(tmp_path, demo_root):
    again = str(tmp_path / 'again')
    assert write_demo_dataset(again, num_train=8, num_val=3, size=48, seed=0)['written']
    for split in ('training', 'validation'):
        for kind, names in files(demo_root, split).items():
            assert names == files(again, split)[kind]
            for name in names:
                with open(osp.join(demo_root, kind, split, name), 'rb') as a, \
                        open(osp.join(again, kind, split, name), 'rb') as b:
                    assert a.read() == b.read(), name
    # Same parameters: nothing is written.
    assert not write_demo_dataset(again, num_train=8, num_val=3, size=48, seed=0)['written']
    # Other parameters: rewritten, without leftovers of the previous set.
    assert write_demo_dataset(again, num_train=4, num_val=2, size=48, seed=1)['written']
    assert len(files(again, 'training')['images']) == 4
    assert len(files(again, 'validation')['annotations']) == 2
    first = osp.join(again, 'images', 'training', files(again, 'training')['images'][0])
    with open(first, 'rb') as a, open(first.replace(again, demo_root), 'rb') as b:
        assert a.read() != b.read()  # another seed, another scene


def test_demo_quick_end_to_end(tmp_path):
    work_dir, data_root = tmp_path / 'work', tmp_path / 'data'
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, env.get('PYTHONPATH')) if p)
    result = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'demo.py'), '--quick',
         '--work-dir', str(work_dir), '--data-root', str(data_root)],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert '[mesa]' in result.stdout and '[baseline]' in result.stdout  # logs were streamed

    with open(work_dir / 'summary.json') as f:
        summary = json.load(f)
    assert {'baseline', 'mesa'} <= set(summary)
    for entry in summary.values():
        assert isinstance(entry['miou'], float) and 0.0 <= entry['miou'] <= 100.0
        assert isinstance(entry['saved_bytes'], int) and entry['saved_bytes'] > 0
        assert isinstance(entry['train_time_s'], float) and entry['train_time_s'] > 0
        assert entry['peak_rss_bytes'] > 0 and np.isfinite(entry['final_loss'])
    assert summary['mesa']['saved_bytes'] < summary['baseline']['saved_bytes']
    with open(work_dir / 'summary.png', 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
