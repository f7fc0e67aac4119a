"""``python -m mmseg_mesa.info``: which Mesa backend runs here, for CPU and for CUDA tensors, and
why; and which module types Mesa converts, by layer type (read from the handler table, so a new
layer shows here once it is registered).

``--check`` also runs every op of the backend ``'auto'`` picks on each device (the CPU and
every visible GPU) against the pure-PyTorch reference (``selfcheck``), prints pass or fail per
op and device, and exits non-zero when any fails."""
from __future__ import annotations

import argparse
import time

import torch

from . import __version__, _backend, selfcheck
from .layer_types import opt_in_layer_types
from .registry import handled_types, handler_for_type


def _built_kernels(info) -> str:
    kinds = [name for name, built in (('CPU', getattr(info, 'CPU_KERNELS', False)),
                                      ('CUDA', getattr(info, 'CUDA_KERNELS', False))) if built]
    return ' + '.join(kinds) if kinds else 'none'


def _auto(device: torch.device) -> str:
    """What ``backend='auto'`` runs on ``device``, and why where it is not the kernels."""
    backend, reason = _backend.choose_backend(device, 'auto')
    return backend.name if reason is None else f'torch (pure-PyTorch reference; {reason})'


def collect() -> dict[str, str]:
    """The report as ordered ``label -> value`` lines."""
    report = {'mmseg_mesa': __version__, 'torch': torch.__version__,
              'torch CUDA': torch.version.cuda or 'none (CPU-only build)'}
    gpu = torch.cuda.is_available()
    if gpu:
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        report['GPU'] = f'cuda:{index} {torch.cuda.get_device_name(index)} (sm_{major}{minor})'
    else:
        report['GPU'] = 'none visible'

    info = _backend.build_info()
    kernels, error = _backend.load_extension()
    if kernels is not None:
        report['extension _C'] = 'built and loadable'
        report['built for torch'] = info.TORCH_VERSION
        report['compiled kernels'] = _built_kernels(kernels)
        report['CPU kernel threads'] = (
            f'torch\'s intra-op threads ({torch.get_num_threads()} here)' if kernels.CPU_PARALLEL
            else f'one (built without OpenMP, which this torch uses); {_backend.REINSTALL}')
        if kernels.CUDA_KERNELS:
            report['built for archs'] = (f'TORCH_CUDA_ARCH_LIST={info.CUDA_ARCH_LIST} '
                                         f'(nvcc: {kernels.CUDA_ARCHS}), CUDA '
                                         f'{kernels.CUDA_VERSION // 1000}.'
                                         f'{kernels.CUDA_VERSION % 1000 // 10}')
        else:
            report['CUDA kernels'] = getattr(info, 'CUDA_SKIP_REASON', None) or 'not built'
    else:
        report['extension _C'] = f'unavailable: {error}'
        if info is not None and info.EXTENSION:
            report['built for torch'] = info.TORCH_VERSION
            report['compiled kernels'] = _built_kernels(info)
            if getattr(info, 'CUDA_KERNELS', False):
                report['built for archs'] = f'TORCH_CUDA_ARCH_LIST={info.CUDA_ARCH_LIST}'

    report["backend='auto' for CPU tensors"] = _auto(torch.device('cpu'))
    if gpu or kernels is None or not kernels.CUDA_KERNELS:
        auto = _auto(torch.device('cuda', index if gpu else 0))
    else:  # which architecture the kernels must run is unknown until a GPU is visible
        auto = 'cuda kernels (once a GPU is visible)'
    report["backend='auto' for CUDA tensors"] = auto
    opt_in = opt_in_layer_types()
    for layer_type, names in converted_types().items():
        label = f'{layer_type}, only when named' if layer_type in opt_in else layer_type
        report[f'converts ({label})'] = ', '.join(names)
    return report


def converted_types() -> dict[str, list[str]]:
    """Layer type -> the names of the module types converted under it (subclasses whose forward
    is their base's are converted too; ``convert_to_mesa``'s report names any it leaves)."""
    by_type: dict[str, set[str]] = {}
    for module_type in handled_types():
        handler, reason = handler_for_type(module_type)
        if handler is not None and reason is None:
            by_type.setdefault(handler.layer_type, set()).add(module_type.__name__)
    return {layer_type: sorted(names) for layer_type, names in sorted(by_type.items())}


def check_kernels() -> bool:
    """Print ``selfcheck``'s result per device and op; whether every op agreed."""
    ok = True
    for device in selfcheck.available_devices():
        backend = selfcheck.compiled_backend(device)
        if backend is None:
            print(f'{device}: no compiled kernels run here (the reference does); nothing to '
                  'check')
            continue
        start = time.perf_counter()
        checks = selfcheck.check_backend(backend, device)
        elapsed = time.perf_counter() - start
        print(f'{device}: {backend.name} against the pure-PyTorch reference '
              f'({elapsed * 1000:.0f} ms)')
        width = max(map(len, selfcheck.OPS))
        for check in checks:
            ok &= check.ok
            verdict = 'pass' if check.ok else 'FAIL'
            print(f'  {check.op:<{width}} {verdict}  {check.detail}')
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m mmseg_mesa.info', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--check', action='store_true',
                        help='hold every op of the kernels to the reference on each device')
    args = parser.parse_args(argv)
    report = collect()
    width = max(map(len, report))
    for label, value in report.items():
        print(f'{label:<{width}} : {value}')
    if args.check and not check_kernels():
        print("Some kernels disagree with the reference: train with mesa = dict(backend='torch')")
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
