"""The GPU run in one command: install what a bare GPU machine lacks, build the CUDA extension,
test it, measure it, and leave every result under OUT as it goes.

    bash tools/gpu_check.sh --out DIR                # on a GPU machine (or OUT=DIR)
    bash tools/gpu_check.sh --budget 510 --file-limit-mib 16 --cuda-arch 9.0   # a tighter one
    bash tools/gpu_check.sh --dry-run --out DIR      # here, on CPU, with .venv (the test runs it)

Steps, in order of value; each has its own timeout and all end within ``--budget`` seconds:

  env                 python, torch, CUDA, GPU, nvcc and which imports are missing (env.json)
  install             the carried wheels (.gpu-wheels/, tools/setup/prepare_gpu_wheels.sh)
                      into a --target folder on PYTHONPATH
  mmcv                mmcv 2.1.0: a carried wheel with ops if it loads; else, by default,
                      mmcv's Python part from the carried sdist with a stand-in for its compiled
                      ops (mmseg imports mmcv.ops at start; Mesa, Swin and UPerNet call no
                      mmcv op). --mmcv-build-s N builds the CPU ops in the background instead
                      (GPU hidden: CUDA ops would take far longer), with the stand-in if that
                      fails or takes longer than N seconds
  build_ext           mmseg_mesa._C (CPU kernels and CUDA for the visible GPUs, or
                      --cuda-arch; ``pip install --no-build-isolation -e .``)
  tests               tests/test_extension.py: kernel == reference bit for bit (CPU and CUDA
                      kernels), CUDA-kernel codes == CPU-kernel codes under both roundings
                      (summary.json's `cpu_cuda_codes`), DIVISION through the CUDA quantizer;
                      no test may skip on the GPU machine (tests.xml)
  tests_cuda_default  the layer / DIVISION / quantizer tests with torch's default device set to
                      the GPU, so their modules and tensors live there and backend='auto' takes
                      the kernels (less CPU autocast's; tests.xml)
  kernels             tools/benchmark_kernels.py (kernels.json)
  syncs               tools/benchmark_speed.py --count on Swin-T UPerNet 512x512, batch 2:
                      kernel ops and host syncs of one forward + backward, CUDA's own
                      synchronizing-call reports, step times in turn; Mesa adds no sync
                      (syncs.json)
  memory_bN           tools/benchmark_memory.py on Swin-T UPerNet 512x512: baseline and the
                      default preset in fp32 and AMP, batch 2 before the training run and 8
                      after it (memory.json; the ratios and their limits in summary.json)
  train               tools/train.py --amp on the demo config (fp16 with dynamic loss scale,
                      then bf16), finite losses, then the checkpoint in the plain config: a
                      strict state-dict load and tools/test.py (train.json)
  memory_presets_bN   the other presets in fp32 and AMP at both batches (into memory.json)
  compile             tools/benchmark_compile.py on Swin-T UPerNet 512x512, batch 2: the
                      compiled baseline and Mesa model's first step (the compile), graphs,
                      breaks (none in mmseg_mesa), recompiles (none), gradients against eager
                      Mesa, step times next to eager (compile.json)

summary.json is rewritten at every step's start and end, gpu_check.log gets every line as it
comes, so a run killed at its limit still leaves what it did. OUT gets these 9 files and the
mmcv wheel when one was built there (carry it next time: put it in .gpu-wheels/; --file-limit-mib
leaves out a larger one, for a machine that returns only small files).

The code is the package gpu_check/ beside this file (``tools.gpu_check`` to tests): cli.py holds
the options, settings.py the defaults (paths, versions, cores, limits, timeouts) and the sizes of
both runs.

The dry run is the same code on CPU with tiny sizes. It installs and builds nothing (the .venv
has it all and is shared), runs three tests of test_extension.py (their CPU cases run, their
CUDA cases skip) and one quantizer test through the default-device plugin, expects
benchmark_kernels.py to refuse without a GPU, counts the demo model's ops and syncs on CPU
(benchmark_speed.py --count), runs tools/benchmark_memory.py on CPU on the demo
model (64x64, batch 2, three modes), trains without --amp (mmengine's AmpOptimWrapper needs a
GPU), loads the checkpoint into the plain model but does not run tools/test.py, and compiles
the demo model (benchmark_compile.py, 64x64).
"""
from __future__ import annotations

import sys

from gpu_check.cli import main  # the package beside this file

if __name__ == '__main__':
    sys.exit(main(description=__doc__.split('\n\n')[0]))
