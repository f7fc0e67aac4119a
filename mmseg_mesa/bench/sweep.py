"""One training step of a segmentor and of its default Mesa conversion, one model per process.

``tools/benchmark_zoo.py`` (one config per mmseg family) and ``tools/benchmark_backbones.py``
(UPerNet around backbones mmseg's configs never name) sweep models through ``run_one``: it
starts the tool again with ``--one KEY``, whose ``one`` builds that model's config and fills a
row with ``measure``; a model that fails or runs out of memory ends only its own row.

``measure`` compares, on the same random batch: whether every loss of the converted forward is
bit-identical to the unconverted one's; saved bytes against the baseline's and the share Mesa
leaves uncompressed, with the modules holding most of it (``coverage``); the whole-gradient
relative error, the minibatch noise of the same batch size and the worst cosine (``fidelity``);
the calls the conversion's generic path left to torch in that step; and what a GPU step of each
would launch and wait for (``dispatch``): kernel ops, and host syncs Mesa adds.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import os.path as osp
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

COLUMNS = ('outcome', 'saved / baseline', 'left', 'left by (share > 0.005)', 'gradient error',
           'worst cosine', 'kernel ops', 'syncs added')
ALIGN = ('---', '---:', '---:', '---', '---', '---:', '---:', '---')


def configs_root() -> str:
    """mmseg's ``configs/`` as installed (its ``.mim`` copy)."""
    import mmseg
    return osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs')


def same_losses(a: dict, b: dict) -> bool:
    """Whether two mmseg loss dicts hold bit-identical values under the same keys."""
    def flat(v: Any) -> list:
        return list(v) if isinstance(v, list) else [v]
    return a.keys() == b.keys() and all(
        len(flat(a[k])) == len(flat(b[k])) and all(torch.equal(x, y) for x, y in
                                                    zip(flat(a[k]), flat(b[k]))) for k in a)


def measure(cfg: Any, size: int, batch_size: int, result: dict, calibrated: Any = None
            ) -> dict:
    """The baseline and the default Mesa conversion of ``cfg``'s model on one batch of
    ``batch_size`` random ``size`` x ``size`` images, filling ``result`` (its ``stage`` says how
    far it got, so a failure names the step that raised); ``calibrated``: the
    ``MesaConfig.calibrate`` setting (None: the default, calibrated first as a run is; True or
    a dict of bounds; False: the rules alone)."""
    from mmseg_mesa import MesaConfig, convert_to_mesa
    from mmseg_mesa.bench.calibration import report_row
    from mmseg_mesa.bench.coverage import module_types, split_saved, training_forward
    from mmseg_mesa.bench.fidelity import (
        losses_and_gradients,
        relative_error,
        split,
        worst_cosine,
    )
    from mmseg_mesa.bench.models import build_model, loss_of, make_batch
    from mmseg_mesa.calibration import calibrate
    result['stage'] = 'build'
    reference = build_model(cfg, 'cpu')
    data, other = split(make_batch(cfg, 2 * batch_size, (size, size), 'cpu'), batch_size)
    # copied before any step: a training forward may update state it reads (EMANet's bases)
    model = copy.deepcopy(reference)
    result['stage'] = 'baseline step'
    reference.train()
    exact_losses, exact = losses_and_gradients(reference, data)
    result['stage'] = 'conversion'
    config = MesaConfig() if calibrated is None else MesaConfig(calibrate=calibrated)
    report = convert_to_mesa(model, config=config)
    model.train()
    if config.calibrate is not None:
        # on images of the other batch, as a run calibrates on its first (``MesaHook``)
        result['stage'] = 'calibration'
        one = (other[0][:config.calibrate.batch], other[1][:config.calibrate.batch])
        calibrated = calibrate(model, lambda: loss_of(model(*one, mode='loss')),
                               config.calibrate)
        result['calibration'] = report_row(calibrated)
    counted = report.left_to_torch()
    result['stage'] = 'Mesa step'
    losses, grads = losses_and_gradients(model, data)
    # read now: the counts accumulate over training forwards
    left_to_torch = sorted((report.left_to_torch() - counted).items(),
                           key=lambda kv: (-kv[1], kv[0]))
    noise = relative_error(losses_and_gradients(reference, other)[1], exact)
    result.update(forward_identical=same_losses(exact_losses, losses),
                  relative_error=relative_error(grads, exact), minibatch_noise=noise,
                  worst_cosine=worst_cosine(grads, exact), converted=len(report.converted),
                  left_to_torch=[f'{n} x {typ}: {reason}' for (typ, reason), n in left_to_torch])
    result['stage'] = 'saved bytes'
    base = split_saved(reference, training_forward(reference, data))
    mesa = split_saved(model, training_forward(model, data))
    types = module_types(model)
    total = base['saved_bytes']
    left = sorted(mesa['left_by_module'].items(), key=lambda kv: -kv[1])
    result.update(saved_ratio=mesa['saved_bytes'] / total, left_share=mesa['left_bytes'] / total,
                  left_top=[dict(name=n or '(model)', type=types.get(n, '?'), share=b / total)
                            for n, b in left[:3]])
    result['stage'] = 'dispatch counts'
    result.update(dispatch_row(reference, model, data))
    result['stage'] = 'done'
    return result


