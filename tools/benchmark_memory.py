"""Activation memory and step time of one mmseg config with and without Mesa, side by side.

    python tools/benchmark_memory.py [CONFIG] [--modes baseline mesa ...] [--batch 2]
        [--size 512 512] [--device cpu|cuda] [--iters N] [--json PATH] [--plot PATH]
        [--max-batch BUDGET_GB]

Every mode runs on the same inputs in this one process. For each: bytes saved for backward in a
training step (deduplicated storages, parameters excluded; works on CPU), peak allocated memory
(CUDA only), the median time of a forward+backward step, ratios to ``baseline``, and the saved
bytes by the type of module that saved them. Modes: ``baseline``, ``mesa`` (the config's ``mesa``
setting: the default preset unless it says otherwise), ``mesa:PRESET`` for every other preset of
``mmseg_mesa.config.PRESETS`` (``mesa:mesa``, the paper's; ``mesa:max-saving``), ``amp``
(autocast: fp16 on CUDA, bf16 on CPU), ``mesa+amp``, ``checkpoint`` (activation checkpointing of
each backbone stage, as mmengine's ``activation_checkpointing`` does), ``mesa+checkpoint``.
Any Mesa mode combines with ``+amp`` and ``+checkpoint`` (``mesa:max-saving+amp``).
``--cfg-options`` changes the config as in ``tools/train.py``; ``mesa.*`` keys change what the
``mesa`` mode measures (e.g. ``--cfg-options "mesa.division=[conv2d,batchnorm]"``).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import os.path as osp
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEFAULT_CONFIG = osp.join(
    ROOT, 'configs/swin/mesa_swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py')


@dataclass(frozen=True)
class Mode:
    """What a mode name asks for: a Mesa config (None: none, '': the config's), AMP, checkpoints."""

    preset: str | None
    amp: bool
    checkpoint: bool


def parse_mode(value: str) -> Mode:
    """``baseline``, or ``mesa[:PRESET]`` / ``amp`` / ``checkpoint`` with ``+amp`` /
    ``+checkpoint``; anything else is an error that lists the presets."""
    from mmseg_mesa.config import PRESETS
    head, *options = value.split('+')
    name, sep, preset = head.partition(':')
    if name == 'mesa':
        valid, mesa = not sep or preset in PRESETS, preset
    else:
        valid, mesa = not sep and (head in ('amp', 'checkpoint') or value == 'baseline'), None
        options = [head, *options] if head != 'baseline' else options
    flags = set(options)
    if not (valid and flags <= {'amp', 'checkpoint'} and len(flags) == len(options)):
        raise argparse.ArgumentTypeError(
            f'invalid mode {value!r}: use baseline, amp, checkpoint or mesa[:PRESET] with '
            f'optional +amp / +checkpoint; presets: {", ".join(PRESETS)}')
    return Mode(mesa, 'amp' in flags, 'checkpoint' in flags)


def mode_name(value: str) -> str:
    """argparse's check of --modes: the name itself, once ``parse_mode`` accepts it."""
    parse_mode(value)
    return value


def default_modes() -> list[str]:
    """Baseline, the config's Mesa setting, every other preset, AMP and checkpointing."""
    from mmseg_mesa.config import PRESETS
    presets = [f'mesa:{name}' for name in PRESETS if name != 'default']
    return ['baseline', 'mesa', *presets, 'amp', 'mesa+amp', 'checkpoint', 'mesa+checkpoint']


def add_cfg_options(parser: argparse.ArgumentParser) -> None:
    from mmengine.config import DictAction
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help="override config settings, e.g. mesa.bits=4 (the `mesa` mode's "
                             "config) or mesa.division=[conv2d,batchnorm]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', nargs='?', default=DEFAULT_CONFIG)
    modes = default_modes()
    parser.add_argument('--modes', nargs='+', default=modes, type=mode_name,
                        help=f'default: {" ".join(modes)}')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help="input size; defaults to the config's crop_size")
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--iters', type=int, default=None,
                        help='timed steps per mode (default: 1 on CPU, 5 on CUDA)')
    parser.add_argument('--json', help='write the results as JSON here')
    parser.add_argument('--plot', help='write a PNG bar chart here')
    parser.add_argument('--max-batch', type=float, default=None, metavar='BUDGET_GB',
                        help='CUDA only: the largest power-of-two batch per mode within budget')
    add_cfg_options(parser)
    args = parser.parse_args(argv)
    if args.max_batch is not None and args.device != 'cuda':
        parser.error('--max-batch measures peak CUDA memory: it needs --device cuda')
    return args


def load_config(path: str, options: dict | None = None) -> Any:
    """The config with ``--cfg-options`` merged, ready to build without downloads."""
    from mmengine.config import Config
    cfg = Config.fromfile(path)
    if options:
        cfg.merge_from_dict(options)
    cfg.model.pretrained = None  # no downloads: memory does not depend on the weights
    if cfg.model.get('backbone', {}).get('init_cfg') is not None:
        cfg.model.backbone.init_cfg = None
    return cfg


