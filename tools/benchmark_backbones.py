"""``mesa=True`` on UPerNet around backbones mmseg's own configs never name.

    python tools/benchmark_backbones.py [--size 128] [--batch 2]
        [--backbones ConvNeXt timm/resnet18 ...] [--jobs 1] [--timeout 900]
        [--json work_dirs/benchmarks/backbones.json] [--markdown PATH]
        [--calibrate | --no-calibrate | --calibrate-error 0.02 --calibrate-cosine 0.99]

Every mmpretrain backbone that returns multi-level feature maps (``MMPRETRAIN``: the smallest
arch of each, through ``type='mmpretrain.<Name>'``) and a set of timm models through
``mmpretrain.TIMMBackbone`` with ``features_only=True`` (``TIMM``), each inside mmseg's UPerNet
(``_base_/models/upernet_swin.py``) with its heads fitted to the maps the backbone returns
(``mmseg_mesa.bench.backbones``; plain ViTs get mmseg's ``MultiLevelNeck``). Random weights.

Per backbone it runs one training step of the unconverted model and of its default Mesa
conversion (``MesaConfig()``; with ``--calibrate`` or ``--calibrate-error`` /
``--calibrate-cosine``, calibrated first on another batch as a run's first iteration calibrates
with ``MesaConfig.calibrate``; ``--no-calibrate``: the rules alone) on the same random batch
(``--size`` square, ``--batch`` images) and prints what ``tools/benchmark_zoo.py`` prints
(``mmseg_mesa.bench.sweep``): the outcome, whether the forward is bit-identical, saved bytes
against the baseline's, the share left uncompressed and the modules holding it, the
whole-gradient error against the minibatch noise, the worst cosine; and the calls the
conversion's generic path left to torch in that step (the JSON row lists them all, the table
the two most frequent; the row's ``calibration``, what the calibration refined and its cost).

mmpretrain backbones that cannot feed UPerNet are listed with the reason (``SKIPPED``). Each
backbone runs in a process of its own (``--one``), so one that fails ends only its row. A slow
benchmark (about an hour on one core), not a test: ``tests/test_benchmark_backbones.py`` runs
one row.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from mmseg_mesa.bench import sweep

FOUR = (0, 1, 2, 3)
VIT_LAYERS = (2, 5, 8, 11)  # mmseg's ViT-UPerNet taps of a 12-layer ViT
# mmpretrain backbone -> its arguments (smallest arch, multi-level out_indices)
MMPRETRAIN: dict[str, dict] = {
    'ResNet': dict(depth=18, out_indices=FOUR),
    'ResNetV1c': dict(depth=18, out_indices=FOUR),
    'ResNetV1d': dict(depth=18, out_indices=FOUR),
    'ResNet_CIFAR': dict(depth=18, out_indices=FOUR),
    'ResNeXt': dict(depth=50, out_indices=FOUR),
    'ResNeSt': dict(depth=50, out_indices=FOUR),
    'Res2Net': dict(depth=50, out_indices=FOUR),
    'SEResNet': dict(depth=50, out_indices=FOUR),
    'SEResNeXt': dict(depth=50, out_indices=FOUR),
    'RegNet': dict(arch='regnetx_400mf', out_indices=FOUR),
    'VGG': dict(depth=11, out_indices=(1, 2, 3, 4)),
    'ShuffleNetV1': dict(out_indices=(0, 1, 2)),
    'ShuffleNetV2': dict(out_indices=FOUR),
    'MobileNetV2': dict(out_indices=(1, 2, 4, 7)),
    'MobileNetV3': dict(arch='small', out_indices=(0, 1, 3, 12)),
    'MobileOne': dict(arch='s0', out_indices=FOUR),
    'RepVGG': dict(arch='A0', out_indices=FOUR),
    'RepLKNet': dict(arch='31B', out_indices=FOUR),
    'RepMLPNet': dict(arch='b', img_size=224, out_indices=FOUR),
    'EfficientNet': dict(arch='b0', out_indices=(1, 2, 4, 6)),
    'EfficientNetV2': dict(arch='b0', out_indices=(1, 2, 4, 7)),
    'EfficientFormer': dict(arch='l1', out_indices=FOUR, reshape_last_feat=True),
    'ConvNeXt': dict(arch='atto', out_indices=FOUR, gap_before_final_norm=False),
    'ConvNeXt-V2': dict(type='ConvNeXt', arch='atto', use_grn=True, out_indices=FOUR,
                        gap_before_final_norm=False),
    'EdgeNeXt': dict(arch='xxsmall', out_indices=FOUR, gap_before_final_norm=False),
    'HorNet': dict(arch='t', out_indices=FOUR, gap_before_final_norm=False),
    'VAN': dict(arch='tiny', out_indices=FOUR),
    'PoolFormer': dict(arch='s12', out_indices=(0, 2, 4, 6)),
    'RIFormer': dict(arch='s12', out_indices=(0, 2, 4, 6)),
    'HRNet': dict(arch='w18'),
    'CSPDarkNet': dict(depth=53, out_indices=(1, 2, 3, 4)),
    'CSPResNet': dict(depth=50, out_indices=FOUR),
    'CSPResNeXt': dict(depth=50, out_indices=FOUR),
    'DenseNet': dict(arch='121', out_indices=FOUR),
    'MobileViT': dict(arch='xx_small', out_indices=(1, 2, 3, 4)),
    'SwinTransformer': dict(arch='tiny', img_size=224, out_indices=FOUR, pad_small_map=True),
    'SwinTransformerV2': dict(arch='tiny', img_size=256, out_indices=FOUR),
    'DaViT': dict(arch='t', out_indices=FOUR, pad_small_map=True),
    'PCPVT': dict(arch='s', out_indices=FOUR),
    'SVT': dict(arch='s', out_indices=FOUR),
    'TinyViT': dict(arch='5m', img_size=(224, 224), out_indices=FOUR, gap_before_final_norm=False),
    'LeViT': dict(arch='128s', img_size=224, out_indices=(0, 1, 2)),
    'MViT': dict(arch='tiny', img_size=224, out_scales=FOUR),
    'PyramidVig': dict(arch='tiny', out_indices=FOUR),
    # one resolution: through MultiLevelNeck, as mmseg's ViT-UPerNet
    'VisionTransformer': dict(arch='deit-tiny', img_size=224, out_indices=VIT_LAYERS,
                              out_type='featmap'),
    'DistilledVisionTransformer': dict(arch='deit-tiny', img_size=224, out_indices=VIT_LAYERS,
                                       out_type='featmap'),
    'DeiT3': dict(arch='s', img_size=224, out_indices=VIT_LAYERS, out_type='featmap'),
    'BEiTViT': dict(arch='deit-t', img_size=224, out_indices=VIT_LAYERS, out_type='featmap'),
    'ViTEVA02': dict(arch='t', img_size=224, out_indices=VIT_LAYERS, out_type='featmap'),
    'ViTSAM': dict(arch='b', img_size=224, out_indices=VIT_LAYERS, out_type='raw'),
    'XCiT': dict(img_size=224, depth=12, embed_dims=192, num_heads=4, out_indices=VIT_LAYERS,
                 out_type='featmap'),
    'T2T_ViT': dict(img_size=224, out_indices=(2, 5, 8, 13), out_type='featmap'),
    'Vig': dict(arch='tiny', out_indices=VIT_LAYERS),
    'ConvMixer': dict(arch='768/32', out_indices=(7, 15, 23, 31)),
}
# timm model -> TIMMBackbone arguments besides features_only=True, pretrained=False
TIMM: dict[str, dict] = {
    'convnext_atto': {},
    'convnextv2_atto': {},  # GRN
    'resnet18': {},
    'resnet50d': {},
    'regnety_002': {},  # squeeze-excitation
    'efficientnet_b0': {},  # BatchNormAct2d, SiLU
    'mobilenetv3_small_100': {},  # hard-swish
    'ghostnetv2_100': {},
    'hgnetv2_b0': {},
    'repvit_m1': {},
    'starnet_s1': {},
    'inception_next_atto': {},
    'edgenext_xx_small': {},
    'efficientvit_b0': {},
    'fastvit_t8': {},
    'poolformerv2_s12': {},
    'convformer_s18': {},  # StarReLU
    'caformer_s18': {},  # attention in the last stages
    'mobilevit_xxs': {},
    'tiny_vit_5m_224': {},
    'nextvit_small': {},
    'efficientformerv2_s0': dict(img_size=224),
    'levit_128s': dict(img_size=224),  # three levels
    'coatnet_nano_rw_224': dict(img_size=224),
    'maxvit_tiny_rw_224': dict(img_size=224),
    'swin_tiny_patch4_window7_224': dict(img_size=224, feature_cls='getter'),  # NHWC otherwise
    'mambaout_femto': dict(feature_cls='getter'),  # NHWC otherwise
    'hiera_tiny_224': dict(img_size=224),
    'vit_small_patch16_224': dict(img_size=224, out_indices=VIT_LAYERS),  # SDPA
    'eva02_tiny_patch14_224': dict(img_size=224, out_indices=VIT_LAYERS),  # rotary, SwiGLU
}
# mmpretrain backbone -> why it is not measured
SKIPPED = {
    'LeNet5': 'an MNIST classifier: one input channel, no feature maps to return',
    'AlexNet': 'one stride-32 map and no out_indices: nothing multi-level to give',
    'InceptionV3': 'a classifier: returns its auxiliary and final logits, no feature maps',
    'TNT': 'returns its class token only (no out_indices)',
    'MixMIMTransformer': 'returns one pooled vector (no out_indices)',
    'RevVisionTransformer': "returns its last layer's map only: the reversible blocks keep "
                            'no intermediate output (no out_indices)',
    'HiViT': "mmpretrain 1.2.0's forward overwrites its running tokens with each requested map, "
             'so only the last block can be an output: one stride-16 map',
    'Conformer': 'its out_indices return [pooled CNN feature, class token] pairs, not maps',
    'MlpMixer': 'returns (N, C, tokens) sequences, not maps; mmpretrain 1.2.0 accepts only '
                'negative out_indices (its check is inverted)',
    'SparseResNet': "SparK's pretraining encoder: its sparse layers read the mask SparK's "
                    'algorithm sets per batch (`SparseHelper._cur_active`)',
    'SparseConvNeXt': "SparK's pretraining encoder: its sparse layers read the mask SparK's "
                      'algorithm sets per batch (`SparseHelper._cur_active`)',
    'CSPNet': 'the generic base the CSPDarkNet, CSPResNet and CSPResNeXt rows build (its arch '
              'is a dict of stage settings)',
    'TIMMBackbone': 'the wrapper the timm rows (`timm/...`) go through',
}
# backbone -> input size, where the default does not fit it
SIZES = {
    # its windows tile 256 exactly (maps 64..8, 8x8 windows); at 128 its last map is 4x4
    'SwinTransformerV2': 256,
    # attention biases sized for a 7x7 last map (224)
    'EfficientFormer': 224,
    # position embeddings of a fixed 224 grid
    'PyramidVig': 224,
    'Vig': 224,
    # its stem keeps full resolution (made for 32x32 images): at 64 its maps are 64..8
    'ResNet_CIFAR': 64,
    # patch 14: 112 is 8x8 patches
    'timm/eva02_tiny_patch14_224': 112,
}
EXTRA = ('left to torch (top 2)',)
# arguments that fit a backbone to UPerNet rather than pick the model: not in the arch cell
HOUSEKEEPING = ('img_size', 'out_indices', 'out_scales', 'out_type', 'gap_before_final_norm',
                'reshape_last_feat')


def timm_arguments(model: str) -> dict:
    """``TIMM``'s arguments for a timm model, or for one it does not name: ``img_size`` (sized
    to the input by ``upernet_config``) where its constructor takes one, else none."""
    if model in TIMM:
        return TIMM[model]
    import timm
    try:
        timm.create_model(model, pretrained=False, features_only=True, img_size=224)
    except TypeError:  # a constructor without img_size
        return {}
    return dict(img_size=224)


def names() -> list[str]:
    """Every backbone this sweep measures: the mmpretrain ones, then ``timm/<model>``."""
    return [*MMPRETRAIN, *(f'timm/{m}' for m in TIMM)]


def backbone_config(name: str) -> dict:
    """The backbone's model config (before ``upernet_config`` sizes its ``img_size``)."""
    if name.startswith('timm/'):
        return dict(type='mmpretrain.TIMMBackbone', model_name=name[len('timm/'):],
                    features_only=True, pretrained=False, **timm_arguments(name[len('timm/'):]))
    args = dict(MMPRETRAIN[name])
    return dict(args, type=f"mmpretrain.{args.pop('type', name)}")