def dispatch_row(reference: torch.nn.Module, model: torch.nn.Module, data: tuple) -> dict:
    """What a GPU step of each would launch and wait for (``dispatch.step_counts``): Mesa's
    kernel ops over the baseline's, the syncs Mesa adds by op name, and Mesa's own sync sites.
    Both models have taken a training step (first calls read their own values)."""
    from mmseg_mesa.bench.dispatch import compared, step_counts
    return compared(step_counts(model, data, warmup=False),
                    step_counts(reference, data, warmup=False))


def one(make_config: Callable[[], Any], size: int, batch: int, json_path: str,
        calibrate: Any = None) -> int:
    """A tool's ``--one``: build the config and ``measure`` it, writing the row (with its
    ``outcome``: ``ok`` or the stage that failed and its error) to ``json_path``; the exit
    status is 1 on failure."""
    result: dict = dict(stage='config')
    code = 0
    try:
        measure(make_config(), size, batch, result, calibrate)
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


def run_one(script: str, key: str, size: int, batch: int, timeout: float, row: dict,
            calibrate: Any = None) -> dict:
    """``python SCRIPT --one KEY`` in a process of its own (one thread unless
    ``OMP_NUM_THREADS`` says otherwise): ``row`` with the measured fields and ``seconds``, or
    with an ``outcome`` saying how the process ended."""
    with tempfile.TemporaryDirectory() as tmp:
        out = osp.join(tmp, 'result.json')
        # faulthandler: a process that crashes in native code still names the Python frame
        command = [sys.executable, '-X', 'faulthandler', osp.abspath(script), '--one', key,
                   '--size', str(size), '--batch', str(batch), '--json', out,
                   *calibration_flags(calibrate)]
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
            row['outcome'] = ended(done.returncode, done.stderr or done.stdout)
    return row


def ended(code: int, output: str) -> str:
    """How a ``--one`` process that wrote no row ended: the signal that killed it and the
    innermost Python frame faulthandler printed, else its exit status and last line."""
    lines = output.strip().splitlines()
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f'signal {-code}'
        current = next((i for i, line in enumerate(lines)
                        if line.startswith('Current thread')), 0)
        frames = [line.strip() for line in lines[current:] if line.strip().startswith('File "')]
        where = frames[0].split('"') if frames else []
        return f'process killed by {name}' + (  # 'File "PATH", line N in FUNCTION'
            f' in {osp.basename(where[1])}{where[2]}' if len(where) == 3 else '')
    return f"process exited {code}: {lines[-1] if lines else ''}"


def header(labels: Sequence[str], extra: Sequence[str] = ()) -> str:
    """The Markdown header: ``labels`` (the row's name cells), ``COLUMNS``, then ``extra``."""
    names = [*labels, *COLUMNS, *extra]
    align = ['---'] * len(labels) + list(ALIGN) + ['---'] * len(extra)
    return f"| {' | '.join(names)} |\n|{'|'.join(align)}|"


