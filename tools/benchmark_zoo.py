"""``mesa=True`` on one config of every method family in mmseg's own ``configs/``.

    python tools/benchmark_zoo.py [--size 128] [--batch 2] [--families fcn swin ...]
        [--jobs 1] [--timeout 900] [--json work_dirs/benchmarks/zoo.json] [--markdown PATH]

For each family's representative config (``CONFIGS``: the family's standard ADE20K model where
it has one, else its Cityscapes one; random weights, SyncBN reverted, as a user's first step
would build it) it runs one training step of the unconverted model and of its default Mesa
conversion on the same random batch (``--size`` square, ``--batch`` images) and prints:

- the outcome: ``ok``, or the stage that failed and its error;
- whether every loss of the converted forward is bit-identical to the unconverted one's;
- saved bytes (``count_saved_tensors``) against the baseline's, and the share of the baseline's
  that Mesa leaves uncompressed, with the modules holding most of it
  (``mmseg_mesa.bench.coverage``);
- the whole-gradient relative error, its ratio to the minibatch noise of the same batch size,
  and the worst cosine over parameters whose exact gradient is >= 1e-3 of the largest
  (``mmseg_mesa.bench.fidelity``).

Families that cannot be built here are listed with the reason (``SKIPPED``). Each config runs in
a process of its own (``--one``), so one that fails or runs out of memory ends only its row.
A slow benchmark (about 30 min on 2 cores), not a test: ``tests/test_zoo.py`` holds a few
representatives to their bounds.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import os.path as osp
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

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


def configs_root() -> str:
    import mmseg
    return osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs')


def families() -> list[str]:
    """Every method family in mmseg's configs/ (its directories but ``_base_``)."""
    root = configs_root()
    return sorted(d for d in os.listdir(root)
                  if osp.isdir(osp.join(root, d)) and not d.startswith(('_', '.')))


def same_losses(a: dict, b: dict) -> bool:
    def flat(v: Any) -> list:
        return list(v) if isinstance(v, list) else [v]
    return a.keys() == b.keys() and all(
        len(flat(a[k])) == len(flat(b[k])) and all(torch.equal(x, y) for x, y in
                                                    zip(flat(a[k]), flat(b[k]))) for k in a)


def measure(path: str, size: int, batch_size: int, result: dict) -> dict:
    """One config: the baseline and the default Mesa conversion on one batch (see the
    module docstring), filling ``result`` (its ``stage`` says how far it got)."""
    from mmseg_mesa import convert_to_mesa
    from mmseg_mesa.bench.coverage import module_types, split_saved, training_forward
    from mmseg_mesa.bench.fidelity import (
        losses_and_gradients,
        relative_error,
        split,
        worst_cosine,
    )
    from mmseg_mesa.bench.models import build_model, load_config, make_batch
    result['stage'] = 'config'
    cfg = load_config(path)
    if 'img_size' in cfg.model.get('backbone', {}):  # ViTs' position embeddings, BEiT's tables
        cfg.model.backbone.img_size = (size, size)
    result['stage'] = 'build'
    reference = build_model(cfg, 'cpu')
    data, other = split(make_batch(cfg, 2 * batch_size, (size, size), 'cpu'), batch_size)
    # copied before any step: a training forward may update state it reads (EMANet's bases)
    model = copy.deepcopy(reference)
    result['stage'] = 'baseline step'
    reference.train()
    exact_losses, exact = losses_and_gradients(reference, data)
    result['stage'] = 'conversion'
    report = convert_to_mesa(model)
    result['stage'] = 'Mesa step'
    model.train()
    losses, grads = losses_and_gradients(model, data)
    noise = relative_error(losses_and_gradients(reference, other)[1], exact)
    result.update(forward_identical=same_losses(exact_losses, losses),
                  relative_error=relative_error(grads, exact), minibatch_noise=noise,
                  worst_cosine=worst_cosine(grads, exact), converted=len(report.converted))
    result['stage'] = 'saved bytes'
    base = split_saved(reference, training_forward(reference, data))
    mesa = split_saved(model, training_forward(model, data))
    types = module_types(model)
    total = base['saved_bytes']
    left = sorted(mesa['left_by_module'].items(), key=lambda kv: -kv[1])
    result.update(saved_ratio=mesa['saved_bytes'] / total, left_share=mesa['left_bytes'] / total,
                  left_top=[dict(name=n or '(model)', type=types.get(n, '?'), share=b / total)
                            for n, b in left[:3]])
    result['stage'] = 'done'
    return result


