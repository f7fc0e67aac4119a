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
from mmseg_mesa.demo.report import format_table, plot, summary_figure

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


@pytest.mark.slow
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
    # the planner: fitted from the full and half batch (4 and 2 in --quick), within 1 GiB
    plans = {name: entry['budget_plan'] for name, entry in summary.items()}
    for plan in plans.values():
        assert plan['batches'] == [2, 4] and plan['budget_bytes'] == 2 ** 30
        assert 0 < plan['fixed_bytes'] and 0 < plan['per_image_bytes']
        assert plan['max_batch'] > 4 and plan['predicted_bytes'] <= 2 ** 30
    assert plans['mesa']['per_image_bytes'] < plans['baseline']['per_image_bytes']
    assert plans['mesa']['max_batch'] > plans['baseline']['max_batch']
    assert summary['mesa']['max_batch_ratio'] == pytest.approx(
        plans['mesa']['max_batch'] / plans['baseline']['max_batch'], rel=1e-3)
    assert 'largest batch in 1 GiB (planned)' in result.stdout
    # both models' steps timed in turn: the ratio is the median of each round's
    assert summary['baseline']['step_time_ratio'] == 1.0
    assert summary['mesa']['step_time_s'] > 0 and summary['mesa']['step_time_ratio'] > 0
    assert 'training step, timed in turn (ms)' in result.stdout
    with open(work_dir / 'summary.png', 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def synthetic_summary():
    mib = 2 ** 20
    plans = {name: dict(batches=[4, 8], budget_bytes=2 ** 30, fixed_bytes=47.0 * mib,
                        per_image_bytes=per_image * mib, max_batch=batch,
                        predicted_bytes=(47.0 + per_image * batch) * mib)
             for name, per_image, batch in (('baseline', 3.7, 264), ('mesa', 1.3, 751))}
    summary = {name: dict(miou=miou, aacc=95.0, final_loss=0.1, saved_bytes=int(saved * mib),
                          step_peak_bytes=int(peak * mib), train_time_s=300.0, cpu_time_s=250.0,
                          budget_plan=plans[name], step_time_s=step / 1e3,
                          step_time_ratio=step / 400.0)
               for name, miou, saved, peak, step in (('baseline', 85.6, 28.3, 63.1, 400.0),
                                                     ('mesa', 87.2, 5.2, 52.2, 500.0))}
    curves = {name: dict(iter=[10, 20, 30], loss=[1.0, 0.5, 0.3]) for name in summary}
    return summary, curves


def test_table_says_what_the_saving_buys():
    summary, _ = synthetic_summary()
    table = format_table(summary)
    batch_row = next(line for line in table.splitlines() if 'largest batch' in line)
    assert 'largest batch in 1 GiB (planned)' in batch_row
    assert batch_row.split()[-3:] == ['264', '751', f'{751 / 264:.3f}']
    per_image = next(line for line in table.splitlines() if 'per image' in line)
    assert per_image.split()[-3:] == ['3.70', '1.30', f'{1.3 / 3.7:.3f}']
    step = next(line for line in table.splitlines() if 'timed in turn' in line)
    assert step.split()[-3:] == ['400.0', '500.0', '1.250']


def test_summary_plot_titles_are_whole_and_apart(tmp_path):
    import matplotlib.pyplot as plt
    summary, curves = synthetic_summary()
    fig = summary_figure(summary, curves)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    texts = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 4 and 'Largest batch in 1 GiB' in texts[3], texts
    for box, text in zip(titles, texts):  # inside the figure: nothing is cut off
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, text
    for left, right in zip(titles, titles[1:]):
        assert left.x1 < right.x0, 'titles overlap'
    plt.close(fig)
    plot(summary, curves, str(tmp_path / 'summary.png'))
    assert (tmp_path / 'summary.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