def format_row(labels: Sequence[str], row: dict, extra: Sequence[str] = ()) -> str:
    """One Markdown row: the ``labels`` cells, the measured ``COLUMNS`` (only the outcome where
    it is not ``ok``), then the ``extra`` cells."""
    if row.get('outcome') != 'ok':
        return (f"| {' | '.join(labels)} | {row.get('outcome')} |"
                + ' |' * (len(COLUMNS) - 1 + len(extra)))
    top = ', '.join(f"`{t['type']}` {t['share']:.3f}" for t in row['left_top']
                    if t['share'] >= 0.005) or '-'
    identical = 'yes' if row['forward_identical'] else '**no**'
    cells = [f'ok, forward identical: {identical}', f"{row['saved_ratio']:.3f}",
             f"{row['left_share']:.3f}", top,
             f"{row['relative_error']:.4f} ({row['relative_error'] / row['minibatch_noise']:.3f}"
             ' of noise)', f"{row['worst_cosine']:.4f}", f"{row['kernel_ratio']:.2f}x",
             ', '.join(f'{n} x `{name}`' for name, n in row['added_syncs'].items()) or '0',
             *extra]
    return f"| {' | '.join(labels)} | {' | '.join(cells)} |"


def add_sweep_arguments(parser: argparse.ArgumentParser, things: str) -> None:
    """The options both sweep tools take besides the list of what they run (``things``: what
    one row measures, for the help)."""
    parser.add_argument('--size', type=int, default=128)
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--jobs', type=int, default=1, help=f'{things} measured at once')
    parser.add_argument('--timeout', type=float, default=900, help=f'seconds per {things[:-1]}')
    parser.add_argument('--json', default=None, help='write the rows as JSON here')
    parser.add_argument('--markdown', default=None, help='write the table as Markdown here')
    parser.add_argument('--calibrate', action='store_true',
                        help='calibrate each model first with the default bounds, as '
                             'mesa=dict(calibrate=True) does')
    parser.add_argument('--no-calibrate', action='store_true',
                        help='the rules alone, as mesa=dict(calibrate=False)')
    parser.add_argument('--calibrate-error', type=float, default=None,
                        help='calibrate with this whole-gradient error bound')
    parser.add_argument('--calibrate-cosine', type=float, default=None,
                        help='calibrate with this worst-cosine bound')
    parser.add_argument('--one', default=None, help=argparse.SUPPRESS)


def calibration_setting(args: argparse.Namespace) -> Any:
    """The ``MesaConfig.calibrate`` setting the sweep options ask for: None (``MesaConfig``'s
    default), False (the rules alone), True (the default bounds) or a dict of the bounds
    given."""
    if args.no_calibrate:
        return False
    bounds = {k: v for k, v in (('error', args.calibrate_error),
                                ('cosine', args.calibrate_cosine)) if v is not None}
    return bounds or (True if args.calibrate else None)


def calibration_flags(setting: Any) -> list[str]:
    """The options that give a ``--one`` process ``setting`` (``calibration_setting``'s)."""
    if setting is None:
        return []
    if isinstance(setting, bool):
        return ['--calibrate' if setting else '--no-calibrate']
    return [flag for key, value in setting.items()
            for flag in (f'--calibrate-{key}', repr(value))]


def run_rows(chosen: Sequence[str], skipped: list[dict], measure_one: Callable[[str], dict],
             format_row: Callable[[dict], str], header: str, jobs: int) -> list[dict]:
    """Print ``header`` and the ``skipped`` rows, then measure ``chosen`` (``jobs`` at once),
    printing each row as it ends; the skipped rows and the measured ones, in that order."""
    print(header, flush=True)
    for row in skipped:
        print(format_row(row), flush=True)

    def run(key: str) -> dict:
        row = measure_one(key)
        print(format_row(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return skipped + list(pool.map(run, chosen))


def write_results(rows: list[dict], args: argparse.Namespace, format_row: Callable[[dict], str],
                  header: str) -> dict:
    """The rows with the sweep's settings, written as JSON (``--json``) and as the Markdown table
    (``--markdown``) where asked."""
    results = dict(size=args.size, batch=args.batch, torch=torch.__version__, rows=rows)
    for path, text in ((args.json, lambda: json.dumps(results, indent=1)),
                       (args.markdown, lambda: '\n'.join([header, *map(format_row, rows)]) + '\n')):
        if path:
            os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
            with open(path, 'w') as f:
                f.write(text())
    return results
