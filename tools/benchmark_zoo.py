"""``mesa=True`` on one config of every method family in mmseg's own ``configs/``.

    python tools/benchmark_zoo.py [--size 128] [--batch 2] [--families fcn swin ...]
        [--jobs 1] [--timeout 900] [--json work_dirs/benchmarks/zoo.json] [--markdown PATH]
        [--calibrate | --no-calibrate | --calibrate-error 0.02 --calibrate-cosine 0.99]

For each family's representative config (``CONFIGS``: the family's standard ADE20K model where
it has one, else its Cityscapes one; random weights, SyncBN reverted, as a user's first step
would build it) it runs one training step of the unconverted model and of its default Mesa
conversion (``MesaConfig()``; with ``--calibrate`` or ``--calibrate-error`` /
``--calibrate-cosine``, calibrated first on another batch as a run's first iteration calibrates
with ``MesaConfig.calibrate``; ``--no-calibrate``: the rules alone) on the same random batch
(``--size`` square, ``--batch`` images) and prints:

- the outcome: ``ok``, or the stage that failed and its error;
- whether every loss of the converted forward is bit-identical to the unconverted one's;
- saved bytes (``count_saved_tensors``) against the baseline's, and the share of the baseline's
  that Mesa leaves uncompressed, with the modules holding most of it
  (``mmseg_mesa.bench.coverage``);
- the whole-gradient relative error, its ratio to the minibatch noise of the same batch size,
  and the worst cosine over parameters whose exact gradient is >= 1e-3 of the largest
  (``mmseg_mesa.bench.fidelity``).

Families that cannot be built here are listed with the reason (``SKIPPED``). Each config runs in
a process of its own (``--one``; ``mmseg_mesa.bench.sweep``), so one that fails or runs out of
memory ends only its row.
A slow benchmark (about 30 min on 2 cores), not a test: ``tests/test_zoo.py`` holds a few
representatives to their bounds.
"""
from __future__ import annotations

import argparse
import os
import os.path as osp
import sys
from typing import Any

from mmseg_mesa.bench import sweep
from mmseg_mesa.bench.sweep import configs_root

# family -> its representative config in mmseg's configs/
CONFIGS = {
    'ann': 'ann_r50-d8_4xb4-80k_ade20k-512x512.py',
    'apcnet': 'apcnet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'beit': 'beit-base_upernet_8xb2-160k_ade20k-640x640.py',
    'bisenetv1': 'bisenetv1_r18-d32_4xb4-160k_cityscapes-1024x1024.py',
    'bisenetv2': 'bisenetv2_fcn_4xb4-160k_cityscapes-1024x1024.py',
    'ccnet': 'ccnet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'cgnet': 'cgnet_fcn_4xb4-60k_cityscapes-680x680.py',
    'convnext': 'convnext-tiny_upernet_8xb2-amp-160k_ade20k-512x512.py',
    'danet': 'danet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'ddrnet': 'ddrnet_23-slim_in1k-pre_2xb6-120k_cityscapes-1024x1024.py',
    'deeplabv3': 'deeplabv3_r50-d8_4xb4-80k_ade20k-512x512.py',
    'deeplabv3plus': 'deeplabv3plus_r50-d8_4xb4-80k_ade20k-512x512.py',
    'dmnet': 'dmnet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'dnlnet': 'dnl_r50-d8_4xb4-80k_ade20k-512x512.py',
    'dpt': 'dpt_vit-b16_8xb2-160k_ade20k-512x512.py',
    'emanet': 'emanet_r50-d8_4xb2-80k_cityscapes-512x1024.py',
    'encnet': 'encnet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'erfnet': 'erfnet_fcn_4xb4-160k_cityscapes-512x1024.py',
    'fastfcn': 'fastfcn_r50-d32_jpu_psp_4xb4-80k_ade20k-512x512.py',
    'fastscnn': 'fast_scnn_8xb4-160k_cityscapes-512x1024.py',
    'fcn': 'fcn_r50-d8_4xb4-80k_ade20k-512x512.py',
    'gcnet': 'gcnet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'hrnet': 'fcn_hr18s_4xb4-80k_ade20k-512x512.py',
    'icnet': 'icnet_r18-d8_4xb2-80k_cityscapes-832x832.py',
    'isanet': 'isanet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'knet': 'knet-s3_swin-t_upernet_8xb2-adamw-80k_ade20k-512x512.py',
    'mae': 'mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py',
    'mask2former': 'mask2former_swin-t_8xb2-160k_ade20k-512x512.py',
    'maskformer': 'maskformer_r50-d32_8xb2-160k_ade20k-512x512.py',
    'mobilenet_v2': 'mobilenet-v2-d8_deeplabv3plus_4xb4-160k_ade20k-512x512.py',
    'mobilenet_v3': 'mobilenet-v3-d8_lraspp_4xb4-320k_cityscapes-512x1024.py',
    'nonlocal_net': 'nonlocal_r50-d8_4xb4-80k_ade20k-512x512.py',
    'ocrnet': 'ocrnet_hr18s_4xb4-80k_ade20k-512x512.py',
    'pidnet': 'pidnet-s_2xb6-120k_1024x1024-cityscapes.py',
    'point_rend': 'pointrend_r50_4xb4-160k_ade20k-512x512.py',
    'poolformer': 'fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py',
    'psanet': 'psanet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'pspnet': 'pspnet_r50-d8_4xb4-80k_ade20k-512x512.py',
    'resnest': 'resnest_s101-d8_fcn_4xb4-160k_ade20k-512x512.py',
    'segformer': 'segformer_mit-b0_8xb2-160k_ade20k-512x512.py',
    'segmenter': 'segmenter_vit-s_mask_8xb1-160k_ade20k-512x512.py',
    'segnext': 'segnext_mscan-t_1xb16-adamw-160k_ade20k-512x512.py',
    'sem_fpn': 'fpn_r50_4xb4-160k_ade20k-512x512.py',
    'setr': 'setr_vit-l_naive_8xb2-160k_ade20k-512x512.py',
    'stdc': 'stdc1_4xb12-80k_cityscapes-512x1024.py',
    'swin': 'swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    'twins': 'twins_svt-s_uperhead_8xb2-160k_ade20k-512x512.py',
    'unet': 'unet-s5-d16_fcn_4xb4-160k_cityscapes-512x1024.py',
    'upernet': 'upernet_r50_4xb4-80k_ade20k-512x512.py',
    'vit': 'vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py',
}
# family -> why it is not measured
SKIPPED = {
    'dsdl': "dataset settings in the DSDL format around deeplabv3's model (measured as "
            "deeplabv3); they read a DSDL dataset to build",
    'san': "builds only from its CLIP weights: its head's init_cfg loads them, and without "
           "them mmseg 1.2.2's `RecWithAttnbias.init_weights` fails",
    'vpd': "builds Stable Diffusion through the `ldm` package and loads its weights",
}
# family -> input size, where the default would not test what the family does (MobileNetV3's
# LR-ASPP pools with a 49x49 window: at 128x128 its input is smaller than the window)
SIZES = {'mobilenet_v3': 512}


