"""The demo's report (``tools/demo.py``): the table of both runs and the summary figure (loss
curves, saved bytes, step peaks and the largest batch in the planner's budget)."""
from __future__ import annotations

from typing import Any


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    from mmseg_mesa.memory import format_bytes
    base, mesa = summary['baseline'], summary['mesa']
    mib = 2.0 ** 20
    plans = base['budget_plan'], mesa['budget_plan']

    def ratio(key: str) -> str:
        return f'{mesa[key] / base[key]:.3f}' if base[key] else '-'

    def plan_ratio(key: str) -> str:
        return f'{plans[1][key] / plans[0][key]:.3f}' if plans[0][key] else '-'

    rows = [
        ('saved for backward, 1 step (MiB)', f'{base["saved_bytes"] / mib:.2f}',
         f'{mesa["saved_bytes"] / mib:.2f}', ratio('saved_bytes')),
        ('peak of one training step (MiB)', f'{base["step_peak_bytes"] / mib:.2f}',
         f'{mesa["step_peak_bytes"] / mib:.2f}', ratio('step_peak_bytes')),
        ('step peak per image (MiB)', *(f'{p["per_image_bytes"] / mib:.2f}' for p in plans),
         plan_ratio('per_image_bytes')),
        (f'largest batch in {format_bytes(plans[0]["budget_bytes"])} (planned)',
         *(str(p['max_batch']) for p in plans), plan_ratio('max_batch')),
        ('training step, timed in turn (ms)', f'{base["step_time_s"] * 1e3:.1f}',
         f'{mesa["step_time_s"] * 1e3:.1f}', f'{mesa["step_time_ratio"]:.3f}'),
        ('wall time of training (s)', f'{base["train_time_s"]:.1f}',
         f'{mesa["train_time_s"]:.1f}', ratio('train_time_s')),
        ('CPU time of training (s)', f'{base["cpu_time_s"]:.1f}',
         f'{mesa["cpu_time_s"]:.1f}', ratio('cpu_time_s')),
        ('final training loss', f'{base["final_loss"]:.4f}', f'{mesa["final_loss"]:.4f}', ''),
        ('val mIoU (%)', f'{base["miou"]:.2f}', f'{mesa["miou"]:.2f}', ''),
        ('val aAcc (%)', f'{base["aacc"]:.2f}', f'{mesa["aacc"]:.2f}', ''),
    ]
    header = ('', 'baseline', 'mesa', 'mesa/baseline')
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ['  '.join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])
             for r in [header, *rows]]
    lines.insert(1, '-' * len(lines[0]))
    return '\n'.join(lines)


def summary_figure(summary: dict[str, dict[str, Any]], curves: dict[str, dict[str, list]]
                   ) -> Any:
    """Loss curves; bars of saved activations, of a training step's peak and of the largest
    batch in the planner's budget, each on its own axes."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    from mmseg_mesa.memory import format_bytes

    names = list(summary)
    colours = {name: f'C{k}' for k, name in enumerate(names)}
    fig, (ax_loss, ax_saved, ax_peak, ax_batch) = plt.subplots(
        1, 4, figsize=(16, 4.2), gridspec_kw=dict(width_ratios=[2, 1, 1, 1]))
    for name in names:
        ax_loss.plot(curves[name]['iter'], curves[name]['loss'], color=colours[name],
                     label=f'{name} (val mIoU {summary[name]["miou"]:.1f}%)')
    ax_loss.set(xlabel='iteration', ylabel='training loss')
    ax_loss.set_title('Training loss', fontsize=10)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    mib = 2.0 ** 20
    budget = format_bytes(summary['baseline']['budget_plan']['budget_bytes'])
    for ax, values, fmt, ylabel, title in (
            (ax_saved, [summary[n]['saved_bytes'] / mib for n in names], '%.1f', 'MiB',
             'Saved for backward, 1 step'),
            (ax_peak, [summary[n]['step_peak_bytes'] / mib for n in names], '%.1f', 'MiB',
             'Peak of one training step\n(weights, gradients, AdamW, activations)'),
            (ax_batch, [summary[n]['budget_plan']['max_batch'] for n in names], '%d', 'images',
             f'Largest batch in {budget}, planned')):
        ratio = values[names.index('mesa')] / max(values[names.index('baseline')], 1e-9)
        title = f'{title}\n(mesa/baseline = {ratio:.2f})'
        bars = ax.bar(names, values, color=[colours[n] for n in names])
        ax.bar_label(bars, fmt=fmt)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def plot(summary: dict[str, dict[str, Any]], curves: dict[str, dict[str, list]], path: str
         ) -> None:
    """``summary_figure`` as a PNG."""
    import matplotlib.pyplot as plt
    fig = summary_figure(summary, curves)
    fig.savefig(path, dpi=100)
    plt.close(fig)
