"""Benchmark mmseg_mesa's compiled kernels: on one GPU (about a minute on an H100/H200), or
with ``--device cpu`` the CPU kernels (about a minute on two cores).

1. Throughput of observe / quantize / dequantize in GB/s (bytes read + written) and ns per
   element, next to a plain copy of the same activation measured in the same run, and the
   speed-up over the pure-PyTorch reference.
2. On a GPU: training step time (forward + backward) and peak memory of a Swin-like
   window-attention block converted with ``convert_to_mesa`` against the plain block, in fp32 and
   bf16 autocast. (CPU step times: ``tools/benchmark_speed.py``.)

Prints markdown tables; ``--json PATH`` also writes the rows. Exits non-zero without the device
or without its compiled kernels, rather than report numbers it did not measure.

    python tools/benchmark_kernels.py [--device cpu] [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from mmseg_mesa import _backend
from mmseg_mesa.bench.kernels import bench_blocks, bench_kernels, markdown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--device', choices=('cuda', 'cpu'), default='cuda',
                        help="the kernels to time (default: cuda; 'cpu': the CPU kernels on "
                             "torch's intra-op threads)")
    parser.add_argument('--json', metavar='PATH', help='also write the results as JSON')
    args = parser.parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():
        print('benchmark_kernels: no CUDA GPU is visible (torch.cuda.is_available() is False); '
              'nothing was measured.', file=sys.stderr)
        return 2
    kernels, error = _backend.load_extension()
    if kernels is not None and args.device == 'cuda':
        error = _backend.device_error(torch.device('cuda'))
    elif kernels is not None and not kernels.CPU_KERNELS:
        error = 'this build has no CPU kernels'
    if kernels is None or error is not None:
        print(f'benchmark_kernels: the compiled kernels for {args.device} are unusable here '
              f'({error}); see `python -m mmseg_mesa.info`.', file=sys.stderr)
        return 3
    torch.manual_seed(0)
    if args.device == 'cuda':
        device = torch.cuda.get_device_name()
    else:
        device = f'CPU, {torch.get_num_threads()} threads'
    print(f'# mmseg_mesa kernels on {device}, torch {torch.__version__}\n')
    kernel_rows = bench_kernels(kernels, args.device)
    print(markdown(kernel_rows, dict(case='activation', dtype='dtype', op='op', ms='ms',
                                     ns_per_element='ns / element', gb_per_s='GB/s',
                                     of_copy='of copy', speedup_vs_torch='x torch ref')))
    print(f'\ncopy = a copy of the same activation on the same device in the same run '
          f'({kernel_rows[0]["copy_gb_per_s"]:.1f} GB/s for the first case).\n')
    block_rows = bench_blocks() if args.device == 'cuda' else []
    if block_rows:
        print(markdown(block_rows, dict(case='block', precision='precision', variant='variant',
                                        ms='step ms', ratio_to_plain='x plain',
                                        peak_mib='peak MiB')))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(device=device, torch=torch.__version__, kernels=kernel_rows,
                           blocks=block_rows), f, indent=2)
    return 0


if __name__ == '__main__':
    sys.exit(main())
