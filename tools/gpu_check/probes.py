"""What the steps run in a child Python, under the steps' environment: ``tools/gpu_check.py
--report-env`` and ``--load-check CONFIG CHECKPOINT`` print one JSON line each."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from .settings import MODULES


def report_env() -> dict:
    """What this Python has: versions, GPUs, build tools and which of ``MODULES`` import."""
    import importlib
    import platform
    report: dict[str, Any] = dict(python=sys.version.split()[0], executable=sys.executable,
                                  platform=platform.platform(), cpus=os.cpu_count())
    modules: dict[str, dict] = {}
    for module in MODULES:
        try:
            imported = importlib.import_module(module)
            modules[module] = dict(ok=True, version=str(getattr(imported, '__version__', '')),
                                   file=str(getattr(imported, '__file__', '')))
        except Exception as error:  # any failure to import is the finding
            modules[module] = dict(ok=False, error=f'{type(error).__name__}: {error}'[:400])
    report['modules'] = modules
    try:
        import torch
        report.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                      cuda_available=torch.cuda.is_available(), gpus=[])
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            report['gpus'].append(dict(name=props.name, capability=f'{props.major}.{props.minor}',
                                       memory_gib=round(props.total_memory / 2 ** 30, 1),
                                       multiprocessors=props.multi_processor_count))
    except Exception as error:
        report['torch_error'] = repr(error)
    try:
        from mmseg_mesa.config import PRESETS
        report['presets'] = list(PRESETS)
    except Exception as error:
        report['presets_error'] = repr(error)
    for tool, args in (('nvcc', ['--version']), ('nvidia-smi', [
            '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader']),
            ('gcc', ['--version']), ('ninja', ['--version']), ('taskset', ['--version'])):
        path = shutil.which(tool)
        if path is None:
            report[tool.replace('-', '_')] = None
            continue
        try:
            out = subprocess.run([path, *args], capture_output=True, text=True, timeout=30)
            lines = (out.stdout or out.stderr).strip().splitlines()
            release = [line for line in lines if 'release' in line]
            report[tool.replace('-', '_')] = (release or lines or [''])[0]
        except (OSError, subprocess.TimeoutExpired) as error:
            report[tool.replace('-', '_')] = f'failed: {error}'
    return report


def load_check(config: str, checkpoint: str) -> dict:
    """Load a checkpoint strictly into the model of ``config`` (plain mmseg, no Mesa)."""
    import torch
    from mmengine.config import Config
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    from mmseg_mesa.integrations import allow_mmengine_checkpoints
    register_all_modules()
    allow_mmengine_checkpoints()
    cfg = Config.fromfile(config)
    model = MODELS.build(cfg.model)
    state = torch.load(checkpoint, map_location='cpu')['state_dict']
    missing, unexpected = model.load_state_dict(state, strict=False)
    mesa_modules = sorted({type(m).__name__ for m in model.modules() if 'Mesa' in type(m).__name__})
    return dict(config=config, missing=list(missing), unexpected=list(unexpected),
                mesa_modules=mesa_modules,
                strict_ok=not missing and not unexpected and not mesa_modules, keys=len(state))
