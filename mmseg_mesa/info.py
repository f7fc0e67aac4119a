"""``python -m mmseg_mesa.info``: which Mesa backend runs here, for CPU and for CUDA tensors, and
why."""
from __future__ import annotations

import torch

from . import __version__, _backend


def _built_kernels(info) -> str:
    kinds = [name for name, built in (('CPU', getattr(info, 'CPU_KERNELS', False)),
                                      ('CUDA', getattr(info, 'CUDA_KERNELS', False))) if built]
    return ' + '.join(kinds) if kinds else 'none'


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

    report["backend='auto' for CPU tensors"] = (
        'cpu kernels' if kernels is not None else f'torch (pure-PyTorch reference; {error})')
    if kernels is None:
        auto = f'torch (pure-PyTorch reference; {error})'
    elif not kernels.CUDA_KERNELS:
        auto = f'torch ({_backend.cuda_kernels_error(kernels, torch.device("cuda", 0))})'
    elif not gpu:
        auto = 'cuda kernels (once a GPU is visible)'
    else:
        device_error = _backend.device_error(torch.device('cuda', index))
        auto = 'cuda kernels' if device_error is None else f'torch ({device_error})'
    report["backend='auto' for CUDA tensors"] = auto
    return report


def main() -> None:
    report = collect()
    width = max(map(len, report))
    for label, value in report.items():
        print(f'{label:<{width}} : {value}')


if __name__ == '__main__':
    main()
