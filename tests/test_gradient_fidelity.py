"""tools/gradient_fidelity.py: Mesa's gradient error on one step, next to minibatch noise."""
import json
import os.path as osp

import pytest
import torch
from tool_runs import run_tool

from mmseg_mesa.bench.fidelity import error_coherence, mesa_config_for
from mmseg_mesa.bench.models import build_model, load_config

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')


def gradient_fidelity(tmp_path, *args):
    """The tool's results (its --json), after checking that it ran."""
    out = tmp_path / 'fidelity.json'
    result = run_tool('gradient_fidelity', *args, '--json', out)
    assert result.returncode == 0, result.stderr[-4000:]
    assert 'minibatch noise (exact gradients of two batches)' in result.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_error_is_small_next_to_minibatch_noise_and_averages_out(tmp_path):
    results = gradient_fidelity(tmp_path, DEMO, '--draws', '4', '--batch', '4', '--size', '64',
                                '64', '--presets', 'config', 'paper')
    noise = results['minibatch_noise']
    rows = results['presets']['config']['rows']
    first, last = rows[0]['relative_error'], rows[-1]['relative_error']
    assert first < 0.02 and first < 0.05 * noise  # ~0.4% next to minibatch noise ~0.5-1.0
    # unbiased stochastic rounding: the mean of 4 draws has about half the error (a bias would
    # not shrink); slack for the finite sample
    assert last < 0.65 * first
    # each draw alone is as far off as the first (the mean's error is what shrinks)
    assert rows[0]['draw_error'] == first
    assert all(0.5 * first < row['draw_error'] < 2 * first for row in rows)
    assert rows[-1]['worst_cosine'] > 0.9999
    ranked = rows[0]['cosines']
    assert rows[0]['worst_parameter'] in ranked and min(ranked.values()) == rows[0]['worst_cosine']
    assert results['presets']['paper']['rows'][0]['relative_error'] < 0.1 * noise


@pytest.mark.slow
def test_checkpoint_init_weights_and_cfg_options(tmp_path):
    """A checkpoint's weights are what is measured, and --cfg-options reaches the MesaConfig."""
    cfg = load_config(DEMO)
    state = build_model(cfg, 'cpu').state_dict()
    torch.save({'state_dict': state, 'meta': {}}, tmp_path / 'iter_1.pth')
    results = gradient_fidelity(tmp_path, DEMO, '--batch', '2', '--size', '32', '32',
                                '--checkpoint', tmp_path / 'iter_1.pth', '--cfg-options',
                                'mesa.layer_bits.layernorm=4')
    assert "layer_bits=(('layernorm', 4),)" in results['presets']['config']['config']
    plain = gradient_fidelity(tmp_path, DEMO, '--batch', '2', '--size', '32', '32',
                              '--no-init-weights')
    assert plain['init_weights'] is False and plain['minibatch_noise'] > 0
    with pytest.raises(ValueError, match="unknown preset 'tiny'"):  # what the tool reads first
        mesa_config_for('config', load_config(DEMO, {'mesa.preset': 'tiny'}))
    state.pop('decode_head.conv_seg.weight')  # the file is really loaded, strictly
    torch.save({'state_dict': state, 'meta': {}}, tmp_path / 'broken.pth')
    broken = run_tool('gradient_fidelity', DEMO, '--size', '32', '32', '--checkpoint',
                      tmp_path / 'broken.pth')
    assert broken.returncode != 0
    assert 'RuntimeError' in broken.stderr and 'conv_seg.weight' in broken.stderr


def test_error_coherence_tells_a_bias_from_independent_errors():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    same = error_coherence({'w': a + a + a}, 3 * 9.0)  # one error vector three times: sqrt(3)
    assert same == pytest.approx(3 ** 0.5)
    assert error_coherence({'w': a + b}, 9.0 + 16.0) == pytest.approx(1.0)  # orthogonal
    assert error_coherence({'w': a - a}, 18.0) == 0.0  # they cancel


@pytest.mark.slow
def test_independent_batches_report_errors_and_coherence(tmp_path):
    results = gradient_fidelity(tmp_path, DEMO, '--batch', '2', '--size', '32', '32',
                                '--batches', '3')
    found = results['presets']['config']['batches']
    assert len(found['relative_errors']) == 3 and all(0 < e < 0.05
                                                      for e in found['relative_errors'])
    assert 0.0 < found['coherence'] < 3 ** 0.5
    bad = run_tool('gradient_fidelity', DEMO, '--batches', '0')
    assert bad.returncode != 0 and '--batches must be at least 1' in bad.stderr