def arch(name: str) -> str:
    """The row's arch cell: the arguments that pick the model."""
    if name.startswith('timm/'):
        args = TIMM.get(name[len('timm/'):], {})
    else:
        args = MMPRETRAIN[name]
    shown = {k: v for k, v in args.items() if k not in HOUSEKEEPING}
    return ', '.join(f'{k}={v}' for k, v in shown.items()) or '-'


def backbone_upernet(name: str, size: int, batch: int) -> Any:
    from mmseg_mesa.bench.backbones import upernet_config
    return upernet_config(backbone_config(name), size, batch)


def run_one(name: str, size: int, batch: int, timeout: float, calibrate: Any = None) -> dict:
    """``measure`` of UPerNet around the backbone, in a process of its own."""
    size = SIZES.get(name, size)
    row: dict = dict(backbone=name, arch=arch(name), size=size)
    return sweep.run_one(__file__, name, size, batch, timeout, row, calibrate)


def format_row(row: dict) -> str:
    left = '; '.join((row.get('left_to_torch') or [])[:2]) or '-'
    size = f" ({row['size']})" if row.get('size') else ''
    return sweep.format_row([f"{row['backbone']}{size}", f"`{row['arch']}`"], row, [left])


HEADER = sweep.header(['backbone (size)', 'arch'], EXTRA)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--backbones', nargs='+', default=None,
                        help='backbones to run (default: all; timm ones as timm/<model>, '
                             'any timm model)')
    sweep.add_sweep_arguments(parser, 'backbones')
    args = parser.parse_args(argv)
    if args.one:
        sys.exit(sweep.one(lambda: backbone_upernet(args.one, args.size, args.batch), args.size,
                           args.batch, args.json, sweep.calibration_setting(args)))
    known = names()
    # any timm model runs through the same path (``timm_arguments``), named or not
    known += [n for n in args.backbones or [] if n.startswith('timm/') and n not in known]
    unknown = sorted(set(args.backbones or []) - set(known) - set(SKIPPED))
    if unknown:
        parser.error(f'unknown backbones {unknown}; known: {" ".join(known)}')
    import mmpretrain.models.backbones as mmpretrain_backbones
    types = {MMPRETRAIN[n].get('type', n) for n in MMPRETRAIN}
    missing = sorted(set(mmpretrain_backbones.__all__) - types - set(SKIPPED))
    if missing:  # a newer mmpretrain: say so rather than leave a backbone out silently
        print(f'mmpretrain backbones neither measured nor skipped here: {missing}', flush=True)
    chosen = [n for n in (args.backbones or known) if n in known]
    skipped = [dict(backbone=n, arch='-', outcome=f'skipped: {SKIPPED[n]}')
               for n in (args.backbones or SKIPPED) if n in SKIPPED]
    rows = sweep.run_rows(chosen, skipped,
                          lambda name: run_one(name, args.size, args.batch, args.timeout,
                                               sweep.calibration_setting(args)),
                          format_row, HEADER, args.jobs)
    order = {n: i for i, n in enumerate([*known, *SKIPPED])}
    rows.sort(key=lambda r: order[r['backbone']])
    return sweep.write_results(rows, args, format_row, HEADER)

if __name__ == '__main__':
    main()
