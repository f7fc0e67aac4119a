"""Mesa on mmseg's own Swin-T and DeiT-S UPerNet (built from the installed ADE20K configs)."""
import copy

import pytest
import torch
from conftest import cosine
from mmseg_models import DEIT_S, SWIN_T, batch, build_model, total_loss
from torch import nn

from mmseg_mesa import MesaModule, convert_to_mesa
from mmseg_mesa.memory import count_saved_tensors

pytestmark = pytest.mark.slow  # whole models

MODELS = {'swin-t': SWIN_T, 'deit-s': DEIT_S}


@pytest.fixture(scope='module', params=list(MODELS))
def model_pair(request):
    reference = build_model(MODELS[request.param])
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model)
    return request.param, reference, model, report


def test_conversion_report_and_state_dict(model_pair):
    name, reference, model, report = model_pair
    assert model.state_dict().keys() == reference.state_dict().keys()
    converted = report.converted_by_type()
    attention = 'WindowMSA' if name == 'swin-t' else 'MultiheadAttention'
    for kind in (attention, 'Linear', 'LayerNorm', 'GELU', 'Conv2d', '_BatchNormXd', 'ReLU'):
        assert converted[kind] > 0, kind
    # nothing that saves a large activation is left behind; the losses' modules (which the
    # decode heads' banded losses do not call) take the generic path
    left_types = {typ for typ, _ in report.left.values()}
    assert not left_types & {'Linear', 'Conv2d', 'LayerNorm', 'GELU', 'Softmax', 'ReLU'}
    generic_types = {m.mesa_original_type for m in report.generic.values()}
    assert 'CrossEntropyLoss' in generic_types and 'CrossEntropyLoss' not in left_types
    if name == 'deit-s':
        assert all(isinstance(m, MesaModule) for n, m in model.named_modules()
                   if n.endswith('attn.attn'))


def test_forward_is_bit_identical_and_gradients_close(model_pair):
    _, reference, model, _ = model_pair
    inputs, samples = batch(64)
    model.train()
    reference.train()
    reference.zero_grad()
    model.zero_grad()
    torch.manual_seed(1)  # drop path draws the same masks in both
    ref_losses = reference(inputs, samples, mode='loss')
    torch.manual_seed(1)
    losses = model(inputs, samples, mode='loss')
    for key, value in ref_losses.items():
        assert torch.equal(value, losses[key]), key
    total_loss(ref_losses).backward()
    total_loss(losses).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    largest = max(g.norm() for g in ref_grads.values())
    for key, ref_grad in ref_grads.items():
        if ref_grad.norm() <= 1e-6 * largest:
            # analytically zero (e.g. the bias of a norm whose output only reaches BatchNorm):
            # ours must be as negligible, not noise.
            assert grads[key].norm() <= 1e-5 * largest, key
        else:
            assert cosine(grads[key], ref_grad) >= 0.99, key


def test_eval_outputs_are_identical(model_pair):
    _, reference, model, _ = model_pair
    inputs, _ = batch(64, seed=3)
    reference.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(reference._forward(inputs), model._forward(inputs))
    reference.train()
    model.train()


def test_swin_t_upernet_saved_bytes_at_512():
    """Swin-T UPerNet, 512x512, batch 2, fp32: Mesa saves at most 0.20x of the baseline's bytes
    (measured 0.127x, docs/benchmarks.md)."""
    reference = build_model(SWIN_T)
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    inputs, samples = batch(512)
    with count_saved_tensors(reference) as base:
        reference(inputs, samples, mode='loss')
    with count_saved_tensors(model) as mesa:
        model(inputs, samples, mode='loss')
    ratio = mesa.total_bytes / base.total_bytes
    assert ratio <= 0.20, (ratio, mesa.by_type)
    # the losses' full-resolution log-softmax (a fifth of the baseline) is not kept at all ...
    assert base.by_type['CrossEntropyLoss'] > 0.15 * base.total_bytes
    assert mesa.by_type['CrossEntropyLoss'] == 0
    # ... and every compressed layer type keeps at most ~27% of its baseline bytes.
    for kind in ('Linear', 'Conv2d', 'LayerNorm', 'GELU', 'Softmax', '_BatchNormXd'):
        assert mesa.by_type[kind] <= 0.27 * base.by_type[kind], kind
    assert mesa.by_type['ReLU'] <= 0.05 * base.by_type['ReLU']