def build_model(cfg: Any, device: str) -> torch.nn.Module:
    import logging

    from mmengine.logging import MMLogger
    from mmengine.model import revert_sync_batchnorm
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    torch.manual_seed(0)
    model = revert_sync_batchnorm(MODELS.build(cfg.model))
    MMLogger.get_current_instance().setLevel(logging.WARNING)  # init_weights lists every tensor
    model.init_weights()
    return model.to(device).train()


def make_batch(cfg: Any, batch: int, size: tuple[int, int], device: str) -> tuple:
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    num_classes = cfg.model.decode_head.num_classes
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, 3, *size, generator=gen).to(device)
    samples = []
    for _ in range(batch):
        sample = SegDataSample()
        labels = torch.randint(0, num_classes, (1, *size), generator=gen)
        sample.gt_sem_seg = PixelData(data=labels.to(device))
        sample.set_metainfo(dict(img_shape=size, pad_shape=size, ori_shape=size))
        samples.append(sample)
    return inputs, samples


def checkpoint_backbone_stages(model: torch.nn.Module) -> list[str]:
    """Turn on mmengine's activation checkpointing for each block of the backbone's stage list."""
    from mmengine.runner.activation_checkpointing import turn_on_activation_checkpointing
    for name, child in model.backbone.named_children():
        if isinstance(child, torch.nn.ModuleList):
            names = [f'backbone.{name}.{i}' for i in range(len(child))]
            turn_on_activation_checkpointing(model, names)
            return names
    raise ValueError(f'{type(model.backbone).__name__} has no ModuleList of stages to checkpoint')


def prepare(base: torch.nn.Module, mode: str, mesa_config: Any) -> torch.nn.Module:
    from mmseg_mesa import MesaConfig, convert_to_mesa
    model = copy.deepcopy(base)
    parsed = parse_mode(mode)
    if parsed.preset is not None:
        config = MesaConfig.preset(parsed.preset) if parsed.preset else mesa_config
        convert_to_mesa(model, config=config)
    if parsed.checkpoint:
        checkpoint_backbone_stages(model)
    return model


def loss_of(losses: dict) -> torch.Tensor:
    return sum(v for k, v in losses.items() if 'loss' in k)


def run_step(model: torch.nn.Module, batch: tuple, mode: str, device: str) -> None:
    amp_dtype = torch.float16 if device == 'cuda' else torch.bfloat16
    with torch.autocast(device, dtype=amp_dtype, enabled=parse_mode(mode).amp):
        losses = model(*batch, mode='loss')
    loss_of(losses).backward()
    model.zero_grad(set_to_none=True)