def families() -> list[str]:
    """Every method family in mmseg's configs/ (its directories but ``_base_``)."""
    root = configs_root()
    return sorted(d for d in os.listdir(root)
                  if osp.isdir(osp.join(root, d)) and not d.startswith(('_', '.')))


def zoo_config(path: str, size: int) -> Any:
    """The config as the sweep builds it: no downloads, ViTs' and BEiT's position tables at
    ``size``."""
    from mmseg_mesa.bench.models import load_config
    cfg = load_config(path)
    if 'img_size' in cfg.model.get('backbone', {}):  # ViTs' position embeddings, BEiT's tables
        cfg.model.backbone.img_size = (size, size)
    return cfg


def run_one(family: str, size: int, batch: int, timeout: float, calibrate: Any = None
            ) -> dict:
    """``measure`` of the family's config in a process of its own."""
    path = osp.join(configs_root(), family, CONFIGS[family])
    size = SIZES.get(family, size)
    row: dict = dict(family=family, config=f'{family}/{CONFIGS[family]}', size=size)
    return sweep.run_one(__file__, path, size, batch, timeout, row, calibrate)


def format_row(row: dict) -> str:
    config = f"`{row['config'].split('/')[1]}`" if row['config'] else '-'
    return sweep.format_row([row['family'], config], row)


HEADER = sweep.header(['family', 'config'])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--families', nargs='+', default=None,
                        help='families to run (default: every one in mmseg\'s configs/)')
    sweep.add_sweep_arguments(parser, 'configs')
    args = parser.parse_args(argv)
    if args.one:
        sys.exit(sweep.one(lambda: zoo_config(args.one, args.size), args.size, args.batch,
                           args.json, sweep.calibration_setting(args)))
    found = families()
    unknown = sorted(set(args.families or []) - set(found))
    if unknown:
        parser.error(f'unknown families {unknown}; mmseg has: {" ".join(found)}')
    missing = sorted(set(found) - set(CONFIGS) - set(SKIPPED))
    if missing:  # a newer mmseg: say so rather than leave a family out silently
        print(f'families without a representative config here: {missing}', flush=True)
    chosen = [f for f in (args.families or found) if f in CONFIGS]
    skipped = [dict(family=f, config=None, outcome=f'skipped: {SKIPPED[f]}')
               for f in (args.families or found) if f in SKIPPED]
    rows = sweep.run_rows(chosen, skipped,
                          lambda family: run_one(family, args.size, args.batch, args.timeout,
                                                 sweep.calibration_setting(args)),
                          format_row, HEADER, args.jobs)
    rows.sort(key=lambda r: r['family'])
    return sweep.write_results(rows, args, format_row, HEADER)

if __name__ == '__main__':
    main()
