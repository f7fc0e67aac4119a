"""End to end through our tools/train.py: train with Mesa, checkpoint, resume, then evaluate the
checkpoint with plain mmseg (no Mesa) and load it on torch >= 2.6."""
import math
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # each test runs tools/ or reads what such a run wrote

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
MESA_CONFIG = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')
PLAIN_CONFIG = osp.join(ROOT, 'configs/demo/swin-mini_upernet_demo.py')


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    from mmseg_mesa.demo.dataset import write_demo_dataset
    root = str(tmp_path_factory.mktemp('demo_data'))
    write_demo_dataset(root, num_train=8, num_val=4, seed=0)
    return root


def data_options(root):
    return [f'{split}_dataloader.dataset.data_root={root}' for split in ('train', 'val', 'test')]


def train(config, work_dir, root, iters, *extra, options=(), check=True, timeout=300):
    cmd = [sys.executable, osp.join(ROOT, 'tools/train.py'), config, '--work-dir', work_dir,
           *extra, '--cfg-options', *data_options(root), f'train_cfg.max_iters={iters}',
           f'train_cfg.val_interval={iters}', 'default_hooks.checkpoint.interval=2',
           'train_dataloader.batch_size=2', 'default_hooks.logger.interval=1', *options]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED='1'))
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_root):
    work_dir = str(tmp_path_factory.mktemp('mesa_run'))
    first = train(MESA_CONFIG, work_dir, data_root, 2)
    resumed = train(MESA_CONFIG, work_dir, data_root, 4, '--resume')
    return work_dir, first.stdout + first.stderr, resumed.stdout + resumed.stderr


def test_training_converts_and_logs_report(trained):
    _, log, _ = trained
    assert 'Mesa converted' in log and 'WindowMSA' in log and 'left unconverted' in log.lower()


def test_resume_continues_from_checkpoint(trained):
    work_dir, _, log = trained
    assert 'resumed' in log.lower() or 'Resume' in log
    assert 'Iter(train) [3/4]' in log or 'Iter(train) [4/4]' in log
    assert 'Iter(train) [1/4]' not in log  # it did not start over
    assert osp.exists(osp.join(work_dir, 'iter_4.pth'))


def test_checkpoint_loads_in_plain_mmseg(trained, data_root):
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmseg_mesa.integrations import allow_mmengine_checkpoints
    work_dir, _, _ = trained
    checkpoint = osp.join(work_dir, 'iter_4.pth')
    allow_mmengine_checkpoints()
    cfg = Config.fromfile(PLAIN_CONFIG)
    assert 'mesa' not in cfg
    cfg.merge_from_dict({f'{s}_dataloader.dataset.data_root': data_root
                         for s in ('train', 'val', 'test')})
    cfg.work_dir = osp.join(work_dir, 'plain_test')
    cfg.load_from = checkpoint
    runner = Runner.from_cfg(cfg)
    state = torch.load(checkpoint, map_location='cpu')['state_dict']
    incompatible = runner.model.load_state_dict(state, strict=True)
    assert not incompatible.missing_keys and not incompatible.unexpected_keys
    metrics = runner.test()
    assert 0.0 <= metrics['mIoU'] <= 100.0
    assert not any('Mesa' in type(m).__name__ for m in runner.model.modules())


def test_mmengine_checkpoint_needs_and_gets_our_allowlist(trained):
    """On torch >= 2.6 plain torch.load refuses mmengine's checkpoint; ours loads it safely."""
    work_dir, _, _ = trained
    checkpoint = osp.join(work_dir, 'iter_4.pth')
    load = f'import torch; torch.load({checkpoint!r}, map_location="cpu")'
    plain = subprocess.run([sys.executable, '-c', load], capture_output=True, text=True)
    assert plain.returncode != 0 and 'weights_only' in plain.stderr
    ours = subprocess.run([sys.executable, '-c', 'import mmseg_mesa.integrations; ' + load],
                          capture_output=True, text=True)
    assert ours.returncode == 0, ours.stderr[-2000:]
    # still weights_only: a pickle that runs code is refused.
    evil = subprocess.run([sys.executable, '-c', (
        'import os, pickle, io, torch, mmseg_mesa.integrations\n'
        'class E:\n    def __reduce__(self): return (os.system, ("true",))\n'
        'buf = io.BytesIO(); torch.save({"x": E()}, buf); buf.seek(0)\n'
        'torch.load(buf)\n')], capture_output=True, text=True)
    assert evil.returncode != 0 and 'weights_only' in evil.stderr
    # HistoryBuffer's pickled statistics need getattr; any other getattr is refused.
    sneaky = subprocess.run([sys.executable, '-c', (
        'import io, torch, mmseg_mesa.integrations\n'
        'from mmengine.logging.history_buffer import HistoryBuffer\n'
        'class G:\n    def __reduce__(self): return (getattr, (HistoryBuffer, "__init__"))\n'
        'buf = io.BytesIO(); torch.save({"x": G()}, buf); buf.seek(0)\n'
        'torch.load(buf)\n')], capture_output=True, text=True)
    assert sneaky.returncode != 0 and 'refusing getattr' in sneaky.stderr


