"""``mesa=True`` on mmseg's zoo: models whose attention and products are written functionally.

Each upstream config is built at a small size: the converted model's losses are bit-identical to
the unconverted one's, its whole gradient is close (relative error <= 0.02, worst cosine >= 0.99
over the parameters whose exact gradient is >= 1e-3 of the largest), and every module type that
``MesaFunctional``
handles appears converted in one of these models (its forward wrapped, not rewritten).
"""
import copy

import pytest
import torch
from mmseg_models import batch, build_model, total_loss

from mmseg_mesa import convert_to_mesa
from mmseg_mesa.bench.coverage import split_saved, training_forward
from mmseg_mesa.bench.fidelity import relative_error, worst_cosine
from mmseg_mesa.integrations.mmseg_handlers import functional_types

SMALL_VIT = {'model.backbone.img_size': (64, 64)}
# name -> (config, options, size, largest uncompressed share or None)
ZOO = {
    # K-Net at 128x128, the size of its figures in docs/benchmarks.md
    'knet-s3-swin-t': ('knet/knet-s3_swin-t_upernet_8xb2-adamw-80k_ade20k-512x512.py', None, 128,
                       0.03),
    'beit-b': ('beit/beit-base_upernet_8xb2-160k_ade20k-640x640.py', SMALL_VIT, 64, 0.03),
    'twins-svt-s': ('twins/twins_svt-s_uperhead_8xb2-160k_ade20k-512x512.py', None, 64, 0.03),
    'ocrnet-hr18s': ('ocrnet/ocrnet_hr18s_4xb4-80k_ade20k-512x512.py', None, 64, 0.03),
    'segnext-t': ('segnext/segnext_mscan-t_1xb16-adamw-160k_ade20k-512x512.py', None, 64, None),
    'danet': ('danet/danet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 64, 0.03),
    'apcnet': ('apcnet/apcnet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 64, None),
    'gcnet': ('gcnet/gcnet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 64, None),
    'nonlocal': ('nonlocal_net/nonlocal_r50-d8_4xb4-80k_ade20k-512x512.py', None, 64, None),
    # mmdet's heads: deformable attention, masked attention, the recomputed mask losses
    'mask2former-swin-t': ('mask2former/mask2former_swin-t_8xb2-160k_ade20k-512x512.py', None,
                           128, 0.03),
    # its ResNet keeps its batch norms in eval mode (norm_eval)
    'maskformer-r50': ('maskformer/maskformer_r50-d32_8xb2-160k_ade20k-512x512.py', None, 128,
                       0.03),
    # mmpretrain's ConvNeXt and PoolFormer: LayerNorm2d, layer scale, pooling token mixers
    'convnext-t': ('convnext/convnext-tiny_upernet_8xb2-amp-160k_ade20k-512x512.py', None, 64,
                   0.03),
    'poolformer-s12': ('poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py', None, 128,
                       0.03),
    # Cityscapes' 19 classes; the heads' own OHEM, boundary and semantic-encoding losses
    # recomputed, PIDNet's sigmoid-gated fusions, EncNet's Encoding
    'pidnet-s': ('pidnet/pidnet-s_2xb6-120k_1024x1024-cityscapes.py', None, 128, 0.03),
    'pidnet-l': ('pidnet/pidnet-l_2xb6-120k_1024x1024-cityscapes.py', None, 128, 0.03),  # Bag
    'ddrnet-23-slim': ('ddrnet/ddrnet_23-slim_in1k-pre_2xb6-120k_cityscapes-1024x1024.py', None,
                       128, 0.03),
    'encnet-r50': ('encnet/encnet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 64, 0.03),
    # BiSeNet's and STDC's attention / fusion modules, criss-cross attention, mmcv's Scale
    'stdc1': ('stdc/stdc1_4xb12-80k_cityscapes-512x1024.py', None, 128, 0.03),
    'bisenetv1-r18': ('bisenetv1/bisenetv1_r18-d32_4xb4-160k_cityscapes-1024x1024.py', None, 128,
                      0.03),
    'bisenetv2': ('bisenetv2/bisenetv2_fcn_4xb4-160k_cityscapes-1024x1024.py', None, 128, 0.03),
    'ccnet-r50': ('ccnet/ccnet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 64, 0.03),
    # its self-attention matmuls' right operands grouped by column
    'isanet-r50': ('isanet/isanet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 128, 0.03),
    'resnest-s50': ('resnest/resnest_s101-d8_fcn_4xb4-160k_ade20k-512x512.py',
                    {'model.backbone.depth': 50}, 128, 0.03),
    'pointrend-r50': ('point_rend/pointrend_r50_4xb4-160k_ade20k-512x512.py', None, 128, 0.03),
    # channel gates (x * se(x)) and generated filters; MobileNetV3 at 512: its 49x49 pooling
    'cgnet': ('cgnet/cgnet_fcn_4xb4-60k_cityscapes-680x680.py', None, 128, 0.03),
    'dmnet-r50': ('dmnet/dmnet_r50-d8_4xb4-80k_ade20k-512x512.py', None, 128, 0.03),
    'mobilenet-v3-lraspp': (
        'mobilenet_v3/mobilenet-v3-d8_lraspp_4xb4-320k_cityscapes-512x1024.py', None, 512, 0.03),
}
CONVERTED_TYPES: dict[str, set[str]] = {}


def step(model, data):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # drop path / dropout draw the same masks in both
    losses = model(*data, mode='loss')
    total_loss(losses).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


@pytest.mark.slow
@pytest.mark.parametrize('name', list(ZOO))
def test_losses_bit_identical_gradients_close_nothing_large_left(name):
    config, options, size, max_left = ZOO[name]
    reference = build_model(config, options=options)
    model = copy.deepcopy(reference)
    report = convert_to_mesa(model)
    CONVERTED_TYPES[name] = {src for src, _ in report.converted.values()}
    data = batch(size, n=2, classes=getattr(reference.decode_head, 'num_classes', 150))
    ref_losses, exact = step(reference, data)
    losses, grads = step(model, data)
    for key, value in ref_losses.items():
        assert torch.equal(value, losses[key]), key
    assert relative_error(grads, exact) <= 0.02
    assert worst_cosine(grads, exact) >= 0.99
    if max_left is not None:
        base = split_saved(reference, training_forward(reference, data))
        mesa = split_saved(model, training_forward(model, data))
        assert mesa['left_bytes'] <= max_left * base['saved_bytes'], mesa['left_by_module']


def test_stdc1_holds_on_the_zoo_sweeps_batch():
    """The sweep's batch (``tools/benchmark_zoo.py``), on which STDC1's three auxiliary heads'
    gradients nearly cancel in the backbone, so the error of a BatchNorm's per-channel sum
    reaches every backbone weight: stochastically rounded BatchNorm codes measured 0.020-0.045
    over draws there, nearest-rounded ones (the default) 0.016."""
    from mmseg_models import upstream_path

    from mmseg_mesa.bench import models
    from mmseg_mesa.bench.fidelity import losses_and_gradients, split
    cfg = models.load_config(upstream_path('stdc/stdc1_4xb12-80k_cityscapes-512x1024.py'))
    reference = models.build_model(cfg, 'cpu')  # as the sweep builds it
    data, _ = split(models.make_batch(cfg, 4, (128, 128), 'cpu'), 2)
    model = copy.deepcopy(reference)
    convert_to_mesa(model)
    reference.train()
    model.train()
    exact = losses_and_gradients(reference, data)[1]
    for _ in range(3):
        grads = losses_and_gradients(model, data)[1]
        assert relative_error(grads, exact) <= 0.02
        assert worst_cosine(grads, exact) >= 0.99


@pytest.mark.slow  # reads what the zoo tests recorded
def test_every_functional_handler_runs_in_a_zoo_model():
    """Runs after the zoo tests in this file (they record what was converted)."""
    assert len(CONVERTED_TYPES) == len(ZOO), 'run the whole file'
    seen = set().union(*CONVERTED_TYPES.values())
    for handled in functional_types():
        # a handled type counts when it or one of its subclasses was converted (and run)
        assert any(issubclass(t, handled) for t in _classes(seen)), handled.__name__


def _classes(names: set[str]) -> set[type]:
    """The module classes named ``names`` among those mmseg / mmcv / mmpretrain define."""
    import mmcv.cnn  # noqa: F401
    import mmpretrain.models  # noqa: F401
    import mmseg.models  # noqa: F401
    found, todo = set(), [torch.nn.Module]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__name__ in names and cls.__module__.startswith(('mmseg.', 'mmcv.',
                                                                 'mmpretrain.')):
            found.add(cls)
    return found


def test_knet_kernel_updator_quantizes_per_proposal():
    """K-Net's proposals differ in scale by their masks' mass; the updator's Linears and
    products get one group per proposal, which keeps the small proposals' gradients."""
    from mmseg.models.decode_heads.knet_head import KernelUpdator
    torch.manual_seed(0)
    reference = KernelUpdator(in_channels=32, feat_channels=32, out_channels=32)
    model = copy.deepcopy(reference)
    report = convert_to_mesa(torch.nn.Sequential(model))
    linears = ('dynamic_layer', 'input_layer', 'input_gate', 'update_gate', 'fc_layer')
    assert {f'0.{n}' for n in linears} <= set(report.converted)
    for name in linears:
        spec = getattr(model, name).quant_input.spec
        assert (spec.group_dim, spec.group_size, spec.ema_decay) == (0, 1, 0.0), name
    scales = torch.logspace(-2, 2, 64).unsqueeze(1)  # proposals four orders of magnitude apart
    update, feature = torch.randn(64, 32) * scales, torch.randn(64, 1, 32)
    grad = torch.randn(64, 1, 32)
    outputs = []
    for module in (reference, model):
        module.train()
        out = module(update.clone().requires_grad_(), feature.clone().requires_grad_())
        out.backward(grad)
        outputs.append(out)
    assert torch.equal(*outputs)
    assert len(model.mesa_sites) > 0  # its own products are packed too
    for name in linears:
        expected = getattr(reference, name).weight.grad
        got = getattr(model, name).weight.grad
        assert torch.nn.functional.cosine_similarity(expected.flatten(), got.flatten(), 0) \
            >= 0.999, name


def test_einsum_gradient_equations():
    from mmseg_mesa.layers.einsum import gradient_equations
    assert gradient_equations('bnhw,bchw->bnc') == ('bnc,bchw->bnhw', 'bnc,bnhw->bchw')
    assert gradient_equations('bqc, bqhw->bchw') == ('bchw,bqhw->bqc', 'bchw,bqc->bqhw')
    for unsupported in ('bnhw,bchw', 'ii,ij->j', '...c,cd->...d', 'ab,cd->ad', 'ab,bc,cd->ad'):
        assert gradient_equations(unsupported) is None, unsupported


def test_knet_kernel_update_head_einsum_and_dynamic_conv_are_compressed_exactly():
    """KernelUpdateHead's mask-weighted sum (einsum) and its dynamic-kernel convolution save
    the feature map packed; the mask softmax stays torch's (probabilities across classes are
    small next to each class's largest) and the einsum keeps its output as the softmax does."""
    from mmseg.models.decode_heads.knet_head import KernelUpdateHead
    from mmseg.utils import register_all_modules
    register_all_modules()  # the updator is built from the registry
    torch.manual_seed(0)
    updator = dict(type='KernelUpdator', in_channels=16, feat_channels=16, out_channels=16)
    reference = KernelUpdateHead(num_classes=5, num_heads=2, num_mask_fcs=1,
                                 feedforward_channels=32, in_channels=16, out_channels=16,
                                 kernel_updator_cfg=updator)
    model = copy.deepcopy(reference)
    report = convert_to_mesa(torch.nn.Sequential(model))
    assert report.converted['0'] == ('KernelUpdateHead', 'MesaFunctional')
    x = torch.randn(2, 16, 8, 8)
    kernels = torch.randn(2, 5, 16, 1, 1)
    masks = torch.randn(2, 5, 8, 8)
    outputs, grads = [], []
    for module in (reference, model):
        module.train()
        inputs = [t.clone().requires_grad_() for t in (x, kernels, masks)]
        out = module(*inputs)
        sum(o.square().sum() for o in out).backward()
        outputs.append(out)
        grads.append(inputs[0].grad)
    for a, b in zip(*outputs):
        assert torch.equal(a, b)
    kinds = sorted(key.split('_', 1)[1] for key in model.mesa_sites)
    assert kinds == ['conv2d_input'] * 2 + ['matmul_b']  # one conv per image, x of the einsum
    assert torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), 0) \
        >= 0.999


@pytest.mark.parametrize('data_format', ['channel_first', 'channel_last'])
def test_mmpretrain_layer_norm_2d_is_converted_exactly(data_format):
    """mmpretrain's LayerNorm2d overrides forward (two layouts); its Mesa class keeps both."""
    from mmpretrain.models.utils.norm import LayerNorm2d

    from mmseg_mesa import MesaModule
    torch.manual_seed(0)
    reference = LayerNorm2d(16)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    model = copy.deepcopy(reference)
    report = convert_to_mesa(torch.nn.Sequential(model))
    assert isinstance(model, MesaModule) and report.converted['0'][0] == 'LayerNorm2d'
    x = torch.randn(2, 16, 7, 9) if data_format == 'channel_first' else torch.randn(2, 7, 9, 16)
    grads, outs = [], []
    for module in (reference, model):
        xi = x.clone().requires_grad_()
        out = module(xi, data_format=data_format)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        outs.append(out)
        grads.append([xi.grad, module.weight.grad, module.bias.grad])
    assert torch.equal(*outs)
    for a, b in zip(*grads):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0) >= 0.999


def test_encoding_saves_its_input_packed_and_recomputes_in_blocks(monkeypatch):
    """EncNet's Encoding: forward bit-identical, one byte per input value saved (its residuals
    expanded over the codewords are not), gradients close, and backward's blocks of pixels add
    up to the one-block result from the same codes."""
    from mmseg.models.utils.encoding import Encoding

    import mmseg_mesa.integrations.encoding as encoding
    from mmseg_mesa.memory import count_saved_tensors
    torch.manual_seed(0)
    reference = Encoding(channels=16, num_codes=8)
    model = copy.deepcopy(reference)
    report = convert_to_mesa(torch.nn.Sequential(model))
    assert report.converted['0'][0] == 'Encoding'
    x = torch.randn(2, 16, 12, 12).relu() * torch.linspace(0.5, 1.5, 16).view(1, -1, 1, 1)
    grad = torch.randn(2, 8, 16)
    runs = {}
    for module in (reference, model):
        leaf = x.clone().requires_grad_()
        with count_saved_tensors(module) as saved:
            out = module(leaf)
        for block in (1 << 22, 2 * 8 * 16 * 5):  # one block; several, the last one short
            monkeypatch.setattr(encoding, 'BLOCK_ELEMENTS', block)
            leaf.grad = module.codewords.grad = module.scale.grad = None
            out.backward(grad, retain_graph=True)
            runs[module, block] = [leaf.grad, module.codewords.grad, module.scale.grad]
        runs[module] = (out, saved.total_bytes)
    assert torch.equal(runs[model][0], runs[reference][0])
    assert runs[model][1] < x.numel() * 1.1 < runs[reference][1] / 4
    exact = runs[reference, 1 << 22]
    for g, e in zip(runs[model, 1 << 22], exact):
        assert (g - e).norm() <= 0.02 * e.norm()
    for g, h in zip(runs[model, 1 << 22], runs[model, 2 * 8 * 16 * 5]):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


# Backbones mmseg's configs never name, in mmseg's UPerNet (``bench.backbones``): their own
# layers go through the generic path. name -> (backbone config, size, worst cosine bound)
OUTSIDE = {
    # cosine attention (F.normalize), a position-bias MLP, its logit scale, an nn.Softmax
    # child: the map replayed (0.998 worst cosine; 0.981 with 8-bit probabilities)
    'mmpretrain-swinv2-t': (dict(type='mmpretrain.SwinTransformerV2', arch='tiny', img_size=256,
                                 out_indices=(0, 1, 2, 3)), 256, 0.99),
    'mmpretrain-davit-t': (dict(type='mmpretrain.DaViT', arch='t', out_indices=(0, 1, 2, 3),
                                pad_small_map=True), 128, 0.99),
    # timm's own GELU and LayerNorm2d, layer scale as a parameter product
    'timm-convnext-atto': (dict(type='mmpretrain.TIMMBackbone', model_name='convnext_atto',
                                features_only=True, pretrained=False), 128, 0.99),
    # F.scaled_dot_product_attention, one resolution: mmseg's MultiLevelNeck
    'timm-vit-s': (dict(type='mmpretrain.TIMMBackbone', model_name='vit_small_patch16_224',
                        features_only=True, pretrained=False, img_size=224,
                        out_indices=(2, 5, 8, 11)), 128, 0.99),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', list(OUTSIDE))
def test_backbones_from_outside_mmseg_configs_hold(name):
    """Forward bit-identical, whole-gradient error <= 0.02, at most 0.03 of the baseline's
    saved bytes left uncompressed."""
    from mmseg_mesa.bench.backbones import upernet_config
    from mmseg_mesa.bench.sweep import measure
    backbone, size, cosine_bound = OUTSIDE[name]
    result = measure(upernet_config(backbone, size), size, 2, {})
    assert result['forward_identical']
    assert result['relative_error'] <= 0.02
    assert result['worst_cosine'] >= cosine_bound
    assert result['left_share'] <= 0.03, result['left_top']
    assert result['saved_ratio'] <= 0.2


@pytest.mark.slow
@pytest.mark.parametrize('calibrated', [False, True])
def test_t2t_vit_sharp_attention_is_left_to_torch_and_named(calibrated):
    """mmpretrain 1.2.0's T2T-ViT multiplies its logits by 8 where it means to divide (its
    ``qk_scale`` goes to a Python attention that divides by it): nearly one-hot maps, which
    8-bit codes cannot hold (whole-gradient error 0.083 with its maps packed). Its attention is
    left to torch, bit-identical, and the sweep's row says why. Calibrated, it stays so: the
    calibration's refined q and k (its reference keeps every layer refined) do not turn the
    maps into replayed ones, and the few layers it refines only lower the error."""
    from mmseg_mesa.bench.backbones import upernet_config
    from mmseg_mesa.bench.sweep import measure
    from mmseg_mesa.layers.recomputed_map import SHARP_MAP
    backbone = dict(type='mmpretrain.T2T_ViT', img_size=224, out_indices=(2, 5, 8, 13),
                    out_type='featmap')
    result = measure(upernet_config(backbone, 128), 128, 2, {}, calibrated)
    assert result['forward_identical']
    assert result['relative_error'] <= 0.02 and result['worst_cosine'] >= 0.99
    assert result['left_to_torch'] == [f'16 x MultiheadAttention: {SHARP_MAP}']
    if calibrated:
        calibration = result['calibration']
        assert not calibration['exhausted']
        assert calibration['after'][0] <= calibration['before'][0]


@pytest.mark.slow
def test_timm_repvit_holds_with_batchnorm_over_few_values_refined():
    """timm's RepViT at 128x128, batch 2: a 1x1 scale branch's near-zero channel has a gradient
    that cancels 50-fold over its 128 values, and the BatchNorms after it, over 128 values per
    channel too, err along it with 8-bit codes. With them refined (the default,
    ``batchnorm_refine_below``) every parameter holds; at 8 bits one does not."""
    from mmseg_mesa import MesaConfig
    from mmseg_mesa.bench import models
    from mmseg_mesa.bench.backbones import upernet_config
    from mmseg_mesa.bench.fidelity import losses_and_gradients, split
    cfg = upernet_config(dict(type='mmpretrain.TIMMBackbone', model_name='repvit_m1',
                              features_only=True, pretrained=False), 128)
    torch.manual_seed(0)
    reference = models.build_model(cfg, 'cpu')
    data, _ = split(models.make_batch(cfg, 4, (128, 128), 'cpu'), 2)
    models = {below: copy.deepcopy(reference) for below in (256, 0)}
    reference.train()
    exact_losses, exact = losses_and_gradients(reference, data)
    worst = {}
    for below, model in models.items():
        convert_to_mesa(model, config=MesaConfig(batchnorm_refine_below=below))
        model.train()
        losses, grads = losses_and_gradients(model, data)
        assert all(torch.equal(losses[k], exact_losses[k]) for k in losses if 'loss' in k)
        worst[below] = worst_cosine(grads, exact)
    assert worst[256] >= 0.99 > worst[0], worst
