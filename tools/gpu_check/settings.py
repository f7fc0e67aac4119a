"""The GPU run's defaults, in one place: the files it writes, what a workstation allows it (time,
file sizes, cores), the sizes of the run and of its CPU dry run. A machine with tighter limits
passes them as options (``tools/gpu_check.py --help``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / 'tools' / 'gpu_check.py'  # run again as a child for --report-env / --load-check
SWIN_T = 'configs/swin/mesa_swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
MESA_DEMO = 'configs/demo/mesa_swin-mini_upernet_demo.py'
PLAIN_DEMO = 'configs/demo/swin-mini_upernet_demo.py'

# The result files OUT gets (a machine that returns only some files reads these first); the
# largest file copied there otherwise (--file-limit-mib; default none: a built mmcv wheel, to
# carry next time).
OUT_FILES = ('summary.json', 'gpu_check.log', 'env.json', 'tests.xml', 'kernels.json',
             'syncs.json', 'memory.json', 'train.json', 'compile.json')
FILE_LIMIT_MIB = None

# No network is assumed: mmcv comes as a carried sdist. The extension is built for the visible
# GPUs' architectures (torch's default) unless --cuda-arch names them.
MMCV_VERSION = '2.1.0'
MMCV_SDIST = f'mmcv-{MMCV_VERSION}.tar.gz'
STEP_THREADS = 4               # OMP_NUM_THREADS of every step on the GPU machine (1 in a dry run)
FOREGROUND_CORES = 4           # cores 0..3 run the steps while mmcv's ops build on the others
PINNING_MIN_CORES = 8          # fewer cores: no pinning, the build takes them all
GPU_BUDGET_S = 1800.0          # the whole run (--budget); its steps are sized to fit 510 s
DRY_BUDGET_S = 900.0           # a dry run's steps are short, unless the CPU is shared
GPU_WORK = '/tmp/gpu_check'    # scratch outside OUT (only OUT comes back)
MIN_STEP_S = 20                # a step that would get less than this is skipped
RESERVE_S = 10                 # kept for the last summary

# What the steps import, under their import names (env.json lists each).
MODULES = ['torch', 'numpy', 'cv2', 'matplotlib', 'scipy', 'yaml', 'rich', 'regex', 'packaging',
           'PIL', 'pytest', 'ninja', 'setuptools', 'pkg_resources', 'wheel', 'addict', 'yapf',
           'platformdirs', 'termcolor', 'ftfy', 'wcwidth', 'prettytable', 'mmengine', 'mmcv',
           'mmcv.ops', 'mmseg', 'mmseg.models', 'mmengine.runner', 'mmseg_mesa',
           'mmseg_mesa.integrations', 'mmseg_mesa._C']

# The limits the GPU run checks (summary.json's "acceptance"): the default preset's step peak
# and step time against the baseline's, in fp32 and in AMP, and the slowest kernel's throughput
# as a fraction of a plain device copy's.
PEAK_RATIO_MAX, TIME_RATIO_MAX, KERNEL_OF_COPY_MIN = 0.45, 1.10, 0.7


@dataclass(frozen=True)
class Sizes:
    """What a run covers: the GPU run's sizes, or the dry run's tiny ones."""

    test_files: tuple[str, ...]
    cuda_default_files: tuple[str, ...]
    memory_config: str
    memory_batches: tuple[int, ...]
    memory_iters: int | None             # None: benchmark_memory's default
    speed_iters: int                     # benchmark_speed's timed rounds (the syncs step)
    memory_modes: tuple[str, ...]        # measured at each batch; the limits compare these
    memory_presets: bool                 # then every other preset, with and without AMP
    train_iters: int
    train_batch: int
    amp_dtypes: tuple[str, ...]          # AmpOptimWrapper dtypes; () trains without --amp
    test_tool: bool                      # also evaluate the checkpoint with tools/test.py
    caps: dict[str, int] = field(default_factory=dict)  # step -> timeout in seconds


LAYER_TESTS = ('tests/test_layers.py', 'tests/test_division.py', 'tests/test_quantizer.py')
# Left out of the CUDA-default run: CPU autocast, which leaves CUDA ops alone (the training run's
# AMP is its CUDA counterpart). Draws from a CPU generator name their device there
# (tests/conftest.py ``drawn``), so every other layer test runs.
CPU_ONLY_TESTS = ('test_autocast',)
GPU = Sizes(test_files=('tests/test_extension.py',), cuda_default_files=LAYER_TESTS,
            memory_config=SWIN_T, memory_batches=(2, 8), memory_iters=None, speed_iters=5,
            memory_modes=('baseline', 'mesa:default', 'amp', 'mesa:default+amp'),
            memory_presets=True, train_iters=20, train_batch=8, amp_dtypes=('float16', 'bfloat16'),
            test_tool=True,
            caps=dict(env=90, install=90, build_ext=300, tests=200, tests_cuda_default=150,
                      kernels=150, syncs=150, memory=150, memory_presets=150, train=200,
                      compile=300))
# The test that holds the CUDA kernels' codes to the CPU kernels' (both roundings): its outcome
# is the summary's `cpu_cuda_codes` acceptance entry.
CROSS_DEVICE_TEST = 'test_cuda_and_cpu_kernels_give_the_same_codes'
DRY = Sizes(test_files=('tests/test_extension.py::test_arch_coverage',
                        'tests/test_extension.py::test_kernels_match_reference',
                        f'tests/test_extension.py::{CROSS_DEVICE_TEST}'),
            cuda_default_files=('tests/test_quantizer.py::test_mask_round_trip',),
            memory_config=MESA_DEMO, memory_batches=(2,), memory_iters=1, speed_iters=1,
            memory_modes=('baseline', 'mesa:default', 'amp'), memory_presets=False,
            train_iters=2, train_batch=2,
            amp_dtypes=(), test_tool=False,
            caps=dict(env=180, build_ext=120, tests=240, tests_cuda_default=120,
                      kernels=120, syncs=120, memory=240, train=360, compile=400))