@pytest.mark.parametrize('option, message', [
    ('mesa.bits=3', 'invalid bits=3'),
    ('mesa.bitz=8', "unknown key(s) ['bitz']"),
    ('mesa.layers=[matmul]', 'nothing to convert'),
])
def test_bad_mesa_config_fails_before_training(tmp_path, data_root, option, message):
    cmd_fail = [sys.executable, osp.join(ROOT, 'tools/train.py'), MESA_CONFIG, '--work-dir',
                str(tmp_path / 'bad'), '--cfg-options', *data_options(data_root), option]
    bad = subprocess.run(cmd_fail, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert message in bad.stderr + bad.stdout
    assert 'Iter(train)' not in bad.stdout + bad.stderr


def test_our_test_tool_evaluates_the_checkpoint_with_the_plain_config(trained, data_root):
    work_dir, _, _ = trained
    cmd = [sys.executable, osp.join(ROOT, 'tools/test.py'), PLAIN_CONFIG,
           osp.join(work_dir, 'iter_4.pth'), '--work-dir', osp.join(work_dir, 'tool_test'),
           '--cfg-options', *data_options(data_root)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'mIoU' in proc.stdout + proc.stderr


# The step's own random streams off (drop path, dropout, random flips): what is left to differ
# between an uninterrupted and a resumed run is what the checkpoint does not restore.
DETERMINISTIC = ['model.backbone.drop_path_rate=0.0', 'model.decode_head.dropout_ratio=0.0',
                 'train_dataloader.dataset.pipeline.2.prob=0.0']


def checkpoint_weights(path):
    return torch.load(path, map_location='cpu', weights_only=False)['state_dict']


# bounds no layer of the demo model meets at 8 bits: the calibration refines some, and a resumed
# run must keep that choice
STRICT = ['mesa.calibrate.error=0.0005', 'mesa.calibrate.passes=6']


@pytest.mark.parametrize('config', [MESA_CONFIG, PLAIN_CONFIG], ids=['mesa', 'baseline'])
def test_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, data_root, config):
    whole = str(tmp_path / 'whole')
    options = DETERMINISTIC + (STRICT if config == MESA_CONFIG else [])
    first = train(config, whole, data_root, 4, options=options)
    # the first half of the same run, as a run stopped after 2 iterations leaves it
    resumed = tmp_path / 'resumed'
    resumed.mkdir()
    first_half = resumed / 'iter_2.pth'
    first_half.write_bytes((tmp_path / 'whole' / 'iter_2.pth').read_bytes())
    (resumed / 'last_checkpoint').write_text(str(first_half))
    log = train(config, str(resumed), data_root, 4, '--resume', options=options)
    log = log.stdout + log.stderr
    assert 'Iter(train) [1/4]' not in log and 'Iter(train) [3/4]' in log
    expected = checkpoint_weights(osp.join(whole, 'iter_4.pth'))
    got = checkpoint_weights(resumed / 'iter_4.pth')
    assert list(got) == list(expected)
    differing = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differing, differing[:5]
    saved = torch.load(first_half, map_location='cpu', weights_only=True)
    if config == MESA_CONFIG:
        assert 'Mesa: restored the running estimates of' in log
        state = saved['mesa']
        assert state['rounding']['cpu'][2] > 0  # the stream had advanced
        assert sum(int(e['seen'].all() and e['seen'].numel() > 0)
                   for e in state['estimates'].values()) > 20
        # the first iteration calibrated; the resumed run kept the choice instead
        assert 'Mesa: calibration: ' in first.stdout + first.stderr
        assert 'Mesa: calibration: ' not in log
        assert sum('refined' in e for e in state['estimates'].values()) > 0
    else:
        assert 'mesa' not in saved


def test_checkpoint_keeps_plain_mmseg_keys_and_mesa_state_apart(trained):
    work_dir, _, _ = trained
    checkpoint = torch.load(osp.join(work_dir, 'iter_4.pth'), map_location='cpu',
                            weights_only=False)
    assert not any('quant' in key or 'mesa' in key for key in checkpoint['state_dict'])
    assert set(checkpoint['mesa']) == {'format', 'estimates', 'rounding'}


@pytest.mark.parametrize('config', [MESA_CONFIG, PLAIN_CONFIG], ids=['mesa', 'baseline'])
def test_compiled_training_runs_and_saves_a_plain_checkpoint(tmp_path, data_root, config):
    """``--compile``: the first iteration eager, the next 19 through torch.compile (baseline
    and Mesa alike), finite losses, and a checkpoint that loads in the plain model."""
    work_dir = str(tmp_path / 'compiled')
    proc = train(config, work_dir, data_root, 20, '--compile',
                 options=('default_hooks.checkpoint.interval=20',), timeout=900)
    log = proc.stdout + proc.stderr
    assert 'CompileHook: the training forward is compiled from the next iteration' in log
    losses = [float(v) for v in re.findall(r'Iter\(train\) \[\s*\d+/20\].*? loss: ([\d.]+)', log)]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    state = torch.load(osp.join(work_dir, 'iter_20.pth'), map_location='cpu',
                       weights_only=False)['state_dict']
    assert not any('quant' in key or 'mesa' in key for key in state)