def test_sharpen_attention_scales_queries_and_keys_only():
    """``--sharpen F`` multiplies q and k (logits by F**2) and leaves v, in
    ``nn.MultiheadAttention`` and in attention with one qkv Linear (BEiT's q_bias too)."""
    from mmseg.models.backbones.beit import BEiTAttention

    from mmseg_mesa.bench.fidelity import sharpen_attention
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    torch.nn.init.normal_(mha.in_proj_bias)
    beit = BEiTAttention(8, 2, (2, 2), bias='qv_bias')
    torch.nn.init.normal_(beit.q_bias)
    x = torch.randn(2, 5, 8)

    def qkv():
        q = x @ mha.in_proj_weight.t() + mha.in_proj_bias
        b = torch.cat([beit.q_bias, torch.zeros_like(beit.v_bias), beit.v_bias])
        return q, x @ beit.qkv.weight.t() + b

    before = qkv()
    assert sharpen_attention(torch.nn.Sequential(mha, beit), 3.0) == 2
    for old, new in zip(before, qkv()):
        assert torch.allclose(new[..., :16], 3 * old[..., :16], atol=1e-5)
        assert torch.equal(new[..., 16:], old[..., 16:])
    with pytest.raises(ValueError, match='no nn.MultiheadAttention'):
        sharpen_attention(torch.nn.Linear(3, 3), 2.0)


def test_dataset_batches_come_from_the_training_set_through_its_pipeline(tmp_path):
    """``--data-root``'s batches: the config's training samples through its pipeline and the
    model's data preprocessor, the same in every run, the next samples for the next batch; the
    tool measures on them and a missing sample is a clear error."""
    from mmseg_mesa.bench.models import dataset_batch
    from mmseg_mesa.demo import write_demo_dataset
    root = str(tmp_path / 'demo')
    write_demo_dataset(root, num_train=6, num_val=1)
    cfg = load_config(DEMO)
    model = build_model(cfg, 'cpu')
    inputs, samples = dataset_batch(cfg, model, 2, root)
    again, _ = dataset_batch(cfg, model, 2, root)
    other, _ = dataset_batch(cfg, model, 2, root, first=2)
    assert inputs.shape == (2, 3, 64, 64) and len(samples) == 2
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    labels = torch.cat([s.gt_sem_seg.data.unique() for s in samples])
    assert labels.max() < 6 or labels.max() == 255  # the demo's classes (255: ignored)
    assert abs(inputs.mean()) < 3  # normalized by the preprocessor, not raw 0..255 pixels
    with pytest.raises(ValueError, match='has 6 samples; samples 4..7 asked for'):
        dataset_batch(cfg, model, 4, root, first=4)


@pytest.mark.slow
def test_tool_measures_on_the_training_set(tmp_path):
    from mmseg_mesa.demo import write_demo_dataset
    root = str(tmp_path / 'demo')
    write_demo_dataset(root, num_train=8, num_val=1)
    results = gradient_fidelity(tmp_path, DEMO, '--batch', '2', '--batches', '2',
                                '--data-root', root)
    assert results['data_root'] == root and results['size'] == [64, 64]
    assert 0 < results['presets']['config']['rows'][0]['relative_error'] < 0.02
    assert len(results['presets']['config']['batches']['relative_errors']) == 2


def test_data_root_reaches_the_datasets_inside_wrappers():
    """mmseg's DRIVE configs repeat their dataset, VOC-aug concatenates two: the inner ones take
    the data root, the wrappers (which take no such argument) do not."""
    from mmseg_mesa.bench.models import with_data_root
    plain = with_data_root(dict(type='ADE20KDataset', data_root='data/ade'), '/d')
    assert plain['data_root'] == '/d'
    repeated = with_data_root(dict(type='RepeatDataset', times=4, dataset=dict(type='DRIVE')), '/d')
    assert 'data_root' not in repeated and repeated['dataset']['data_root'] == '/d'
    joined = with_data_root(dict(type='ConcatDataset', datasets=[dict(type='A'), dict(
        type='RepeatDataset', dataset=dict(type='B'))]), '/d')
    assert 'data_root' not in joined and joined['datasets'][0]['data_root'] == '/d'
    assert joined['datasets'][1]['dataset']['data_root'] == '/d'