def run_one(family: str, size: int, batch: int, timeout: float) -> dict:
    """``measure`` of the family's config in a process of its own."""
    path = osp.join(configs_root(), family, CONFIGS[family])
    size = SIZES.get(family, size)
    row: dict = dict(family=family, config=f'{family}/{CONFIGS[family]}', size=size)
    with tempfile.TemporaryDirectory() as tmp:
        out = osp.join(tmp, 'result.json')
        command = [sys.executable, osp.abspath(__file__), '--one', path, '--size', str(size),
                   '--batch', str(batch), '--json', out]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '1'))
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(row, outcome=f'timed out after {timeout:.0f} s', seconds=timeout)
        row['seconds'] = time.perf_counter() - start
        if osp.exists(out):
            with open(out) as f:
                row.update(json.load(f))
        if done.returncode != 0 and 'outcome' not in row:
            tail = (done.stderr or done.stdout).strip().splitlines()
            row['outcome'] = f"process exited {done.returncode}: {tail[-1] if tail else ''}"
    return row


def one(path: str, size: int, batch: int, json_path: str) -> int:
    """``--one``: measure a config, writing the row (with its outcome) to ``json_path``."""
    result: dict = dict(stage='start')
    code = 0
    try:
        measure(path, size, batch, result)
        result['outcome'] = 'ok'
    except Exception as error:  # the row says where and why; the sweep goes on
        stage = result.get('stage', '?')
        message = str(error).strip().splitlines()
        result = dict(outcome=f"{stage}: {type(error).__name__}: {message[0] if message else ''}"
                      [:300])
        traceback.print_exc()
        code = 1
    with open(json_path, 'w') as f:
        json.dump(result, f)
    return code


def format_row(row: dict) -> str:
    config = f"`{row['config'].split('/')[1]}`" if row['config'] else '-'
    if row.get('outcome') != 'ok':
        return f"| {row['family']} | {config} | {row.get('outcome')} | | | | | |"
    top = ', '.join(f"`{t['type']}` {t['share']:.3f}" for t in row['left_top']
                    if t['share'] >= 0.005) or '-'
    identical = 'yes' if row['forward_identical'] else '**no**'
    return (f"| {row['family']} | {config} | ok, forward identical: "
            f"{identical} | {row['saved_ratio']:.3f} | {row['left_share']:.3f} | {top} | "
            f"{row['relative_error']:.4f} ({row['relative_error'] / row['minibatch_noise']:.3f}"
            f" of noise) | {row['worst_cosine']:.4f} |")


HEADER = ('| family | config | outcome | saved / baseline | left | left by (share > 0.005) | '
          'gradient error | worst cosine |\n|---|---|---|---:|---:|---|---|---:|')


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--size', type=int, default=128)
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--families', nargs='+', default=None,
                        help='families to run (default: every one in mmseg\'s configs/)')
    parser.add_argument('--jobs', type=int, default=1, help='configs measured at once')
    parser.add_argument('--timeout', type=float, default=900, help='seconds per config')
    parser.add_argument('--json', default=None, help='write the rows as JSON here')
    parser.add_argument('--markdown', default=None, help='write the table as Markdown here')
    parser.add_argument('--one', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        sys.exit(one(args.one, args.size, args.batch, args.json))
    found = families()
    unknown = sorted(set(args.families or []) - set(found))
    if unknown:
        parser.error(f'unknown families {unknown}; mmseg has: {" ".join(found)}')
    missing = sorted(set(found) - set(CONFIGS) - set(SKIPPED))
    if missing:  # a newer mmseg: say so rather than leave a family out silently
        print(f'families without a representative config here: {missing}', flush=True)
    chosen = [f for f in (args.families or found) if f in CONFIGS]
    rows: list[dict] = [dict(family=f, config=None, outcome=f'skipped: {SKIPPED[f]}')
                        for f in (args.families or found) if f in SKIPPED]
    print(HEADER, flush=True)
    for row in rows:
        print(format_row(row), flush=True)

    def run(family: str) -> dict:
        row = run_one(family, args.size, args.batch, args.timeout)
        print(format_row(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows += list(pool.map(run, chosen))
    rows.sort(key=lambda r: r['family'])
    results = dict(size=args.size, batch=args.batch, torch=torch.__version__, rows=rows)
    if args.json:
        os.makedirs(osp.dirname(osp.abspath(args.json)), exist_ok=True)
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, 'w') as f:
            f.write('\n'.join([HEADER] + [format_row(r) for r in rows]) + '\n')
    return results


if __name__ == '__main__':
    main()
