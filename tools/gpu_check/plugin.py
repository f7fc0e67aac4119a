"""The pytest plugin of the CUDA-default test step (``-p gpu_check.plugin``, tools/ on the path)."""
from __future__ import annotations

import os
from typing import Any


def pytest_configure(config: Any) -> None:
    """Make $GPU_CHECK_DEFAULT_DEVICE torch's default device, so tests that create modules and
    tensors without naming a device run there."""
    device = os.environ.get('GPU_CHECK_DEFAULT_DEVICE')
    if device:
        import torch
        torch.set_default_device(device)
