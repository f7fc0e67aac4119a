"""Reading what the steps' tools wrote: JSON answers, JUnit XML, benchmark and training results,
and the summary printed at the end."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path


def parse_last_json(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (how the helper modes answer)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith('{'):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def junit_counts(path: Path) -> dict[str, int] | None:
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == 'testsuite' else root.findall('testsuite')
    return {key: sum(int(s.get(key, 0)) for s in suites)
            for key in ('tests', 'failures', 'errors', 'skipped')}


def junit_case_counts(path: Path, name: str) -> dict[str, int] | None:
    """Outcomes of the test cases called ``name`` (every parametrization) in a JUnit file."""
    if not path.exists():
        return None
    counts = dict(passed=0, failed=0, skipped=0)
    for case in ET.parse(path).getroot().iter('testcase'):
        if case.get('name', '').split('[')[0] != name:
            continue
        if case.find('skipped') is not None:
            counts['skipped'] += 1
        elif case.find('failure') is not None or case.find('error') is not None:
            counts['failed'] += 1
        else:
            counts['passed'] += 1
    return counts


def merge_junit(paths: list[Path], target: Path) -> None:
    """One tests.xml from every pytest run (one file, however many runs)."""
    root = ET.Element('testsuites')
    for path in paths:
        tree = ET.parse(path).getroot()
        for suite in [tree] if tree.tag == 'testsuite' else tree.findall('testsuite'):
            suite.set('name', path.stem)
            root.append(suite)
    ET.ElementTree(root).write(target, encoding='utf-8', xml_declaration=True)


def kernel_figures(path: Path) -> dict | None:
    if not path.exists():
        return None
    rows = json.loads(path.read_text()).get('kernels', [])
    if not rows:
        return None
    return dict(min_of_copy=min(r['of_copy'] for r in rows),
                of_copy={f'{r["case"]} {r["dtype"]} {r["op"]}': round(r['of_copy'], 3)
                         for r in rows},
                copy_gb_per_s=rows[0].get('copy_gb_per_s'))


def sync_figures(path: Path) -> dict | None:
    """``benchmark_speed.py --count``'s figures for Mesa against the baseline: kernel ops per
    forward + backward, the syncing ops Mesa adds and where, CUDA's own reports of synchronizing
    calls per mode (a GPU only) and the step time ratio."""
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    counts = results.get('counts', {})
    if 'mesa' not in counts or 'baseline' not in counts:
        return None
    mesa = counts['mesa']
    return dict(kernel_ratio=round(mesa['kernel_ratio'], 3),
                added_syncs=sum(mesa['added_syncs'].values()), added=mesa['added_syncs'],
                mesa_sync_sites=mesa['mesa_sync_sites'],
                cuda_sync_warnings={mode: len(c['cuda_sync_warnings']) for mode, c in
                                    counts.items() if c.get('cuda_sync_warnings') is not None},
                step_time_ratio=results['modes']['mesa']['ratio'])


def compile_figures(path: Path) -> dict | None:
    """``benchmark_compile.py``'s figures: per mode the first step's time and step time (and
    their ratio to the eager baseline), recompiles after the first compiled step, graph breaks
    in ``mmseg_mesa``, the compiled Mesa step's gradient error against eager Mesa's."""
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    modes = result['modes']
    base = modes['baseline']['step_s']
    return dict(
        step_s={mode: m['step_s'] for mode, m in modes.items()},
        first_step_s={mode: m['first_step_s'] for mode, m in modes.items()
                      if 'first_step_s' in m},
        mesa_compiled_ratio=modes['mesa compiled']['step_s'] / base,
        recompiles_after_first=sum(m.get('recompiles_after_first', 0) for m in modes.values()),
        breaks_in_mmseg_mesa=result.get('breaks', {}).get('breaks_in_mmseg_mesa', []),
        gradients=result['gradients'])


def memory_figures(results: dict) -> dict:
    """The default preset against the baseline, in fp32 and AMP (against AMP alone).

    ``cuda_peak_bytes`` is torch.cuda.max_memory_allocated() over a step (what the peak limit
    is checked on when there is one); ``peak_bytes`` is benchmark_memory.py's own step peak
    (MemTracker's, on any device).
    """
    modes = results.get('modes', {})
    figures = {}
    for precision, base, mesa in (('fp32', 'baseline', 'mesa:default'),
                                  ('amp', 'amp', 'mesa:default+amp')):
        if base not in modes or mesa not in modes:
            continue
        b, m = modes[base], modes[mesa]
        row: dict[str, float | None] = {
            f'baseline_{key[:-6]}_gib': round(b[key] / 2 ** 30, 3) if b.get(key) else None
            for key in ('cuda_peak_bytes', 'peak_bytes')}
        row.update({f'{key}_ratio': round(m[key] / b[key], 4) if m.get(key) and b.get(key)
                    else None for key in ('cuda_peak_bytes', 'peak_bytes', 'step_time_s',
                                          'saved_bytes')})
        figures[precision] = row
    return figures


def read_training_run(work_dir: Path, iters: int) -> dict:
    """Losses, validation mIoU and the checkpoint of a tools/train.py run."""
    runs = sorted(p for p in work_dir.glob('*/vis_data/scalars.json'))
    losses, miou = [], None
    if runs:
        for line in runs[-1].read_text().splitlines():
            record = json.loads(line)
            if 'mIoU' in record:
                miou = float(record['mIoU'])
            elif 'loss' in record:
                losses.append(float(record['loss']))
    checkpoint = work_dir / f'iter_{iters}.pth'
    return dict(iterations=len(losses), losses=losses,
                finite=bool(losses) and all(math.isfinite(x) for x in losses),
                final_loss=losses[-1] if losses else None, miou=miou,
                checkpoint=str(checkpoint) if checkpoint.exists() else None)


def format_summary(summary: dict) -> str:
    lines = [f'\ngpu_check summary ({summary["mode"]}, {summary.get("elapsed_s")} s):']
    for name, step in summary['steps'].items():
        if name == 'end':
            continue
        seconds = f'{step["seconds"]:.0f} s' if step.get('seconds') is not None else ''
        lines.append(f'  {name:<20} {step.get("status", ""):<10} {seconds:>6}  '
                     f'{str(step.get("note", ""))[:150]}')
    for key, value in summary['acceptance'].items():
        lines.append(f'  acceptance {key}: {value["value"]} (limit {value["limit"]}) '
                     f'{"holds" if value["holds"] else "FAILS"}')
    return '\n'.join(lines)