def _training_step(net, autocast=False):
    inputs, samples = batch(64, seed=5)
    net.train()
    net.zero_grad()
    torch.manual_seed(2)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        losses = net(inputs, samples, mode='loss')
    total_loss(losses).backward()
    return losses, {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _compare_training_step(reference, model, autocast=False, negligible=1e-6):
    ref_losses, ref_grads = _training_step(reference, autocast)
    losses, grads = _training_step(model, autocast)
    for key, value in ref_losses.items():
        assert torch.equal(value, losses[key]), key
    largest = max(g.norm() for g in ref_grads.values())
    keys = [k for k, g in ref_grads.items() if g.norm() > negligible * largest]
    assert len(keys) > 0.8 * len(ref_grads)
    worst = min(keys, key=lambda k: cosine(grads[k], ref_grads[k]))
    assert cosine(grads[worst], ref_grads[worst]) >= 0.99, worst


def test_composes_with_swin_with_cp():
    """Swin's own ``with_cp=True`` (torch checkpoint inside each block) on top of Mesa."""
    from mmseg_models import upstream_config  # noqa: F401  (documents where the model comes from)
    reference = build_model(SWIN_T)
    for module in reference.backbone.modules():
        if hasattr(module, 'with_cp'):
            module.with_cp = True
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    _compare_training_step(reference, model)


def test_composes_with_mmengine_activation_checkpointing():
    from mmengine.runner.activation_checkpointing import turn_on_activation_checkpointing
    reference = build_model(SWIN_T)
    model = copy.deepcopy(reference)
    convert_to_mesa(model)  # MesaHook converts in before_run, before mmengine turns this on
    stages = [f'backbone.stages.{i}' for i in range(4)]
    turn_on_activation_checkpointing(reference, stages)
    turn_on_activation_checkpointing(model, stages)
    _compare_training_step(reference, model)


def test_composes_with_autocast():
    """AMP: CPU autocast in bf16 (mmengine's AmpOptimWrapper needs a GPU).

    bf16 keeps ~3 significant digits: on this randomly initialised model torch's own AMP
    gradients have median cosine ~0 against its fp32 ones, and the smallest ones (LayerNorm
    biases feeding BatchNorm, norms below 1e-3 of the largest gradient) are rounding noise. Every
    gradient above that must match torch's AMP gradient; the forward must be bit-identical.
    """
    reference = build_model(SWIN_T)
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    _compare_training_step(reference, model, autocast=True, negligible=1e-3)


def test_layer_decay_optimizer_recognises_a_wrapped_backbone():
    """mmseg's layer-decay constructors find BEiT / MAE / ConvNeXt by the backbone's class name;
    a backbone the generic path wraps (until its first step) keeps its name in its class's."""
    from mmseg.engine.optimizers import LearningRateDecayOptimizerConstructor
    from mmseg.models.backbones import BEiT
    model = nn.Module()
    model.backbone = BEiT(img_size=(32, 32), patch_size=16, embed_dims=32, num_layers=2,
                          num_heads=2, out_indices=(1,))
    convert_to_mesa(model)
    assert type(model.backbone).__name__ == 'MesaFunctional[BEiT]'
    constructor = LearningRateDecayOptimizerConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05)),
        dict(num_layers=2, decay_rate=0.9, decay_type='layer_wise'))
    groups = constructor(model).optimizer.param_groups
    assert len({g['lr'] for g in groups}) == 3  # decayed by layer