def synchronize(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def measure(model: torch.nn.Module, batch: tuple, mode: str, device: str, iters: int) -> dict:
    from mmseg_mesa.memory import count_saved_tensors
    amp_dtype = torch.float16 if device == 'cuda' else torch.bfloat16
    with count_saved_tensors(model) as saved:
        with torch.autocast(device, dtype=amp_dtype, enabled=parse_mode(mode).amp):
            losses = model(*batch, mode='loss')
    loss_of(losses).backward()
    model.zero_grad(set_to_none=True)
    del losses
    peak = None
    times = []
    for _ in range(iters):
        if device == 'cuda':
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        synchronize(device)
        start = time.perf_counter()
        run_step(model, batch, mode, device)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if device == 'cuda':
            peak = max(peak or 0, torch.cuda.max_memory_allocated())
    return dict(saved_bytes=saved.total_bytes, peak_bytes=peak,
                step_time_s=statistics.median(times), by_type=dict(saved.by_type))


def max_batch(base: torch.nn.Module, cfg: Any, mode: str, mesa_config: Any,
              size: tuple[int, int], budget_gb: float) -> int:
    model = prepare(base, mode, mesa_config)
    best, batch = 0, 1
    while batch <= 1024:
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            run_step(model, make_batch(cfg, batch, size, 'cuda'), mode, 'cuda')
            if torch.cuda.max_memory_allocated() > budget_gb * 2 ** 30:
                break
            best, batch = batch, batch * 2
        except torch.OutOfMemoryError:
            break
    del model
    torch.cuda.empty_cache()
    return best


def add_ratios(results: dict) -> None:
    base = results['modes'].get('baseline')
    if not base:
        return
    for entry in results['modes'].values():
        entry['saved_ratio'] = entry['saved_bytes'] / base['saved_bytes']
        entry['time_ratio'] = entry['step_time_s'] / base['step_time_s']
        entry['peak_ratio'] = (entry['peak_bytes'] / base['peak_bytes']
                               if entry['peak_bytes'] and base['peak_bytes'] else None)


def format_table(results: dict) -> str:
    mb = 2 ** 20
    lines = [f"{results['config']}  device={results['device']}  batch={results['batch']}  "
             f"size={results['size']}",
             f"{'mode':<17}{'saved MB':>10}{'ratio':>8}{'peak MB':>10}{'ratio':>8}"
             f"{'step s':>9}{'ratio':>8}"]
    for mode, r in results['modes'].items():
        peak = f"{r['peak_bytes'] / mb:10.0f}" if r['peak_bytes'] else f"{'-':>10}"
        peak_ratio = f"{r['peak_ratio']:8.3f}" if r.get('peak_ratio') else f"{'-':>8}"
        lines.append(f"{mode:<17}{r['saved_bytes'] / mb:10.1f}{r.get('saved_ratio', 1):8.3f}"
                     f"{peak}{peak_ratio}{r['step_time_s']:9.3f}{r.get('time_ratio', 1):8.3f}")
    types = sorted({t for r in results['modes'].values() for t in r['by_type']},
                   key=lambda t: -results['modes'].get('baseline', next(
                       iter(results['modes'].values())))['by_type'].get(t, 0))
    lines.append('\nSaved MB by module type (Mesa modules under the type they replaced):')
    lines.append(f"{'type':<22}" + ''.join(f'{m:>17}' for m in results['modes']))
    for t in types:
        lines.append(f'{t:<22}' + ''.join(f"{r['by_type'].get(t, 0) / mb:17.1f}"
                                           for r in results['modes'].values()))
    if 'max_batch' in results:
        lines.append(f"\nLargest batch within {results['max_batch_budget_gb']} GB: " +
                     ', '.join(f'{m}={b}' for m, b in results['max_batch'].items()))
    return '\n'.join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    modes = list(results['modes'])
    mb = 2 ** 20
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    saved = [results['modes'][m]['saved_bytes'] / mb for m in modes]
    colours = ['#888' if parse_mode(m).preset is None else '#2a7' for m in modes]
    left.bar(modes, saved, color=colours)
    left.set_ylabel('saved for backward (MB)')
    left.set_title('Activation memory per mode')
    left.tick_params(axis='x', rotation=30)
    totals: dict[str, float] = {}
    for m in modes:
        for t, v in results['modes'][m]['by_type'].items():
            totals[t] = max(totals.get(t, 0), v)
    # the types that matter (>= 1% of the largest), largest first; the rest as "other"
    types = [t for t in sorted(totals, key=totals.get, reverse=True)
             if totals[t] >= 0.01 * max(totals.values())]
    colours = plt.cm.tab20.colors
    bottom = [0.0] * len(modes)
    for i, t in enumerate(types + ['other']):
        if t == 'other':
            values = [sum(v for k, v in results['modes'][m]['by_type'].items()
                          if k not in types) / mb for m in modes]
        else:
            values = [results['modes'][m]['by_type'].get(t, 0) / mb for m in modes]
        # matplotlib hides labels that start with '_' (mmengine's _BatchNormXd)
        right.bar(modes, values, bottom=bottom, label=t.lstrip('_'),
                  color=colours[i % len(colours)])
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_title('By module type')
    right.tick_params(axis='x', rotation=30)
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{osp.basename(results['config'])}, batch {results['batch']}, "
                 f"{results['size'][0]}x{results['size'][1]}, {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
    from mmseg_mesa import MesaConfig
    cfg = load_config(args.config, args.cfg_options)
    mesa_config = MesaConfig.from_cfg(cfg.get('mesa', True)) or MesaConfig()
    size = tuple(args.size) if args.size else tuple(cfg.get('crop_size', (512, 512)))
    iters = args.iters or (5 if args.device == 'cuda' else 1)
    base = build_model(cfg, args.device)
    batch = make_batch(cfg, args.batch, size, args.device)
    results: dict = dict(config=osp.relpath(args.config, ROOT), device=args.device,
                         batch=args.batch, size=list(size), iters=iters,
                         mesa=str(mesa_config), modes={})
    for mode in args.modes:
        print(f'measuring {mode} ...', flush=True)
        model = prepare(base, mode, mesa_config)
        results['modes'][mode] = measure(model, batch, mode, args.device, iters)
        del model
    add_ratios(results)
    if args.max_batch is not None:
        results['max_batch_budget_gb'] = args.max_batch
        results['max_batch'] = {mode: max_batch(base, cfg, mode, mesa_config, size,
                                                args.max_batch) for mode in args.modes}
    print(format_table(results))
    if args.json:
        os.makedirs(osp.dirname(osp.abspath(args.json)), exist_ok=True)
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=2)
    if args.plot:
        os.makedirs(osp.dirname(osp.abspath(args.plot)), exist_ok=True)
        plot(results, args.plot)
    return results


if __name__ == '__main__':
    main()
